"""What a run is built from: its corpus, the stream of training batches, the optimizer.

Legend: B global batch rows, W ranks (each takes B / W contiguous rows), L segment length.
"""

from __future__ import annotations

import sys
from pathlib import Path

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
    if vocab is None and d.level is None:  # every rank, before any of them prepares
        d.level = level_prepared(d.dataset, d.data_dir, echo=echo and dist_info.is_main)
    corpus = None
    given = {"vocab": vocab, "lower_case": lower_case, "level": None if vocab else d.level}
    if dist_info.is_main:
        progress = echo and config.run.progress and sys.stderr.isatty()
        corpus = open_corpus(d.dataset, d.data_dir, progress=progress, **given)
        skipped = (corpus.meta.get("corpus") or {}).get("skipped_empty") or []
        if echo and skipped and not corpus.reused:  # as txlm prepare says it
            print(
                f"{d.dataset}: skipped {len(skipped)} empty document(s): {', '.join(skipped[:3])}"
            )
    dist.barrier()
    if corpus is None:
        corpus = open_corpus(d.dataset, d.data_dir, **given)
    return corpus


def level_prepared(dataset: str, data_dir: str | None, *, echo: bool) -> str | None:
    """The level to train ``dataset`` at when ``data.level`` is unset: its default (None),
    unless the default is not prepared and one other level is (``txlm prepare X --level bpe``
    then ``txlm train --set data.dataset=X``): that one, said in a line. Several other levels
    and not the default: refused, naming them."""
    from txlm.data import recall, sources
    from txlm.data.corpora import SPECS
    from txlm.data.prepare import prepared_folder
    from txlm.data.prepared import default_data_dir

    if recall.is_recall(dataset) or (Path(dataset) / "meta.json").is_file():
        return None
    kind, _ = sources.parse_name(dataset)
    folder = Path(data_dir) if data_dir else default_data_dir()
    spec = SPECS[kind]
    there = [
        lv for lv in spec.levels if (prepared_folder(dataset, folder, lv) / "meta.json").is_file()
    ]
    if not there or spec.default_level in there:
        return None
    if len(there) > 1:
        raise ConfigError(
            f"{dataset} is prepared in {folder} at the levels {', '.join(there)}, not at its "
            f"default {spec.default_level}: choose one with data.level"
        )
    if echo:
        print(
            f"{dataset}: prepared at the {there[0]} level only (in {folder}): training at that "
            f"level (data.level={spec.default_level} prepares the default instead)"
        )
    return there[0]


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
