"""A decoding step against its floor: what this CPU allows, measured in the same process.

The floor of a step is the larger of its arithmetic at this process's measured matrix-product
rate and the bytes it must read at this process's measured read bandwidth:

    arithmetic  2 x (the layers' four projections + the output layer's weights) per row,
                plus the attention over S slots: the content and position scores and the
                weighted sum of values, 3 x 2 H Dh S per layer and row
    bytes       the weights the step multiplies (the layers' projections and the head, in
                the decoder's precision: 4, 2 or 1 byte an entry; an adaptive softmax's tail
                clusters in its float dtype; float32 biases and LayerNorms; bf16 int8
                scales), every row's cached keys and values (N x 2 x H S Dh in the cache's
                dtype: float32, or bf16 in a packaged bf16 or int8 step) and the position keys
                (N x H S Dh in the cache's dtype, shared by the rows)

An adaptive softmax's tail clusters count by the share of steps that read them: a greedy
step skips a cluster whose head log-probability is below the best shortlist token's
(txlm.inference.sampling.clusters_needed), counted over as many more steps of each eager
path; a compiled or packaged step takes the share of the eager step of its precision.

The matrix-product rate is a square product (1024^3, float32 and bf16) timed best-of; the read
bandwidth a sum over a 256 MB buffer, far larger than the caches. Then the steps: a prompt
fills the memory, and each step feeds one token per row and draws the next greedily (a whole
``Decoder.step``), best of a few rounds of ``--steps`` steps, for each path and batch size:
eager fp32 (``fp32``), compiled fp32 (``compiled``: ``Decoder(compile=True)``, its first
call timed apart), bf16 weights (``bf16``: ``dtype=torch.bfloat16``), int8 weights (``int8``:
``int8=True``), and each precision's packaged step (``package``, ``bf16_package``,
``int8_package``: ``Decoder(compile="package")``, exported and compiled ahead of time by
AOTInductor, its first call making the package, kept in a scratch TXLM_HOME for the run).

Two shapes (``--shape``): the decoding issue's (d_model 256, 4 layers, a 10k full softmax,
memory 512) and wt103-base's (the paper's 151M model: 16 layers of d_model 410, the 267,735
word vocabulary in an adaptive softmax with cutoffs 20k, 40k, 200k, and its evaluation's
memory 640, clamp_len 400, same_length).

    python benchmarks/decode_floor.py [--shape issue|wt103-base] [--threads 1] [--batches 1,16]
                                      [--paths fp32,compiled,package,bf16,bf16_package,...]
                                      [--no-compile]

Writes runs/bench/decode_floor.json (--out; benchmarks/results/decode_floor.json holds the
committed figures) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
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
# (preset, overrides): the preset's model with its evaluation's lengths
SHAPES = {
    "issue": ("debug", SHAPE),
    "wt103-base": ("wt103-base", dict(tgt_len=64, mem_len=640, clamp_len=400,
                                      same_length=True, dropout=0.0, dropatt=0.0)),
}  # fmt: skip
CONFIG_FIELDS = ("vocab_size", "n_layer", "d_model", "n_head", "d_head", "d_inner", "mem_len",
                 "clamp_len", "same_length", "cutoffs", "div_val")  # fmt: skip
GREEDY = SamplingConfig(greedy=True)
ENTRY = {"fp32": 4, "bf16": 2, "int8": 1}  # bytes a weight entry, by precision
# each path: the Decoder's arguments and its precision
PATHS = {
    "fp32": ({}, "fp32"),
    "compiled": ({"compile": True}, "fp32"),
    "package": ({"compile": "package"}, "fp32"),
    "bf16": ({"dtype": torch.bfloat16}, "bf16"),
    "bf16_package": ({"dtype": torch.bfloat16, "compile": "package"}, "bf16"),
    "int8": ({"int8": True}, "int8"),
    "int8_package": ({"int8": True, "compile": "package"}, "int8"),
}
COMPILED = ("compiled", "package", "bf16_package", "int8_package")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(threads: int) -> dict:
    """What a result was measured on: the date, the CPU, torch and the thread count."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": threads,
    }


def write_result(out: str | Path, result: dict) -> None:
    """``result`` as JSON in ``out`` (atomically) and on stdout."""
    text = json.dumps(result, indent=2)
    atomic.write_text(out, text + "\n")
    print(text)


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


def output_entries(c: ModelConfig) -> tuple[int, list[int], int]:
    """Weight entries of the output layer: the head's (shortlist rows with one row per tail
    cluster, and its projection), each tail cluster's (weight and projection), and the
    head's rows."""
    bounds = [0, *c.cutoffs, c.vocab_size]
    projected = c.div_val > 1 or c.d_embed != c.d_model
    entries = []
    for i in range(len(bounds) - 1):
        e = c.d_embed // c.div_val**i
        entries.append((bounds[i + 1] - bounds[i]) * e + (c.d_model * e if projected else 0))
    head = entries[0] + len(c.cutoffs) * (c.d_embed)
    return head, entries[1:], bounds[1] + len(c.cutoffs)


