"""How a decoding step's weight products read their weights: W [out, in] or W^T [in, out].

A decoding step of a few rows streams each weight from memory once, so a product's time is
its weight's bytes over the rate the library's kernel reads them at. That rate depends on
the layout: this script times each product of the ``decode_floor.py`` shape (the layers'
qkv, out, fc1 and fc2, the 10k head) cold, cycling through copies of the weight that
together exceed the last-level cache, as ``F.linear`` on W and as ``addmm`` on a contiguous
W^T, in float32 and bf16, at 1 and 16 rows. Then whole decoding steps of one decoder against
the same decoder with its weights held as ``RowLinear`` held them before the rule (every
projection as W^T, the head as W), rounds interleaved in one process, CPU time:

    python benchmarks/decode_products.py [--threads 1] [--rounds 7]

Writes runs/bench/decode_products.json (--out) and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from decode_floor import GREEDY, SHAPE, cpu_name, write_result
from txlm.config import ModelConfig
from txlm.inference.decode import Decoder
from txlm.inference.precision import RowLinear
from txlm.model import TransformerXL

RESULTS = Path("runs") / "bench" / "decode_products.json"
PRODUCTS = {
    "qkv": (768, 256),
    "out": (256, 256),
    "fc1": (1024, 256),
    "fc2": (256, 1024),
    "head": (10000, 256),
}  # fmt: skip  (out, in) at the shape


def cold_us(weights: list, fn) -> float:
    """Microseconds a call, best of 5 passes over ``weights`` (each read from memory)."""
    for w in weights:
        fn(w)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for w in weights:
            fn(w)
        times.append((time.perf_counter() - t) / len(weights))
    return min(times) * 1e6


def products(rows: int) -> list[dict]:
    out = []
    for name, (n_out, n_in) in PRODUCTS.items():
        copies = max(12, int(100e6 / (n_out * n_in * 4)))  # > 100 MB of float32 in all
        for dtype in (torch.float32, torch.bfloat16):
            x, b = torch.randn(rows, n_in).to(dtype), torch.randn(n_out).to(dtype)
            ws = [torch.randn(n_out, n_in).to(dtype) for _ in range(copies)]
            lin = cold_us(ws, lambda w, x=x, b=b: F.linear(x, w, b))
            ws = [w.t().contiguous() for w in ws]
            t = cold_us(ws, lambda w, x=x, b=b: torch.addmm(b, x, w))
            del ws
            mb = n_out * n_in * x.element_size() / 1e6
            out.append({
                "product": name, "rows": rows, "dtype": str(dtype).removeprefix("torch."),
                "linear_W_us": round(lin, 1), "addmm_Wt_us": round(t, 1),
                "W_gbps": round(mb * 1e3 / lin, 1), "Wt_gbps": round(mb * 1e3 / t, 1),
            })  # fmt: skip
            print(out[-1], flush=True)
    return out


def as_before(dec: Decoder) -> None:
    """Hold the decoder's weights as before the rule: every projection W^T, the head W."""
    for m in dec.net.modules():
        if isinstance(m, RowLinear) and not m.transposed:
            m.held, m.transposed = m.held.t().contiguous(), True
    h = dec.head
    w = (h.held.t() if h.transposed else h.held).contiguous()
    head = nn.Linear(w.size(1), w.size(0), dtype=w.dtype)
    head.weight, head.bias = nn.Parameter(w, False), nn.Parameter(h.bias, False)
    dec.head = head


def steps(rounds: int, n_steps: int = 30) -> list[dict]:
    config = ModelConfig.from_preset("debug", **SHAPE)
    torch.manual_seed(0)
    model = TransformerXL(config).eval()
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 16):
            runs = {}
            for kind in ("before", "now"):
                dec = Decoder(model, dtype=dtype)
                if kind == "before":
                    as_before(dec)
                g = torch.Generator().manual_seed(0)
                prompts = torch.randint(0, config.vocab_size, (rows, config.mem_len), generator=g)
                runs[kind] = [dec, dec.prefill(prompts.tolist(), sampling=GREEDY), []]
            for _ in range(rounds):
                for run in runs.values():
                    dec, ids, times = run
                    t = time.process_time()
                    for _ in range(n_steps):
                        ids = dec.step(ids, GREEDY)
                    times.append((time.process_time() - t) / n_steps * 1e3)
                    run[1] = ids
            before, now = runs["before"][2], runs["now"][2]
            out.append({
                "dtype": str(dtype).removeprefix("torch."), "rows": rows,
                "before_ms": round(min(before), 3), "now_ms": round(min(now), 3),
                "speedup_median": round(
                    statistics.median(b / n for b, n in zip(before, now, strict=True)), 3
                ),
            })  # fmt: skip
            print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = {
            "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "torch": torch.__version__,
            "threads": args.threads, "products": products(1) + products(16),
            "steps": steps(args.rounds),
        }  # fmt: skip
    finally:
        torch.set_num_threads(saved)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
