"""What the analysis subcommands share: option types, the text to analyse, output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from txlm.atomic import write_json
from txlm.checkpoints.checkpoint import Checkpoint
from txlm.commands.options import add_device_options, apply_threads
from txlm.data import open_corpus
from txlm.devices import resolve_device
from txlm.errors import DataError


# -- option types ------------------------------------------------------------------------------
def ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out-dir", default=None, help="write the PNG figures (and result.json) here")
    add_device_options(p)


def add_text(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", default=None, help="a UTF-8 text file, encoded with the vocabulary")
    p.add_argument(
        "--dataset",
        default="shakespeare",
        help="prepared dataset name or folder (default shakespeare; see txlm prepare)",
    )
    p.add_argument("--data-dir", default=None, help="default: $TXLM_DATA_DIR or ./data")
    p.add_argument("--split", default="valid", help="split of the prepared dataset (valid)")


# -- running -----------------------------------------------------------------------------------
def setup(args: argparse.Namespace) -> torch.device:
    apply_threads(args)
    return resolve_device(args.device)


def read_tokens(args: argparse.Namespace, checkpoint: Checkpoint, max_tokens: int) -> np.ndarray:
    """Token ids [T] of the text to analyse (--text, or a prepared split), in the checkpoint's
    vocabulary."""
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            raise DataError(f"text file {path} does not exist")
        ids = checkpoint.vocab().encode_array(path.read_text(encoding="utf-8"))
    else:
        corpus = open_corpus(
            args.dataset,
            args.data_dir,
            fingerprint=checkpoint.vocab_fingerprint,
            owner=str(checkpoint.path),
            log=log(args),
        )
        ids = corpus.split(args.split)
    return np.asarray(ids[:max_tokens], dtype=np.int64)


def log(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Progress notes for stderr, none with --json."""
    if args.json:
        return None
    return lambda msg: print(msg, file=sys.stderr, flush=True)


# -- output ------------------------------------------------------------------------------------
def out_dir(args: argparse.Namespace) -> Path | None:
    if not args.out_dir:
        return None
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def emit(args: argparse.Namespace, payload: dict, table: str) -> None:
    if args.out_dir:
        write_json(Path(args.out_dir) / "result.json", payload)
    if args.json:
        print(json.dumps(payload))
    else:
        print(table)
        if payload.get("figures"):
            print("figures: " + ", ".join(payload["figures"]))