def step_cost(
    c: ModelConfig,
    batch: int,
    precision: str,
    tails_read: list[float] | None = None,
    cache_entry: int = 4,
) -> tuple[float, float]:
    """(FLOPs, bytes) of one step of ``batch`` rows (see the module docstring).
    ``tails_read``: the share of steps that computed each tail cluster (None: every step);
    ``cache_entry``: bytes an entry of the cache."""
    d, inner, f, n = c.d_model, c.n_head * c.d_head, c.d_inner, c.n_layer
    slots = c.mem_len + 1
    per_layer = d * 3 * inner + inner * d + d * f + f * d  # weight entries
    head, clusters, head_rows = output_entries(c)
    shares = [1.0] * len(clusters) if tails_read is None else tails_read
    tails = sum(e * share for e, share in zip(clusters, shares, strict=True))
    flops = batch * (2 * (n * per_layer + head + tails) + n * 3 * 2 * inner * slots)
    weights = (n * per_layer + head) * ENTRY[precision] + tails * (2 if precision == "bf16" else 4)
    small = 4 * (n * (2 * f + 4 * d) + c.vocab_size)  # biases, LayerNorms (float32)
    if precision == "int8":  # its scales (bf16)
        small += 2 * (n * (3 * inner + d + f + d) + head_rows)
    # keys, values per row; position keys
    cache = cache_entry * n * (batch * 2 + 1) * inner * slots
    return flops, weights + small + cache


def time_steps(model: TransformerXL, batch: int, path: str, steps: int) -> dict:
    dec = Decoder(model, **PATHS[path][0])
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, model.config.mem_len), generator=g)
    ids = dec.prefill(prompts.tolist(), sampling=GREEDY)
    out: dict = {"cache_entry": dec.cache_dtype.itemsize}
    t = time.perf_counter()
    ids = dec.step(ids, GREEDY)
    out["first_step_s"] = round(time.perf_counter() - t, 3)  # a compiled step compiles here

    def run():
        nonlocal ids
        for _ in range(steps):
            ids = dec.step(ids, GREEDY)

    out["step_ms"] = round(best(run, 1, rounds=3) / steps * 1e3, 3)
    clusters = model.softmax.n_clusters
    if clusters and path not in COMPILED:  # (a compiled step's reads are the eager one's)
        out["tails_read"] = tails_read(dec, clusters, steps, ids)
    return out


def tails_read(dec: Decoder, clusters: int, steps: int, ids) -> list[float]:
    """The share of ``steps`` further greedy steps that computed each tail cluster (an eager
    step skips the clusters its draw cannot take a token from)."""
    softmax, read = dec.softmax, [0] * clusters
    weights = softmax._weights

    def counted(i: int):
        read[i - 1] += 1
        return weights(i)

    softmax._weights = counted  # (the instance's, removed after: the model is unchanged)
    try:
        for _ in range(steps):
            ids = dec.step(ids, GREEDY)
    finally:
        del softmax._weights
    return [round(r / steps, 3) for r in read]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="issue")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled steps")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help=f"the steps to time, of {', '.join(PATHS)}")  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    held = os.environ.get("TXLM_HOME")
    try:
        with tempfile.TemporaryDirectory() as home:
            os.environ["TXLM_HOME"] = home  # (the packaged step's packages: this run's own)
            result = run(args)
    finally:
        torch.set_num_threads(saved)
        if held is None:
            os.environ.pop("TXLM_HOME", None)
        else:
            os.environ["TXLM_HOME"] = held
    write_result(args.out, result)
    return 0


def run(args: argparse.Namespace) -> dict:
    rates = {"fp32": matmul_rate(torch.float32), "bf16": matmul_rate(torch.bfloat16)}
    bandwidth = read_bandwidth()
    preset, overrides = SHAPES[args.shape]
    config = ModelConfig.from_preset(preset, **overrides)
    torch.manual_seed(0)
    model = TransformerXL(config).eval()
    paths = [p for p in args.paths.split(",") if not (args.no_compile and p in COMPILED)]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        read: dict = {}  # each precision's eager step's tail clusters (its compiled steps' too)
        for path in paths:
            timed = time_steps(model, batch, path, args.steps)
            precision = PATHS[path][1]
            if path not in COMPILED:
                read[precision] = timed.get("tails_read")
            flops, nbytes = step_cost(
                config, batch, precision, read.get(precision), timed["cache_entry"]
            )
            rate = rates["bf16" if precision == "bf16" else "fp32"]
            floor = max(flops / rate, nbytes / bandwidth)
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
        **machine(args.threads),
        "shape": args.shape,
        "config": {k: getattr(config, k) for k in CONFIG_FIELDS},
        "fp32_gflops": round(rates["fp32"] / 1e9, 1),
        "bf16_gflops": round(rates["bf16"] / 1e9, 1),
        "read_gbps": round(bandwidth / 1e9, 1),
        "steps": rows,
    }


if __name__ == "__main__":
    raise SystemExit(main())
