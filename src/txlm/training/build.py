"""What a run is built from: its corpus, the stream of training batches, the optimizer.

Legend: B global batch rows, W ranks (each takes B / W contiguous rows), L segment length.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from txlm.config import ModelConfig
from txlm.data import PreparedCorpus, SentenceStreamIterator, StreamIterator, open_corpus
from txlm.data.vocab import Vocab
from txlm.errors import ConfigError
from txlm.training import distributed as dist
from txlm.training.config import TrainConfig


def open_training_corpus(
    config: TrainConfig,
    dist_info: dist.DistInfo,
    *,
    echo: bool,
    vocab: Vocab | None = None,
    lower_case: bool = False,
) -> PreparedCorpus:
    """Rank 0 prepares the corpus (download, tokenise); the others then read the folder.

    ``vocab``: encode it with this vocabulary (a run started from a checkpoint), not one
    built from its train split; ``lower_case``: lower-case the text first.
    """
    d = config.data
    corpus = None
    given = {"vocab": vocab, "lower_case": lower_case, "level": None if vocab else d.level}
    if dist_info.is_main:
        progress = echo and config.run.progress and sys.stderr.isatty()
        corpus = open_corpus(d.dataset, d.data_dir, progress=progress, **given)
    dist.barrier()
    if corpus is None:
        corpus = open_corpus(d.dataset, d.data_dir, **given)
    return corpus


def unknown_shares(corpus: PreparedCorpus) -> dict[str, float] | None:
    """Each split's share of tokens that are the unknown symbol (None: the vocabulary has
    none, so no token is unknown)."""
    if corpus.vocab.unk_id is None:
        return None
    shares = {}
    for split in ("train", "valid", "test"):
        unk = corpus.unk_tokens(split) or 0
        shares[split] = unk / max(int(corpus.meta["splits"][split]["tokens"]), 1)
    return shares


def training_stream(
    corpus: PreparedCorpus,
    config: TrainConfig,
    model_config: ModelConfig,
    dist_info: dist.DistInfo,
    device: torch.device,
) -> StreamIterator | SentenceStreamIterator:
    """This rank's rows of the train split, [B / W, L] a batch, continuing across batches
    (lm1b: shuffled sentences packed into the rows)."""
    iterator = SentenceStreamIterator if corpus.meta.get("dataset") == "lm1b" else StreamIterator
    doc_starts = corpus.doc_starts("train")
    return iterator(
        corpus.split("train"),
        config.data.batch_size,
        model_config.tgt_len,
        doc_starts=doc_starts if len(doc_starts) else None,
        doc_mode=config.data.doc_mode,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
        varlen=config.data.varlen,
        seed=config.run.seed,
        device=device,
    )


def frozen_parameters(model: nn.Module, prefixes: list[str]) -> list[nn.Parameter]:
    """The parameters ``optim.freeze`` keeps as they are: those with a name (any of a tied
    tensor's names) starting with one of ``prefixes``; a prefix that names none is refused."""
    frozen: dict[int, nn.Parameter] = {}
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    for prefix in prefixes:
        hits = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
                if n == prefix or n.startswith(prefix.rstrip(".") + ".")]  # fmt: skip
        if not hits:
            tops = sorted({n.split(".")[0] for n in names})
            raise ConfigError(
                f"optim.freeze: {prefix!r} names no parameter (names start with {', '.join(tops)})"
            )
        frozen.update((id(p), p) for _, p in hits)
    if frozen and len(frozen) == len({id(p) for p in model.parameters()}):
        raise ConfigError("optim.freeze covers every parameter: nothing would train")
    return list(frozen.values())


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    o = config.optim
    opt_cls = torch.optim.AdamW if o.optimizer == "adamw" else torch.optim.Adam
    # fused: one kernel per step over all tensors instead of ~10 ops per tensor, on CPU
    # and CUDA alike; the same update rule.
    return opt_cls(
        list(model.parameters()),  # tied tensors appear once
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=True,
    )
