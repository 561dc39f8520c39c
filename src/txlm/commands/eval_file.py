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

from txlm.devices import resolve_device
from txlm.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--file", type=Path, default=None, metavar="F",
        help="score this text file (one stream, memory carried) instead of a dataset split",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import torch

    from txlm.score import score_file

    for name, minimum in (("tgt_len", 1), ("mem_len", 0)):
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
    threads = getattr(args, "threads", None)
    if threads is not None:
        torch.set_num_threads(threads)
    device = resolve_device(getattr(args, "device", "auto"))
    quiet = getattr(args, "json", False) or getattr(args, "no_progress", False)
    result = score_file(
        args.checkpoint,
        args.file,
        tgt_len=getattr(args, "tgt_len", None),
        mem_len=getattr(args, "mem_len", None),
        clamp_len=getattr(args, "clamp_len", None),
        same_length=getattr(args, "same_length", None),
        device=device,
        progress=not quiet and sys.stderr.isatty(),
    )
    if getattr(args, "json", False):
        print(json.dumps(result))
        return 0
    print(f"{args.file}: {summary_line(result)}, <unk> {result['unk_tokens']:,} tokens")
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
