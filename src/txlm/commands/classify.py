"""``txlm classify CKPT FILE...``: each file's label and every label's probability.

Each file is one document, encoded with the checkpoint's vocabulary and read segment by
segment with the memory (constant memory, whatever its length). ``--json``: one object per
line, ``{"file", "label", "probs"}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from txlm.commands.options import add_device_options, apply_threads


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "classify",
        help="label documents with a classifier checkpoint (txlm train --task classify)",
        description="Print each file's label and the labels' probabilities.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="classifier checkpoint directory")
    p.add_argument(
        "files", metavar="FILE", nargs="+", type=Path,
        help="UTF-8 text documents (-: standard input)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=int, default=8, metavar="N",
        help="documents read together (similar lengths batched; default 8)",
    )  # fmt: skip
    add_device_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line per file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    from txlm.checkpoints.checkpoint import Checkpoint
    from txlm.classify.classes import read_document
    from txlm.classify.predict import predict
    from txlm.devices import resolve_device
    from txlm.errors import CheckpointError, ConfigError

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if [str(f) for f in args.files].count("-") > 1:
        raise ConfigError("- (standard input) can be one document only: name it once")
    apply_threads(args)
    model = Checkpoint.open(args.checkpoint).load_model(
        resolve_device(args.device), align_heads=False, task="classify"
    )
    if model.vocab is None:
        raise CheckpointError(f"{args.checkpoint} has no vocab.json: cannot encode text")
    docs = [read_document(path, model.vocab) for path in args.files]  # all checked first
    # progress on stderr: a bar on a terminal, a line per tenth in a log past a second
    probs = predict(model, docs, batch_size=args.batch_size, progress=True).tolist()
    labels = model.labels
    for path, p in zip(args.files, probs, strict=True):
        label = labels[max(range(len(labels)), key=lambda i: p[i])]
        if args.json:
            record = {"file": str(path), "label": label, "probs": dict(zip(labels, p, strict=True))}
            print(json.dumps(record))
        else:
            shown = "  ".join(f"{name} {q:.4f}" for name, q in zip(labels, p, strict=True))
            print(f"{path}\t{label}\t{shown}")
    return 0
