"""``txlm bench eval-speed``: the paper's Table 9, Transformer-XL against a vanilla model."""

from __future__ import annotations

import argparse

import torch

from txlm.analysis.speed import format_table, measure_eval_speed, plot_speed
from txlm.checkpoints.checkpoint import load
from txlm.commands.analysis import common
from txlm.config import ModelConfig
from txlm.model import TransformerXL


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "eval-speed",
        help="evaluation speed, Transformer-XL vs vanilla Transformer (paper Table 9)",
        description="Table 9: per-token evaluation time of Transformer-XL with memory against "
        "a vanilla Transformer evaluated the Al-Rfou way.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", default=None, help="a checkpoint directory")
    source.add_argument(
        "--preset", default="shakespeare-char", help="a preset shape (default shakespeare-char)"
    )
    p.add_argument(
        "--lengths",
        type=common.ints,
        default=[100, 200, 400],
        help="attention lengths (default 100,200,400 for a CPU; the paper: 800,1800,2800,3800)",
    )
    p.add_argument("--tgt-len", type=int, default=128, help="XL evaluation segment length")
    p.add_argument("--xl-tokens", type=int, default=512, help="XL tokens timed per length")
    p.add_argument(
        "--vanilla-positions", type=int, default=8, help="vanilla positions timed per length"
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument(
        "--vanilla",
        choices=["alrfou", "same"],
        default="alrfou",
        help="vanilla model: same-shape Al-Rfou model (default) or this model without memory",
    )
    common.add_output(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    device = common.setup(args)
    if args.checkpoint:
        model = load(args.checkpoint, device=device)
        source = args.checkpoint
    else:
        torch.manual_seed(0)
        config = ModelConfig.from_preset(args.preset, dropout=0.0, dropatt=0.0)
        model = TransformerXL(config).to(device).eval()
        source = f"preset {args.preset} (random weights: timing does not depend on them)"
    result = measure_eval_speed(
        model,
        args.lengths,
        tgt_len=args.tgt_len,
        xl_tokens=args.xl_tokens,
        vanilla_positions=args.vanilla_positions,
        vanilla=args.vanilla,
        repeats=args.repeats,
        progress=common.log(args),
    )
    payload = {"command": "bench eval-speed", "source": source, **result.to_dict()}
    out = common.out_dir(args)
    if out is not None:
        plot_speed(result, out / "table9_eval_speed.png")
        payload["figures"] = [str(out / "table9_eval_speed.png")]
    common.emit(args, payload, f"{source}\n" + format_table(result))
    return 0
