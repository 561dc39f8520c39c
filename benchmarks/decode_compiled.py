"""The compiled decoding step against the eager one and the step's floor, side by side.

The shape of ``decode_floor.py`` (d_model 256, 4 layers, a 10k full softmax, memory 512, the
prompt filling the memory), fp32, greedy draws, for each batch size: an eager decoder and
one decoder per way of compiling its step (``txlm.inference.compiled.StepCompile``),

    eager        Decoder()
    default      inductor with its defaults (a Python wrapper calling the kernels)
    cpp          inductor's C++ wrapper (cpp_wrapper: no Python between kernels)
    frozen       inductor with freezing (the weights constants, their layouts chosen once)
    cpp+frozen   both

each prefilled once, then rounds of ``--steps`` steps taken in turn (rounds interleaved, so
the machine's load falls on every path alike), on this thread's CPU time by default (``--clock``):
a path's figure is its best round, its ratio
to eager the median of the per-round ratios. The first compiled step of each path (where it
compiles) is timed apart, in a fresh inductor cache (``--cache-dir``, default a new temporary
folder), and with ``--second-process`` again in a new process over the same cache: what a
later run of the same checkpoint pays before its first token.

    python benchmarks/decode_compiled.py --threads 1 [--batches 1,16] [--second-process]

Writes runs/bench/decode_compiled.json (--out) and prints each row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_floor import GREEDY, SHAPE, cpu_name, matmul_rate, read_bandwidth, step_cost

RESULTS = Path("runs") / "bench" / "decode_compiled.json"
VARIANTS = {
    "eager": dict(),
    "default": dict(cpp_wrapper=False, freezing=False),
    "cpp": dict(cpp_wrapper=True, freezing=False),
    "frozen": dict(cpp_wrapper=False, freezing=True),
    "cpp+frozen": dict(cpp_wrapper=True, freezing=True),
}


def model():
    from txlm.config import ModelConfig
    from txlm.model import TransformerXL

    torch.manual_seed(0)
    return TransformerXL(ModelConfig.from_preset("debug", **SHAPE)).eval()


def decoder(net, variant: str):
    from txlm.inference.compiled import StepCompile
    from txlm.inference.decode import Decoder

    options = VARIANTS[variant]
    return Decoder(net, compile=StepCompile(**options) if options else False)


def prefilled(net, variant: str, batch: int):
    """A decoder of ``variant`` with ``batch`` prompts read, and its first step timed."""
    dec = decoder(net, variant)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, SHAPE["vocab_size"], (batch, SHAPE["mem_len"]), generator=g)
    ids = dec.prefill(prompts.tolist(), sampling=GREEDY)
    t, cpu = time.perf_counter(), time.process_time()
    ids = dec.step(ids, GREEDY)
    return dec, ids, time.perf_counter() - t, time.process_time() - cpu


def child(variant: str, batch: int) -> None:
    """A second process: the model built as the first built it, its first step timed."""
    began = time.perf_counter()
    _, _, first, cpu = prefilled(model(), variant, batch)
    print(json.dumps({"first_step_s": round(first, 3), "first_step_cpu_s": round(cpu, 3),
                      "process_s": round(time.perf_counter() - began, 3)}))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--clock", choices=["cpu", "wall"], default="cpu",
        help="time steps on this thread's CPU time (default: robust to a shared machine's "
        "time slicing; one thread computes) or on the wall clock",
    )  # fmt: skip
    ap.add_argument("--cache-dir", type=Path, default=None, help="inductor's (default: new)")
    ap.add_argument("--second-process", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "BATCH"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        child(args.child[0], int(args.child[1]))
        return 0
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="txlm-inductor-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    torch._dynamo.config.recompile_limit = 64  # every variant and batch in one process
    variants = args.variants.split(",")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    rates = matmul_rate(torch.float32)
    bandwidth = read_bandwidth()
    net = model()
    from txlm.config import ModelConfig

    config = ModelConfig.from_preset("debug", **SHAPE)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        flops, nbytes = step_cost(config, batch, "fp32")
        floor_ms = max(flops / rates, nbytes / bandwidth) * 1e3
        live = {}
        for v in variants:
            live[v] = list(prefilled(net, v, batch))
            print(f"batch {batch} {v}: first step {live[v][2]:.2f} s", flush=True)
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                dec, ids = live[v][0], live[v][1]
                t = clock()
                for _ in range(args.steps):
                    ids = dec.step(ids, GREEDY)
                times[v].append((clock() - t) / args.steps * 1e3)
                live[v][1] = ids
        for v in variants:
            ratios = [e / t for e, t in zip(times["eager"], times[v], strict=True)]
            row = {
                "batch": batch, "path": v, "first_step_s": round(live[v][2], 3),
                "first_step_cpu_s": round(live[v][3], 3),
                "step_ms": round(min(times[v]), 3), "rounds_ms": [round(t, 3) for t in times[v]],
                "speed_vs_eager": round(statistics.median(ratios), 3),
                "floor_ms": round(floor_ms, 3), "away": round(min(times[v]) / floor_ms, 2),
            }  # fmt: skip
            if args.second_process and v != "eager":
                out = subprocess.run(
                    [sys.executable, __file__, "--threads", str(args.threads), "--child", v,
                     str(batch)],
                    capture_output=True, text=True, check=True, env=os.environ.copy(),
                )  # fmt: skip
                row["second_process"] = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(row, flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": args.threads,
        "clock": args.clock,
        "load_average": os.getloadavg(),
        "shape": SHAPE,
        "fp32_gflops": round(rates / 1e9, 1),
        "read_gbps": round(bandwidth / 1e9, 1),
        "steps": args.steps,
        "rounds": args.rounds,
        "rows": rows,
    }
    from txlm import atomic

    atomic.write_text(args.out, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
