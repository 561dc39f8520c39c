"""Where a txlm training step / evaluation forward spends its time (torch.profiler, CPU).

    python benchmarks/profile_step.py                    # cpu config, fp32, train + eval
    python benchmarks/profile_step.py --config d512 --threads 1

Self CPU time of every aten op, summed into groups (matmul, dropout RNG, softmax, ...), as
shares of the profiled total, plus the ten most expensive ops. Writes
benchmarks/results/profile_<config>.json. The groups answer "what is left besides the
matmuls": on a machine whose matmuls run near peak, the non-matmul share bounds the MFU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from compare import SHAPES, build_pair, make_eval, make_train

GROUPS = {
    "matmul": ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::baddbmm_"),
    "fused_attention": ("aten::_scaled_dot_product",),
    # bernoulli_: F.dropout's mask; random_ / shifts / and: txlm.model.dropout's packed mask
    "dropout_rng": ("aten::bernoulli_", "aten::random_", "aten::__rshift__", "aten::bitwise_and"),
    "softmax": (
        "aten::_softmax",
        "aten::_softmax_backward_data",
        "aten::_log_softmax",
        "aten::_log_softmax_backward_data",
    ),
    "layer_norm": ("aten::native_layer_norm", "aten::native_layer_norm_backward"),
    "copies": ("aten::copy_", "aten::cat", "aten::fill_", "aten::zero_", "aten::index_select"),
    "optimizer": ("aten::_foreach", "aten::lerp", "aten::addcmul", "aten::addcdiv", "aten::sqrt"),
}


def group_of(name: str) -> str:
    for group, prefixes in GROUPS.items():
        if any(name.startswith(p) for p in prefixes):
            return group
    return "other_elementwise"


def summarise(fn, steps: int) -> dict:
    fn()  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    groups: dict[str, float] = {}
    for e in events:
        g = group_of(e.key)
        groups[g] = groups.get(g, 0.0) + e.self_cpu_time_total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
    return {
        "ms_per_step": round(total / steps / 1e3, 1),
        "groups_share": {
            g: round(t / total, 3) for g, t in sorted(groups.items(), key=lambda x: -x[1])
        },
        "top_ops_share": {e.key: round(e.self_cpu_time_total / total, 3) for e in top},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="cpu", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = SHAPES[args.config]
    _, tx = build_pair(s)
    result = {
        "config": args.config,
        "dtype": args.dtype,
        "threads": args.threads,
        "train": summarise(make_train("txlm", tx, s, args.dtype), args.steps),
        "eval_m512": summarise(make_eval("txlm", tx, s, args.dtype, 512), args.steps),
    }
    text = json.dumps(result, indent=2)
    print(text)
    out = Path(__file__).parent / "results" / f"profile_{args.config}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
