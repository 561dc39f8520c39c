"""``txlm eval CKPT --file F``: score any text file with a checkpoint (txlm.score).

Not a subcommand of its own: ``txlm.commands.eval`` adds the flag with ``add_arguments`` and
hands over to ``run`` when it is given. The file is one stream read in segments with the
memory carried (constant memory, however long the file); symbols outside the vocabulary
become ``<unk>`` when it has one, otherwise the file is refused (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from txlm.commands.options import use_precision
from txlm.devices import resolve_device
from txlm.errors import ConfigError
from txlm.resources import STDIN

if TYPE_CHECKING:
    from txlm.checkpoints.checkpoint import Checkpoint
    from txlm.model.lengths import Lengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--file", type=Path, default=None, metavar="F",
        help="score this text file (one stream, memory carried; -: standard input) instead "
        "of a dataset split",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from txlm.checkpoints.checkpoint import Checkpoint
    from txlm.inference.score import score_file

    for name, minimum in (("tgt_len", 1), ("mem_len", 0)):
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
    device = resolve_device(getattr(args, "device", "auto"))
    precision = getattr(args, "precision", "fp32")
    use_precision(precision, device)
    ckpt = Checkpoint.open(args.checkpoint)
    lengths = ckpt.lengths(
        getattr(args, "tgt_len", None), getattr(args, "mem_len", None),
        getattr(args, "clamp_len", None), getattr(args, "same_length", None),
    )  # fmt: skip
    # standard input is read whole first: its size is what the memory check needs
    data = sys.stdin.buffer.read() if str(args.file) == STDIN else None
    _check_memory(args, ckpt, device, lengths, data)
    quiet = getattr(args, "json", False) or getattr(args, "no_progress", False)
    result = score_file(
        ckpt,
        args.file,
        lengths=lengths,
        device=device,
        precision=precision,
        progress=not quiet and sys.stderr.isatty(),
        data=data,
    )
    if getattr(args, "json", False):
        print(json.dumps(result))
        return 0
    print(f"{args.file}: {summary_line(result)}, <unk> {result['unk_tokens']:,} tokens")
    return 0


def _check_memory(
    args: argparse.Namespace,
    ckpt: Checkpoint,
    device: torch.device,
    lengths: Lengths,
    data: bytes | None = None,
) -> None:
    """Before loading: refuse a text, memory or segment that cannot fit (txlm.resources)."""
    from txlm import resources
    from txlm.checkpoints.checkpoint import WEIGHTS_FILE

    if data is None and args.file.exists() and not args.file.is_file():
        # a device or a named pipe may never end, and the file is read whole
        raise ConfigError(
            f"--file {args.file} is not a regular file: pass a text file, or - and the text "
            "on standard input"
        )
    # score_file names a missing or unreadable file
    text_bytes = _size(args.file) if data is None else len(data)
    resources.check_evaluation(
        ckpt.model_config, device, weights=_size(ckpt.path / WEIGHTS_FILE), rows=1,
        tgt_len=lengths.tgt_len, mem_len=lengths.mem_len,
        precision=getattr(args, "precision", "fp32"), kv_cache=False, text_bytes=text_bytes,
    )  # fmt: skip


def _size(path: Path) -> int:
    """A file's size, 0 where it cannot be read (its reader then says why)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def summary_line(result: dict) -> str:
    """loss, the metric named in words (and token perplexity beside bits per byte), lengths."""
    from txlm.data.metrics import describe

    m = result["metric"]
    line = f"loss {result['loss']:.4f}, {m} {result[m]:.4f} ({describe(m)})"
    if m == "bpb":
        line += f", token ppl {result['ppl']:.2f}"
    return line + (
        f" over {result['tokens']:,} tokens (tgt_len {result['tgt_len']}, mem_len "
        f"{result['mem_len']}, clamp_len {result['clamp_len']}, same_length "
        f"{result['same_length']}), {result['tokens_per_s']:.0f} tokens/s"
    )
