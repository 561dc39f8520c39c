"""``txlm eval CKPT`` on a classifier checkpoint: accuracy, per-class precision, recall and
F1, and the confusion matrix of a split of its ``classes:DIR`` dataset (the split the run
recorded: the same seed and fractions)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from txlm.errors import ConfigError

if TYPE_CHECKING:
    from txlm.checkpoints.checkpoint import Checkpoint

# eval's options that mean something only for a language model's token stream
_LM_ONLY = ("tgt_len", "mem_len", "clamp_len", "same_length", "max_steps")


def run(args: argparse.Namespace, ckpt: Checkpoint) -> int:

    from txlm.checkpoints.dataset import dataset_of
    from txlm.classify.classes import open_classes
    from txlm.classify.evaluation import evaluate_documents, report
    from txlm.devices import resolve_device
    from txlm.errors import CheckpointError

    given = [f"--{n.replace('_', '-')}" for n in _LM_ONLY if getattr(args, n) is not None]
    given += [f"--{n.replace('_', '-')}" for n in ("kv_cache", "compile") if getattr(args, n)]
    if args.precision != "fp32":  # (a classifier's evaluation runs its float32 weights)
        given.append(f"--precision {args.precision}")
    if given:
        raise ConfigError(f"{', '.join(given)}: not options of a classifier's evaluation")
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    saved = ckpt.data
    train = saved.get("train") or {}
    ref = dataset_of(ckpt, dataset=args.dataset)
    if ref is None:
        raise CheckpointError(f"{args.checkpoint} does not name its dataset: pass --dataset")
    dataset = ref.name
    model = ckpt.load_model(resolve_device(args.device), align_heads=False, task="classify")
    if model.vocab is None:
        raise CheckpointError(f"{args.checkpoint} has no vocab.json: cannot encode the dataset")
    split_options = train.get("classify") or {}
    data = open_classes(
        ref.source, model.vocab, seed=(train.get("run") or {}).get("seed", 0),
        valid_fraction=split_options.get("valid_fraction", 0.1),
        test_fraction=split_options.get("test_fraction", 0.1),
    )  # fmt: skip
    if data.labels != list(model.labels):
        raise CheckpointError(
            f"{dataset} has labels {data.labels}, the classifier {list(model.labels)}"
        )
    documents = data.split(args.split)
    if not len(documents):
        raise ConfigError(f"{dataset}: the {args.split} split holds no documents")
    result = evaluate_documents(
        model, documents, batch_size=args.batch_size or 8,
        progress=not args.no_progress and not args.json, desc=args.split,
    )  # fmt: skip
    result.update(checkpoint=str(args.checkpoint), split=args.split, dataset=dataset)
    print(json.dumps(result) if args.json else report(result, args.split))
    return 0
