"""``txlm convert --from hf NAME_OR_DIR --out DST_DIR``: import a published checkpoint."""

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
            "Convert a Hugging Face TransfoXL checkpoint (config.json + model.safetensors or "
            "pytorch_model.bin, optional vocab.pkl/vocab.bin) into a txlm checkpoint "
            "directory. NAME_OR_DIR is a local folder, or else a Hub repository id whose "
            "files are downloaded with huggingface_hub (cached, resumed when interrupted; "
            "HF_HUB_OFFLINE=1: cache only; HF_ENDPOINT: another server). Weights are read "
            "with torch.load(weights_only=True), pickled vocabularies with a loader that only "
            "accepts plain containers."
        ),
    )
    p.add_argument(
        "src", metavar="NAME_OR_DIR", help="a local folder, or a Hub repository id (org/name)"
    )
    p.add_argument("--revision", default=None, help="Hub: branch, tag or commit (default main)")
    p.add_argument("--no-progress", action="store_true", help="no download progress bars")
    p.add_argument(
        "--from", dest="source", choices=SOURCES, required=True, help="format of SRC_DIR"
    )
    p.add_argument("--out", required=True, type=Path, metavar="DST_DIR", help="txlm checkpoint")
    p.add_argument("--force", action="store_true", help="replace DST_DIR if it exists (atomically)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from txlm.checkpoints.convert import convert_hf
    from txlm.checkpoints.hub import local_or_hub

    out: Path = args.out
    if out.exists() and not args.force:
        raise CheckpointError(f"{out} exists; choose another --out or pass --force")
    quiet = args.no_progress or args.json or not sys.stderr.isatty()
    src = local_or_hub(args.src, revision=args.revision, progress=not quiet)
    from_hub = src != Path(args.src).expanduser()
    result = convert_hf(src, out, source=f"hf-hub:{args.src}" if from_hub else None)
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True))
        return 0
    c = result.config
    print(
        f"converted {result.n_tensors} tensors ({result.n_parameters:,} parameters; "
        f"{c.n_layer} layers, d_model {c.d_model}, vocab {c.vocab_size}) from "
        f"{src / result.weights_file} to {result.out_dir}"
    )
    print(f"vocabulary: {result.vocab_file or 'none'}")
    for note in result.notes:
        print(f"note: {note}")
    return 0
