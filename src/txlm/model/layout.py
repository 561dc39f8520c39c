"""A decoder layer's weights laid out for one-row products: what a decoding step multiplies.

Dimension legend
    D  model dim     I  H Dh, the attention's inner dim     F  feed-forward inner dim

A decoding step multiplies one row per sequence by each weight: a matrix-vector product,
bound by reading the weight. On a CPU its speed depends on the layout: from a contiguous
[in, out] buffer MKL streams it about twice as fast as from the [out, in] weight of an
``nn.Linear`` viewed transposed (256 x 1024: ~9 us instead of ~16 us, one thread), so there
the weights are held as such copies. On CUDA, where the product is a kernel either way, they
are views of the parameters unless the decoder runs in another dtype (bf16 weights halve
the bytes a token reads). Made once per decoder, from the model as it is at that moment: the
model itself is not changed or copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def one_row_layout(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """W^T [in, out] of a weight [out, in] in ``dtype``: contiguous on a CPU, else a view."""
    w = weight.detach()
    if w.device.type == "cpu":
        return w.to(dtype).t().contiguous()
    return w.to(dtype).t()


@dataclass(frozen=True)
class StepWeights:
    """One decoder layer's weights for ``DecoderLayer``'s one-query step, as W^T [in, out]."""

    qkv_t: Tensor  # [D, 3 I]: queries, keys, values
    out_t: Tensor  # [I, D]
    fc1_t: Tensor  # [D, F]
    fc1_b: Tensor  # [F]
    fc2_t: Tensor  # [F, D]
    fc2_b: Tensor  # [D]

    @classmethod
    def of(cls, layer: nn.Module, dtype: torch.dtype) -> StepWeights:
        attn, ff = layer.attn, layer.ff
        return cls(
            qkv_t=one_row_layout(attn.qkv.weight, dtype),
            out_t=one_row_layout(attn.out.weight, dtype),
            fc1_t=one_row_layout(ff.fc1.weight, dtype),
            fc1_b=ff.fc1.bias.detach().to(dtype),
            fc2_t=one_row_layout(ff.fc2.weight, dtype),
            fc2_b=ff.fc2.bias.detach().to(dtype),
        )
