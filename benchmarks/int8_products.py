"""What each int8 kernel torch offers on a CPU costs a decoding step's weight products.

An int8 weight is a quarter of a float32 one's bytes, so a product that streams its weight
from memory could run up to 4x faster, if a kernel reads int8 at the rate ``addmm`` reads
float32. This script times each product of the ``decode_floor.py`` shape (qkv, out, fc1, fc2
and the 10k head) cold, as ``decode_products.py`` does (cycling through copies of the weight
that together exceed the last-level cache), at 1 and 16 rows, through

    fp32        addmm on W^T float32 [in, out] (what the fp32 decoder runs: the anchor)
    woq         torch.ops.aten._weight_int8pack_mm: int8 weight [out, in], a scale per
                row, float32 activations (weight-only: torchao's int8 weight-only
                quantization on float32 activations)
    woq_bf16    the same kernel on bf16 activations, its output back to float32
                (``txlm.inference.precision.int8_matmul``: what txlm's Int8Linear runs)
    dynamic     torch.ops.quantized.linear_dynamic (fbgemm): the activations quantised to
                uint8 per call, an int8 x uint8 product, dequantised (torch's dynamic
                quantization; the int8 weight prepacked once)
    int_mm      torch._int_mm: int8 x int8 -> int32 on an int8 W^T, the activation's
                quantisation and the dequantisation included (the product of torchao's int8
                dynamic-activation quantization)
    inductor    the weight-only product ``(x @ q.float().t()) * scale`` compiled by inductor

and reports each as microseconds a call and as its speed against fp32's (> 1: faster):

    python benchmarks/int8_products.py [--threads 1] [--no-inductor]

Writes runs/bench/int8_products.json (--out) and prints each row.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from decode_floor import cpu_name, write_result
from decode_products import PRODUCTS, cold_us
from txlm.inference.precision import int8_matmul, quantize_int8

RESULTS = Path("runs") / "bench" / "int8_products.json"


def copies(n_bytes: int) -> int:
    """Copies of a weight of ``n_bytes`` that together exceed the last-level cache."""
    return max(12, int(100e6 / n_bytes))


def quantise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of activations [N, in]: (int8 [N, in], scales [N, 1])."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def kernels(rows: int, n_out: int, n_in: int, inductor: bool) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n_in, generator=g)
    bias = torch.randn(n_out, generator=g)

    def weights(n_bytes_each: int) -> list[torch.Tensor]:
        return [torch.randn(n_out, n_in, generator=g) for _ in range(copies(n_bytes_each))]

    us: dict[str, float] = {}
    ws = [w.t().contiguous() for w in weights(4 * n_out * n_in)]
    us["fp32"] = cold_us(ws, lambda w: torch.addmm(bias, x, w))
    del ws

    packed = [quantize_int8(w) for w in weights(n_out * n_in)]
    us["woq"] = cold_us(
        packed, lambda p: torch.ops.aten._weight_int8pack_mm(x, p[0], p[1].float()) + bias
    )
    us["woq_bf16"] = cold_us(packed, lambda p: int8_matmul(x, *p) + bias)

    with warnings.catch_warnings():  # (quantized tensors: deprecated, still the fbgemm path)
        warnings.simplefilter("ignore")
        zeros = torch.zeros(n_out, dtype=torch.long)
        qweights = [
            torch.quantize_per_channel(
                q.float() * s.float()[:, None], s.double(), zeros, 0, torch.qint8
            )
            for q, s in packed
        ]
        prepacked = [torch.ops.quantized.linear_prepack(w, bias) for w in qweights]
        del qweights
        us["dynamic"] = cold_us(prepacked, lambda p: torch.ops.quantized.linear_dynamic(x, p))
    del prepacked

    transposed = [(q.t().contiguous(), s) for q, s in packed]

    def int_mm(p: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xq, xs = quantise_rows(x)
        return torch._int_mm(xq, p[0]).float() * xs * p[1].float() + bias

    try:
        us["int_mm"] = cold_us(transposed, int_mm)
    except RuntimeError:  # (a build whose _int_mm refuses these shapes)
        us["int_mm"] = float("nan")
    del transposed

    if inductor:
        torch._dynamo.reset()  # (a graph per shape: past dynamo's limit of 8 otherwise)

        @torch.compile(fullgraph=True, dynamic=False)
        def woq_compiled(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return (x @ q.float().t()) * s.float() + bias

        us["inductor"] = cold_us(packed, lambda p: woq_compiled(x, *p))
    return us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-inductor", action="store_true", help="skip the compiled product")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    rows_out = []
    try:
        for rows in (1, 16):
            for name, (n_out, n_in) in PRODUCTS.items():
                us = kernels(rows, n_out, n_in, not args.no_inductor)
                row = {"product": name, "rows": rows, **{k: round(v, 1) for k, v in us.items()}}
                row["speed_vs_fp32"] = {k: round(us["fp32"] / v, 2) for k, v in us.items()
                                        if k != "fp32"}  # fmt: skip
                rows_out.append(row)
                print(row, flush=True)
    finally:
        torch.set_num_threads(saved)
    result = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(),
        "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
        "threads": args.threads, "products": rows_out,
    }  # fmt: skip
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
