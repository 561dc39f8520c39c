"""Classification (``task: classify``) as the trainer's task: a Transformer-XL body reads
each labelled document segment by segment with its memory and a head labels it.

Legend: B global batch (documents), W ranks, b = B / W, A gradient-accumulation chunks of
c = b / A documents, N documents of the global batch.

- data: ``data.dataset=classes:DIR`` (``txlm.classify.classes``), encoded with the ``--init``
  checkpoint's vocabulary; the split is recorded in the prepared data folder and in every
  checkpoint's config.json (``dataset``);
- batches: ``txlm.classify.documents.DocumentBatches`` (length buckets, exact resume), the
  trainer's ``data`` component; a label per document, so N counts documents;
- model: ``txlm.classify.classifier.Classifier``, the body built from the model section (the
  init checkpoint's weights copied in) and a new head;
- loss of a chunk: its documents read and classified in one forward, sum(cross-entropy);
  with the trainer's scale W / N the gradient is the mean over the global batch's documents
  whatever W and A. A batch holds whole documents, so no memory is carried to the next;
- validation: mean cross-entropy (the ``loss`` that decides ``best``) and accuracy of the
  valid split; the final evaluation adds per-class scores on valid and test.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from txlm.checkpoints.checkpoint import load_classifier
from txlm.classify.classes import ClassDataset, is_classes, open_classes
from txlm.classify.classifier import Classifier, ClassifierConfig
from txlm.classify.documents import DocumentBatch, DocumentBatches
from txlm.classify.evaluation import evaluate_documents
from txlm.classify.predict import checkpoint_extras
from txlm.config import ModelConfig
from txlm.data.prepared import default_data_dir
from txlm.data.vocab import Vocab
from txlm.errors import ConfigError
from txlm.model import TransformerXL, align
from txlm.model.align import Stored
from txlm.training import distributed as dist
from txlm.training.config import TrainConfig
from txlm.training.state import MemoryChunk

# The training rows' metric: the cross-entropy in bits per document (log2 C at chance);
# validation adds the accuracy.
METRIC = "bits"


class ClassifyTask:
    """The classification pieces of a run, from its configuration and the vocabulary of
    the checkpoint it starts from."""

    metric = METRIC
    level = "document"
    unit, counted = "doc", "documents"  # what a step and an evaluation count
    compiles = False  # a forward loops over a batch's segments, a number that varies
    reported: tuple[str, ...] = ("accuracy",)

    def __init__(
        self,
        config: TrainConfig,
        vocab: Vocab | None,
        dist_info: dist.DistInfo,
        *,
        echo: bool,
        lower_case: bool = False,
    ) -> None:
        d, c = config.data, config.classify
        if vocab is None:
            raise ConfigError("--task classify fine-tunes a language model: pass --init CKPT")
        if not is_classes(d.dataset):
            raise ConfigError(f"--task classify reads data.dataset=classes:DIR, got {d.dataset!r}")
        if config.run.compile is True:
            raise ConfigError(
                "run.compile=true: a classifier's forward loops over each batch's segments "
                "(a number that varies) and runs eager; use run.compile=auto or false"
            )
        self.config, self.vocab, self.echo = config, vocab, echo
        self.dataset: ClassDataset = open_classes(
            d.dataset, vocab, seed=config.run.seed, valid_fraction=c.valid_fraction,
            test_fraction=c.test_fraction,
        )  # fmt: skip
        if dist_info.is_main:
            where = self.dataset.record(Path(d.data_dir) if d.data_dir else default_data_dir())
            if echo:
                counts = ", ".join(f"{s} {len(self.dataset.split(s))}" for s in self.dataset.splits)
                print(f"txlm train: {len(self.dataset.labels)} labels, {counts} documents; "
                      f"split recorded in {where}")  # fmt: skip
        self.unknown = self.unknown_shares()

    def unknown_shares(self) -> dict[str, float] | None:
        """Each split's share of tokens that are the vocabulary's unknown symbol (None: it
        has none), as a language model's run reports it for its corpus."""
        unk = self.vocab.unk_id
        if unk is None:
            return None
        shares = {}
        for split in self.dataset.splits:
            docs = self.dataset.split(split).docs
            total = sum(int(d.size) for d in docs)
            shares[split] = sum(int((d == unk).sum()) for d in docs) / max(total, 1)
        return shares

    # -- what the trainer builds ----------------------------------------------------------
    def classifier_config(self) -> ClassifierConfig:
        c = self.config.classify
        return ClassifierConfig(
            labels=tuple(self.dataset.labels), pooling=c.pooling, grad_segments=c.grad_segments
        )

    @staticmethod
    def shaped(body: TransformerXL) -> Classifier:
        """The task's model around ``body``, for its parameter names and sizes (body.*,
        head.*; any two labels)."""
        return Classifier(body, ClassifierConfig(("0", "1")))

    def build_model(self, model_config: ModelConfig, stored: Stored | None = None) -> Classifier:
        """A body of ``model_config`` stored with ``stored`` (txlm.model.align: padded from
        the unpadded one, so the same initial weights) and a new head."""
        body = align.padded(TransformerXL(model_config), stored)
        return Classifier(body, self.classifier_config())

    def body(self, model: Classifier) -> TransformerXL:
        return model.body

    def start(self, model: Classifier, device: torch.device, *, compiled: bool) -> None:
        """Nothing to prepare: a classifier's step sizes nothing on the host."""

    def batches(
        self, model_config: ModelConfig, dist_info: dist.DistInfo, device: torch.device
    ) -> DocumentBatches:
        return DocumentBatches(
            self.dataset.split("train"), self.config.data.batch_size, model_config.tgt_len,
            rank=dist_info.rank, world_size=dist_info.world_size, seed=self.config.run.seed,
            device=device,
        )  # fmt: skip

    def run_info(self, model: Classifier) -> dict[str, Any]:
        """What every checkpoint's config.json records of the task and its data."""
        return {**checkpoint_extras(model), "dataset": {**self.dataset.meta, "metric": METRIC}}

    def labels(self, batch: DocumentBatch) -> Tensor:
        return batch.labels

    def loss(
        self,
        model: Any,
        batch: DocumentBatch,
        labels: Tensor,
        rows: slice,
        memory: MemoryChunk,
    ) -> tuple[Tensor, None]:
        """sum(cross-entropy) of the chunk's documents; nothing carried to the next step."""
        out = model(batch.input_ids[rows], batch.start[rows], labels[rows])
        return out.losses.float().sum(), None

    # -- evaluation -------------------------------------------------------------------------
    @staticmethod
    def metric_value(loss: float) -> float:
        return loss / math.log(2)

    def evaluate_split(
        self, model: Classifier, split: str, *, full: bool = True, desc: str | None = None
    ) -> dict[str, Any]:
        """Every document of ``split``, whatever ``full``; a full evaluation (init valid, the
        final one) shows its progress."""
        return self._evaluate(model, split, progress=full and self.echo, desc=desc)

    def _evaluate(
        self, model: Classifier, split: str, *, progress: bool, desc: str | None
    ) -> dict[str, Any]:
        result = evaluate_documents(
            model, self.dataset.split(split), batch_size=self.config.eval.batch_size,
            progress=progress and self.config.run.progress, desc=desc or split,
        )  # fmt: skip
        result.update(split=split, bits=self.metric_value(result["loss"]))
        return result

    def final_evaluation(
        self, model: Classifier, out: Path, device: torch.device, *, echo: bool
    ) -> dict[str, Any]:
        """Valid and test on ``out/best`` (``model`` when there is none)."""
        best = out / "best"
        if best.exists():
            model = load_classifier(best, device=device)
        summary: dict[str, Any] = {"metric": "accuracy"}
        for split in ("valid", "test"):
            if not len(self.dataset.split(split)):
                continue
            result = self._evaluate(model, split, progress=echo, desc=f"final {split}")
            summary[split] = result
            if echo:
                print(
                    f"{split}: accuracy {result['accuracy']:.4f}, macro F1 "
                    f"{result['macro_f1']:.4f}, loss {result['loss']:.4f} over "
                    f"{result['documents']} documents, {result['docs_per_s']:.1f} documents/s"
                )
        return summary
