"""Where the packaged decoding step's time goes: a kernel profile of its steps.

A shape of ``decode_floor.py`` (``--shape``), the prompt filling the memory, greedy draws:
one packaged decoder (``Decoder(compile="package")`` as ``--precision`` ships it, packaged in
a scratch TXLM_HOME with inductor's ``cpp.enable_kernel_profile``, so each of the package's
fused kernels is a profiler event of its own, beside the library calls it makes), then
``--steps`` steps under ``torch.profiler``. Reports the step's time unprofiled (best of 3
rounds) and each kernel's self time per step, the largest first.

    python benchmarks/decode_profile.py [--shape issue|wt103-base] [--batch 16]
                                        [--precision fp32|bf16|int8] [--steps 30]

Writes runs/bench/decode_profile.json (--out) and prints it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_floor import GREEDY, SHAPES, machine, write_result
from decode_package import prefilled
from txlm.config import ModelConfig
from txlm.model import TransformerXL

RESULTS = Path("runs") / "bench" / "decode_profile.json"
VARIANT = {"fp32": "shipped", "bf16": "bf16", "int8": "int8"}  # decode_package's variants


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="issue")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--precision", choices=list(VARIANT), default="fp32")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=12, help="kernels reported")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        preset, overrides = SHAPES[args.shape]
        torch.manual_seed(0)
        model = TransformerXL(ModelConfig.from_preset(preset, **overrides)).eval()
        with (
            tempfile.TemporaryDirectory() as home,
            mock.patch.dict(os.environ, TXLM_HOME=home),
            mock.patch.object(torch._inductor.config.cpp, "enable_kernel_profile", True),
        ):
            dec, ids, _ = prefilled(model, VARIANT[args.precision], args.batch)
            rounds = []
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(args.steps):
                    ids = dec.step(ids, GREEDY)
                rounds.append((time.perf_counter() - t) / args.steps)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    ids = dec.step(ids, GREEDY)
    finally:
        torch.set_num_threads(saved)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    kernels = [
        {
            "kernel": e.key,
            "calls_per_step": round(e.count / args.steps, 2),
            "ms_per_step": round(e.self_cpu_time_total / 1e3 / args.steps, 3),
            "share": round(e.self_cpu_time_total / total, 3),
        }
        for e in events[: args.top]
    ]
    result = {
        **machine(1), "shape": args.shape, "batch": args.batch, "precision": args.precision,
        "step_ms": round(min(rounds) * 1e3, 3),
        "profiled_step_ms": round(total / 1e3 / args.steps, 3),
        "kernels": kernels,
    }  # fmt: skip
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
