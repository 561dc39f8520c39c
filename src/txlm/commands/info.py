"""``txlm info``: every preset a command accepts (model presets with their parameter counts,
``txlm ablate``'s budgets), or a checkpoint's summary."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from txlm.config import PRESETS, ModelConfig
from txlm.model import TransformerXL


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="list presets (parameter counts) or describe a checkpoint",
        description="Without CKPT: every model preset (txlm train / bench eval-speed / ablate "
        "--preset) with its shape and parameter count (counted without allocating), and the "
        "ablation presets of txlm ablate --preset. With CKPT: a short summary (model, "
        "vocabulary, lengths, training, task); --json: its parameter count and whole saved "
        "configuration.",
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


def ablation_table() -> list[dict]:
    """``txlm ablate``'s own presets (shape and training budget); an alias shares its row."""
    from txlm.analysis.ablation import ABLATION_PRESETS

    rows: list[dict] = []
    for name, preset in ABLATION_PRESETS.items():
        same = next((r for r in rows if ABLATION_PRESETS[r["preset"]] is preset), None)
        if same is not None:
            same["aliases"].append(name)
            continue
        model = preset["model"]
        rows.append(
            dict(
                preset=name,
                aliases=[],
                layers=model["n_layer"],
                d_model=model["d_model"],
                heads=f"{model['n_head']}x{model['d_head']}",
                d_inner=model["d_inner"],
                steps=preset["steps"],
                batch_size=preset["batch_size"],
                tgt_len=preset["tgt_len"],
                eval_lengths=list(preset["eval_lengths"]),
            )
        )
    return rows


def describe(name: str, ckpt: Any, params: int) -> list[str]:
    """A checkpoint in a few lines: what it is, its model, vocabulary, lengths, training."""
    data, c = ckpt.data, ckpt.model_config
    classifier = data.get("classifier") if data.get("task") == "classify" else None
    what = "a classifier" if classifier else "a language model"
    lines = [f"{name}: {what}, {params:,} parameters"]
    softmax = f"adaptive softmax cutoffs {c.cutoffs}" if c.cutoffs else "full softmax"
    lines.append(
        f"  model: {c.n_layer} layers, d_model {c.d_model}, {c.n_head}x{c.d_head} heads, "
        f"d_inner {c.d_inner}, {c.attn_type} attention, {softmax}"
    )
    if ckpt.has_vocab:
        vocab = ckpt.vocab()
        lines.append(
            f"  vocabulary: {vocab.level}, {len(vocab):,} symbols (fingerprint {vocab.fingerprint})"
        )
    else:
        lines.append(f"  vocabulary: none saved ({c.vocab_size:,} ids)")
    lengths = ckpt.lengths()
    lines.append(
        f"  lengths: trained tgt_len {c.tgt_len}, mem_len {c.mem_len}; evaluated tgt_len "
        f"{lengths.tgt_len}, mem_len {lengths.mem_len}, clamp_len {lengths.clamp_len}, "
        f"same_length {lengths.same_length}"
    )
    train = ckpt.train_config
    state = data.get("checkpoint") or {}
    if train is not None:
        dataset = data.get("dataset") or {}
        on = (
            dataset.get("name")
            or dataset.get("dataset")
            or (train.get("data") or {}).get("dataset")
        )
        step = f"step {state['step']:,} of " if "step" in state else ""
        line = f"  training: {step}{(train.get('optim') or {}).get('max_steps')} on {on}"
        if "best_valid_loss" in state:
            line += f", best valid loss {state['best_valid_loss']:.4f}"
        if dataset.get("path"):
            line += f" (prepared {dataset['path']})"
        lines.append(line)
    init = data.get("init")
    if isinstance(init, dict) and init.get("path"):
        lines.append(f"  fine-tuned from: {init['path']}")
    converted = data.get("converted_from")
    if isinstance(converted, dict):
        lines.append(f"  converted from: {converted.get('source')} ({converted.get('format')})")
    if classifier:
        labels = ", ".join(classifier.get("labels") or [])
        lines.append(f"  task: classify into {labels}; pooling {classifier.get('pooling')}")
    else:
        lines.append("  task: language model")
    lines.append("  (--json: the whole record)")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.checkpoint:
        from txlm.checkpoints.checkpoint import Checkpoint

        ckpt = Checkpoint.open(args.checkpoint)
        model = ckpt.load_model()  # a language model or a classifier (body and head)
        summary = {"path": str(args.checkpoint), "params": model.num_parameters(), **ckpt.data}
        if args.json:
            print(json.dumps(summary, sort_keys=True))
        else:
            print("\n".join(describe(args.checkpoint, ckpt, summary["params"])))
        return 0
    rows = preset_table()
    ablation = ablation_table()
    if args.json:
        print(json.dumps({"presets": rows, "ablation_presets": ablation}))
        return 0
    print("model presets (txlm train, txlm bench eval-speed and txlm ablate --preset)")
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
    print()
    print("ablation presets (txlm ablate --preset; a model preset there takes its shape and the")
    print("budget of small); params depend on the corpus's vocabulary")
    print(
        f"{'preset':22s} {'layers':>6s} {'d_model':>7s} {'heads':>7s} {'d_inner':>7s} "
        f"{'steps':>6s} {'batch':>9s}  eval lengths"
    )
    for r in ablation:
        name = r["preset"] + "".join(f" ({a})" for a in r["aliases"])
        batch = f"{r['batch_size']}x{r['tgt_len']}"
        lengths = ",".join(map(str, r["eval_lengths"]))
        print(
            f"{name:22s} {r['layers']:6d} {r['d_model']:7d} {r['heads']:>7s} "
            f"{r['d_inner']:7d} {r['steps']:6d} {batch:>9s}  {lengths}"
        )
    return 0
