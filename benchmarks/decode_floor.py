"""A decoding step against its floor: what this CPU allows, measured in the same process.

The floor of a step is the larger of its arithmetic at this process's measured matrix-product
rate and the bytes it must read at this process's measured read bandwidth:

    arithmetic  2 x (the layers' four projections + the output layer's head) per row, plus the
                attention over S slots: the content and position scores and the weighted
                sum of values, 3 x 2 H Dh S per layer and row
    bytes       the weights the step multiplies (the layers' projections and the head, in
                the decoder's precision: 4, 2 or 1 byte an entry; float32 scales, biases and
                LayerNorms), every row's cached keys and values (N x 2 x H S Dh in the
                cache's dtype) and the position keys (N x H S Dh, shared by the rows)

The matrix-product rate is a square product (1024^3, float32 and bf16) timed best-of; the read
bandwidth a sum over a 256 MB buffer, far larger than the caches. Then the steps: a prompt
fills the memory, and each step feeds one token per row and draws the next greedily (a whole
``Decoder.step``), best of a few rounds of ``--steps`` steps, for each path and batch size:
eager fp32, compiled fp32 (``Decoder(compile=True)``, its first call timed apart), bf16
weights (``dtype=torch.bfloat16``) and int8 weights (``int8=True``).

    python benchmarks/decode_floor.py [--threads 1] [--batches 1,16] [--no-compile]

Writes runs/bench/decode_floor.json (--out; benchmarks/results/decode_floor.json holds the
committed figures) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from txlm import atomic
from txlm.config import ModelConfig
from txlm.inference.decode import Decoder
from txlm.inference.sampling import SamplingConfig
from txlm.model import TransformerXL

RESULTS = Path("runs") / "bench" / "decode_floor.json"
# the shape: d_model 256, 4 layers, a 10k full softmax, memory 512
SHAPE = dict(
    vocab_size=10000, n_layer=4, d_model=256, n_head=8, d_head=32, d_inner=1024,
    tgt_len=128, mem_len=512, clamp_len=-1, cutoffs=[], div_val=1, dropout=0.0,
)  # fmt: skip
GREEDY = SamplingConfig(greedy=True)
ENTRY = {"fp32": 4, "compiled": 4, "bf16": 2, "int8": 1}  # bytes a weight entry


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best(fn, reps: int, rounds: int = 5) -> float:
    """Seconds per call, best of ``rounds`` rounds of ``reps`` calls."""
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps)
    return min(times)


def matmul_rate(dtype: torch.dtype, n: int = 1024) -> float:
    """FLOP/s of an n^3 product in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / best(lambda: a @ b, 5)


def read_bandwidth(mbytes: int = 256) -> float:
    """Bytes/s of a sum over a float32 buffer far larger than the caches."""
    x = torch.ones(mbytes * 2**20 // 4)
    return x.numel() * 4 / best(lambda: x.sum(), 5)


def step_cost(c: ModelConfig, batch: int, path: str) -> tuple[float, float]:
    """(FLOPs, bytes) of one step of ``batch`` rows (see the module docstring)."""
    d, inner, f, n = c.d_model, c.n_head * c.d_head, c.d_inner, c.n_layer
    slots = c.mem_len + 1
    per_layer = d * 3 * inner + inner * d + d * f + f * d  # weight entries
    head = d * c.vocab_size
    flops = batch * (2 * (n * per_layer + head) + n * 3 * 2 * inner * slots)
    weights = (n * per_layer + head) * ENTRY[path]
    small = 4 * (n * (2 * f + 4 * d) + c.vocab_size)  # biases, LayerNorms, scales (float32)
    if path == "int8":
        small += 4 * (n * (3 * inner + d + f + d) + c.vocab_size)
    cache = 4 * n * (batch * 2 + 1) * inner * slots  # keys, values per row; position keys
    return flops, weights + small + cache


def time_steps(model: TransformerXL, batch: int, path: str, steps: int) -> dict:
    kw = {"fp32": {}, "compiled": {"compile": True}, "bf16": {"dtype": torch.bfloat16},
          "int8": {"int8": True}}[path]  # fmt: skip
    dec = Decoder(model, **kw)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, model.config.mem_len), generator=g)
    ids = dec.prefill(prompts.tolist(), sampling=GREEDY)
    out: dict = {}
    t = time.perf_counter()
    ids = dec.step(ids, GREEDY)
    out["first_step_s"] = round(time.perf_counter() - t, 3)  # a compiled step compiles here

    def run():
        nonlocal ids
        for _ in range(steps):
            ids = dec.step(ids, GREEDY)

    out["step_ms"] = round(best(run, 1, rounds=3) / steps * 1e3, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled step")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = run(args)
    finally:
        torch.set_num_threads(saved)
    text = json.dumps(result, indent=2)
    atomic.write_text(args.out, text + "\n")
    print(text)
    return 0


def run(args: argparse.Namespace) -> dict:
    rates = {"fp32": matmul_rate(torch.float32), "bf16": matmul_rate(torch.bfloat16)}
    bandwidth = read_bandwidth()
    config = ModelConfig.from_preset("debug", **SHAPE)
    torch.manual_seed(0)
    model = TransformerXL(config).eval()
    paths = ["fp32"] + ([] if args.no_compile else ["compiled"]) + ["bf16", "int8"]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for path in paths:
            flops, nbytes = step_cost(config, batch, path)
            rate = rates["bf16" if path == "bf16" else "fp32"]
            floor = max(flops / rate, nbytes / bandwidth)
            timed = time_steps(model, batch, path, args.steps)
            row = {
                "batch": batch, "path": path, **timed,
                "mflop": round(flops / 1e6, 2), "mbytes": round(nbytes / 1e6, 2),
                "floor_ms": round(floor * 1e3, 3),
                "bound": "bytes" if nbytes / bandwidth >= flops / rate else "arithmetic",
                "away": round(timed["step_ms"] / (floor * 1e3), 2),
            }  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": args.threads,
        "shape": SHAPE,
        "fp32_gflops": round(rates["fp32"] / 1e9, 1),
        "bf16_gflops": round(rates["bf16"] / 1e9, 1),
        "read_gbps": round(bandwidth / 1e9, 1),
        "steps": rows,
    }


if __name__ == "__main__":
    raise SystemExit(main())
