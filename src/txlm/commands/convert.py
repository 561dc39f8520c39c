"""``txlm convert --from hf SRC_DIR --out DST_DIR``: import a published checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from txlm.errors import CheckpointError

SOURCES = ("hf",)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert",
        help="import a published checkpoint (Hugging Face TransfoXL) as a txlm checkpoint",
        description=(
            "Convert a Hugging Face TransfoXL checkpoint directory (config.json + "
            "model.safetensors or pytorch_model.bin, optional vocab.pkl/vocab.bin) into a txlm "
            "checkpoint directory. Pickled vocabularies are read with a loader that only "
            "accepts plain containers."
        ),
    )
    p.add_argument("src", metavar="SRC_DIR", type=Path, help="the checkpoint to import")
    p.add_argument(
        "--from", dest="source", choices=SOURCES, required=True, help="format of SRC_DIR"
    )
    p.add_argument("--out", required=True, type=Path, metavar="DST_DIR", help="txlm checkpoint")
    p.add_argument("--force", action="store_true", help="replace DST_DIR if it exists (atomically)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from txlm.convert import convert_hf

    out: Path = args.out
    if out.exists() and not args.force:
        raise CheckpointError(f"{out} exists; choose another --out or pass --force")
    result = convert_hf(args.src, out)
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True))
        return 0
    c = result.config
    print(
        f"converted {result.n_tensors} tensors ({result.n_parameters:,} parameters; "
        f"{c.n_layer} layers, d_model {c.d_model}, vocab {c.vocab_size}) from "
        f"{args.src / result.weights_file} to {result.out_dir}"
    )
    print(f"vocabulary: {result.vocab_file or 'none'}")
    for note in result.notes:
        print(f"note: {note}")
    return 0
