"""A model's layers with their weights in a narrower form, for inference: fewer bytes a token.

A decoding step at batch 1 streams every layer's weights from memory once per token, so its
time is their bytes over the read bandwidth: bf16 weights halve them, int8 weights quarter
them. ``narrowed(model, precision)`` is the model with each layer's four projections (the
attention's qkv and output, the feed-forward's two) replaced by modules that hold their weight
in that form; everything else (embedding, position projections, LayerNorms, u and v, the
output layer) is the model's own tensors, shared, not copied. The model itself is not changed.

    "fp32"  the weights as they are, held with their longer axis contiguous (RowLinear)
    "bf16"  bf16 weights; inputs cast to bf16, products accumulated in float32 by the kernel
    "int8"  weight-only int8 (one float scale per output row, symmetric), the product
            ``torch.ops.aten._weight_int8pack_mm`` (what torchao's int8 weight-only
            quantization runs on a CPU) on bf16 activations, the weight dequantised inside
            the kernel; its output float32
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txlm.errors import ConfigError
from txlm.model.transformer import TransformerXL

Precision = Literal["fp32", "bf16", "int8"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "int8")  # what the commands offer
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # (fp16: a CUDA decoder's autocast)


class RowLinear(nn.Module):
    """``nn.Linear`` for rows [N, in], its weight held in ``dtype`` (the input cast to it)
    with its longer axis contiguous: W^T [in, out] when out >= in, one ``mm`` (``addmm``
    with the bias) a call, else W [out, in] as it is (``F.linear``). A decoding step's few
    rows stream each weight from memory once, and the CPU's library product reads a weight
    at close to the memory's rate only along long contiguous rows: with 256-entry rows it
    reads at a third of that rate (docs/performance-cpu.md, "The decoding step's products")."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.transposed = w.size(0) >= w.size(1)
        self.register_buffer("held", (w.t() if self.transposed else w).to(dtype).contiguous())
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        w = self.held
        x = x if x.dtype == w.dtype else x.to(w.dtype)
        if not self.transposed:
            return F.linear(x, w, self.bias)
        return torch.mm(x, w) if self.bias is None else torch.addmm(self.bias, x, w)


# torch 2.13's CPU kernel for weight-only int8 (``aten._weight_int8pack_mm``) is vectorised
# for bf16 inputs only: with float32 inputs it runs 10-40x slower than with bf16 ones
# (benchmarks/int8_products.py). It reads the input dim in blocks of this many entries and
# crashes on any other width, so an int8 weight's rows are padded with zero columns to a
# multiple of it, and its inputs with zeros to match.
INT8_BLOCK = 16


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: (q [out, in'] int8, scales [out] bf16) with q * scale ~ w,
    in' the input dim padded with zero columns to a multiple of ``INT8_BLOCK``. The scales
    are the kernel's dtype, so q is rounded against the scale the kernel multiplies by."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return F.pad(q, (0, -q.size(1) % INT8_BLOCK)), scales


def int8_matmul(x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
    """x [..., in] @ (q * scales)^T -> [..., out] float32, (q, scales) from ``quantize_int8``.
    On a CPU the fused kernel (it dequantises as it streams the weight) on x in bf16, its
    float32 sums rounded to bf16 once."""
    rows = x.reshape(-1, x.size(-1))
    if rows.size(1) != q.size(1):  # (the kernel's block: zero columns, zero inputs)
        rows = F.pad(rows, (0, q.size(1) - rows.size(1)))
    if rows.device.type == "cpu":
        out = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), q, scales).float()
    else:
        out = (rows @ q.to(x.dtype).t()) * scales.to(x.dtype)
    return out.view(*x.shape[:-1], -1)


class Int8Linear(nn.Module):
    """``nn.Linear`` with a weight-only int8 weight (``quantize_int8``); the bias stays float."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scales = quantize_int8(linear.weight)
        self.register_buffer("q", q)
        self.register_buffer("scales", scales)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)

    def forward(self, x: Tensor) -> Tensor:
        out = int8_matmul(x, self.q, self.scales)
        return out if self.bias is None else out + self.bias


def narrow_linear(linear: nn.Linear, precision: str) -> nn.Module:
    """``linear`` in ``precision`` (see the module docstring), for rows [N, in]."""
    if precision == "fp32":
        return RowLinear(linear, linear.weight.dtype)
    if precision in HALF:
        return RowLinear(linear, HALF[precision])
    if precision == "int8":
        return Int8Linear(linear)
    raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def narrowed(model: TransformerXL, precision: str) -> TransformerXL:
    """The model with its layers' projections in ``precision`` for a decoder (``RowLinear``,
    "fp32" and the half dtypes; ``Int8Linear``).

    A copy of the module tree whose other tensors are the model's (shared, not copied), then
    each layer's qkv, out, fc1 and fc2 replaced in the copy, made from the weights as they
    are now. Its forward hooks are the model's as they are now (the hook dictionaries are
    copied, the functions shared)."""
    if precision not in PRECISIONS and precision not in HALF:
        raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    tensors = [*model.parameters(), *model.buffers()]
    net = copy.deepcopy(model, memo={id(t): t for t in tensors})
    with torch.no_grad():
        for layer in net.layers:
            for owner, name in ((layer.attn, "qkv"), (layer.attn, "out"),
                                (layer.ff, "fc1"), (layer.ff, "fc2")):  # fmt: skip
                setattr(owner, name, narrow_linear(getattr(owner, name), precision))
    return net
