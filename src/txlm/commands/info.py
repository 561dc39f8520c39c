"""``txlm info``: the presets with their parameter counts, or a checkpoint's summary."""

from __future__ import annotations

import argparse
import json

import torch

from txlm.config import PRESETS, ModelConfig
from txlm.model import TransformerXL


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="list presets (parameter counts) or describe a checkpoint",
        description="Without CKPT: every preset with its shape and parameter count (counted "
        "without allocating). With CKPT: its parameter count and saved configuration (model and "
        "training), as JSON.",
    )
    p.add_argument("checkpoint", metavar="CKPT", nargs="?", help="a checkpoint to describe")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def preset_table() -> list[dict]:
    rows = []
    for name, preset in PRESETS.items():
        config = ModelConfig.from_preset(name)
        with torch.device("meta"):  # count without allocating
            count = TransformerXL(config).num_parameters()
        rows.append(
            dict(
                preset=name,
                layers=config.n_layer,
                d_model=config.d_model,
                heads=f"{config.n_head}x{config.d_head}",
                d_inner=config.d_inner,
                params=count,
                paper_params=preset.paper_params,
                source=preset.source,
            )
        )
    return rows


def run(args: argparse.Namespace) -> int:
    if args.checkpoint:
        from txlm.checkpoint import load, read_config

        data = read_config(args.checkpoint)
        model = load(args.checkpoint)
        summary = {"path": str(args.checkpoint), "params": model.num_parameters(), **data}
        print(json.dumps(summary, indent=None if args.json else 2, sort_keys=True))
        return 0
    rows = preset_table()
    if args.json:
        print(json.dumps({"presets": rows}))
        return 0
    print(
        f"{'preset':18s} {'layers':>6s} {'d_model':>7s} {'heads':>7s} {'d_inner':>7s} "
        f"{'params':>9s} {'paper':>7s}  source"
    )
    for r in rows:
        paper = f"{r['paper_params'] / 1e6:.0f}M" if r["paper_params"] else "-"
        print(
            f"{r['preset']:18s} {r['layers']:6d} {r['d_model']:7d} {r['heads']:>7s} "
            f"{r['d_inner']:7d} {r['params'] / 1e6:8.1f}M {paper:>7s}  {r['source']}"
        )
    return 0
