"""``txlm bench memory``: does the memory work? Table 6's variants on the recall task."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from txlm.analysis import memory
from txlm.commands.analysis import common
from txlm.commands.options import add_set_option


def register(bench: argparse._SubParsersAction) -> None:
    mem = bench.add_parser(
        "memory",
        help="does the memory work? Table 6's variants on the recall task",
        description="Train the Table 6 variants (XL, Shaw + memory, XL without memory, "
        "absolute positions with and without memory) on the recall copy task with txlm "
        "train's trainer (preset recall), then measure copy accuracy and loss against the "
        "distance back to the copied span, with 1x, 2x and 4x each model's training memory.",
    )
    mem.add_argument(
        "--dataset",
        default=None,
        help="recall dataset: recall or recall:key=value,... (see txlm prepare --help); "
        "default: the associative form (txlm.analysis.memory.BENCH_TASK)",
    )
    mem.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    mem.add_argument("--steps", type=int, default=None, help="training steps per model (preset)")
    mem.add_argument("--batch-size", type=int, default=None, help="training batch size")
    mem.add_argument("--lr", type=float, default=None, help="peak learning rate")
    mem.add_argument("--tgt-len", type=int, default=None, help="training segment length")
    mem.add_argument("--mem-len", type=int, default=None, help="training memory length")
    mem.add_argument(
        "--eval-multiples",
        type=common.ints,
        default=[1, 2, 4],
        help="evaluation memories as multiples of the training memory (1,2,4)",
    )
    mem.add_argument("--eval-tokens", type=int, default=None, help="valid tokens scored (all)")
    mem.add_argument(
        "--eval-tgt-len",
        type=int,
        default=8,
        help="segment length when evaluating models with memory (8: query i of a segment "
        "sees m + i back, so 'in view' is nearly d <= m)",
    )
    mem.add_argument(
        "--clamp",
        choices=("none", "train", "both"),
        default="both",
        help="relative-sinusoid models: distances unclamped, clamped to the training reach "
        "M + L, or both (default)",
    )
    mem.add_argument("--seed", type=int, default=0)
    add_set_option(mem, "txlm train overrides for every variant, e.g. model.d_model=128")
    mem.add_argument(
        "--runs-dir", default=None, help="keep each variant's training run here (default: none)"
    )
    mem.add_argument("--data-dir", default=None, help="default: $TXLM_DATA_DIR or ./data")
    common.add_output(mem)
    mem.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    device = common.setup(args)
    settings = memory.MemoryBenchSettings(
        dataset=args.dataset or memory.BENCH_TASK,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        tgt_len=args.tgt_len,
        mem_len=args.mem_len,
        eval_multiples=tuple(args.eval_multiples),
        eval_tokens=args.eval_tokens,
        eval_tgt_len=args.eval_tgt_len,
        clamp=args.clamp,
        seed=args.seed,
        only=tuple(args.variants.split(",")) if args.variants else (),
        sets=tuple(args.sets),
    )
    out = common.out_dir(args)
    with tempfile.TemporaryDirectory(prefix="txlm-memory-") as scratch:
        runs = Path(args.runs_dir) if args.runs_dir else Path(scratch)
        result = memory.run_memory_bench(
            settings, runs, data_dir=args.data_dir, device=str(device), log=common.log(args)
        )
    payload = {"command": "bench memory", **result.to_dict()}
    if not args.runs_dir:  # the checkpoints lived in a temporary folder
        for v in payload["variants"]:
            v["checkpoint"] = None
    if out is not None:
        figure = out / "memory_accuracy_by_distance.png"
        memory.plot_memory(result, figure)
        payload["figures"] = [str(figure)]
    common.emit(args, payload, memory.format_table(result))
    return 0
