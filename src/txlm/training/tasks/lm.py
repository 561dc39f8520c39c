"""Language modelling, the paper's training (Sec. 3.2, 4), as the trainer's task.

Legend: b rows of this rank, c = b / A rows of one gradient-accumulation chunk, L segment
length, M memory length, D model dim.

- data: the prepared corpus (``txlm.training.build.open_training_corpus``: rank 0 prepares,
  the others read; a run started from a checkpoint encodes it with that vocabulary);
- batches: B contiguous rows (``StreamIterator``, lm1b's ``SentenceStreamIterator``), row i
  of step t+1 continuing row i of step t, so row i's memory is its true preceding text;
- labels: the objective (``optim.loss``) sets the positions the loss does not count to -100
  before the step counts the tokens N;
- loss of a chunk: the chunk's rows with their memory, sum(token losses); the chunk's new
  memory is carried to the next step; where the step is compiled or on CUDA the adaptive
  softmax's tail buckets are sized on the host from the chunk's labels (``TailBuckets``);
- validation: the valid split streamed with the evaluation lengths; the final evaluation
  adds test and a sample (``txlm.training.evaluation``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from txlm.checkpoints.dataset import dataset_record
from txlm.config import ModelConfig
from txlm.data import PreparedCorpus, SentenceStreamIterator, StreamIterator
from txlm.data.vocab import Vocab
from txlm.model import TransformerXL, align
from txlm.model.align import Stored
from txlm.training import distributed as dist
from txlm.training.build import open_training_corpus, training_stream, unknown_shares
from txlm.training.config import TrainConfig
from txlm.training.evaluation import evaluate_split, final_evaluation
from txlm.training.objective import OBJECTIVES
from txlm.training.state import Carry, MemoryChunk
from txlm.training.step import TailBuckets, tail_buckets


class LanguageModelTask:
    """``task: lm``: the corpus, its stream of rows, the model and its evaluation."""

    unit, counted = "tok", "tokens"  # what a step and an evaluation count
    compiles = True
    reported: tuple[str, ...] = ()

    def __init__(
        self,
        config: TrainConfig,
        vocab: Vocab | None,
        dist_info: dist.DistInfo,
        *,
        echo: bool,
        lower_case: bool = False,
    ) -> None:
        self.config, self.echo, self.world = config, echo, dist_info.world_size
        self.given_vocab, self.lower_case = vocab is not None, lower_case
        self.corpus: PreparedCorpus = open_training_corpus(
            config, dist_info, echo=echo, vocab=vocab, lower_case=lower_case
        )
        self.vocab = self.corpus.vocab
        self.level = self.corpus.level
        self.metric = self.corpus.metric
        # a run started from a checkpoint's vocabulary: how much of the corpus it cannot name
        self.unknown = unknown_shares(self.corpus) if vocab is not None else None
        self.objective = OBJECTIVES[config.optim.loss]
        self.buckets: TailBuckets | Any = None  # set by ``start``

    # -- what the trainer builds ----------------------------------------------------------
    @staticmethod
    def shaped(body: TransformerXL) -> TransformerXL:
        """The task's model around ``body``, for its parameter names and sizes."""
        return body

    def build_model(self, model_config: ModelConfig, stored: Stored | None) -> TransformerXL:
        """The model stored with ``stored`` (txlm.model.align), padded from the unpadded one:
        the same initial weights."""
        return align.padded(TransformerXL(model_config), stored)

    def body(self, model: TransformerXL) -> TransformerXL:
        return model

    def batches(
        self, model_config: ModelConfig, dist_info: dist.DistInfo, device: torch.device
    ) -> StreamIterator | SentenceStreamIterator:
        return training_stream(self.corpus, self.config, model_config, dist_info, device)

    def start(self, model: TransformerXL, device: torch.device, *, compiled: bool) -> None:
        """The tail buckets' sizes for a chunk of the model's rows (None: the softmax counts
        its clusters' tokens itself)."""
        c = self.config
        rows = c.data.batch_size // self.world // c.optim.grad_accum
        self.buckets = tail_buckets(
            model, self.corpus.split("train"), device, compiled, tokens=rows * model.config.tgt_len
        )

    def run_info(self, model: TransformerXL) -> dict[str, Any]:
        """What every checkpoint's config.json records of the corpus (found again from any
        directory: ``txlm.checkpoints.dataset``)."""
        record = dataset_record(
            self.config.data.dataset, self.corpus.path, level=self.corpus.level,
            metric=self.metric, given_vocab=self.given_vocab, lower_case=self.lower_case,
        )  # fmt: skip
        return {"dataset": record}

    # -- one chunk ----------------------------------------------------------------------------
    def labels(self, batch: Any) -> Tensor:
        return self.objective(batch.labels)

    def loss(
        self,
        model: Any,
        batch: Any,
        labels: Tensor,
        rows: slice,
        memory: MemoryChunk,
    ) -> tuple[Tensor, Carry]:
        """sum(token losses) of the chunk's rows, read with their memory; their new memory."""
        mems, mask = memory
        sizes = None
        if self.buckets is not None:
            if batch.host_labels is None:
                raise ValueError("sized tail buckets need the batch's labels on the host")
            sizes = self.buckets(batch.host_labels[rows])
        reset = None if batch.reset is None else batch.reset[rows]
        out = model(
            batch.input_ids[rows], mems=mems, reset=reset, labels=labels[rows],
            mem_mask=mask, bucket_sizes=sizes,
        )  # fmt: skip
        return out.losses.float().sum(), (out.mems, out.mem_mask)

    # -- evaluation -------------------------------------------------------------------------
    def metric_value(self, loss: float) -> float:
        return self.corpus.metric_value(loss, "train")

    def evaluate_split(
        self, model: TransformerXL, split: str, *, full: bool, desc: str | None = None
    ) -> dict[str, Any]:
        """``split`` streamed with the evaluation lengths: ``eval.max_eval_steps`` segments, or
        when ``full`` up to ``eval.final_max_tokens`` tokens."""
        return evaluate_split(
            model, self.corpus, self.config, split, full=full, echo=self.echo, desc=desc
        )

    def final_evaluation(
        self, model: TransformerXL, out: Path, device: torch.device, *, echo: bool
    ) -> dict[str, Any]:
        return final_evaluation(model, self.corpus, self.config, out, device, echo=echo)
