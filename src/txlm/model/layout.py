"""A decoder layer's weights laid out for one-row products: what a decoder's forward multiplies.

Dimension legend
    D  model dim     I  H Dh, the attention's inner dim     F  feed-forward inner dim

A decoding step multiplies one row per sequence by each weight: a matrix-vector product,
bound by reading the weight. On a CPU its speed depends on the layout: MKL streams a
contiguous [in, out] buffer faster than the [out, in] weight of an ``nn.Linear`` viewed
transposed, so there the weights where it matters are held as such copies
(``one_row_layout``). On CUDA, where
the product is a kernel either way, they are views of the parameters unless the decoder runs
in another dtype (bf16 weights halve the bytes a token reads). Made once per decoder, from
the model as it is at that moment: the model itself is not changed or copied. (``.to(dtype)``
of a weight already in ``dtype`` is the weight itself, so a view stays a view of it.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Above this many elements a one-row product on a CPU streams the weight as fast from either
# layout (it no longer fits in cache), and a copy would only cost the decoder's set-up time;
# below it the contiguous [in, out] copy is the faster one for every shape a layer has.
SMALL_WEIGHT = 600_000


def one_row_layout(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """W^T [in, out] of a weight [out, in] in ``dtype``: a contiguous copy on a CPU where the
    layout is measured to matter (at most ``SMALL_WEIGHT`` elements), else a view."""
    w = weight.detach().to(dtype)
    if w.device.type == "cpu" and w.numel() <= SMALL_WEIGHT:
        return w.t().contiguous()
    return w.t()


@dataclass(frozen=True)
class StepWeights:
    """Everything a decoder layer's forward reads over a decoder's cache, ready to use
    (``RelativeAttention.forward``'s and ``PositionwiseFF.forward``'s ``weights``): the projections
    as W^T [in, out] in the products' dtype, the LayerNorms as (weight, bias, eps), and the
    layer's position biases u, v [H, Dh] ("xl": its own or the model's shared ones, else
    None) in the attention's dtype. Plain tensors: a step makes no module attribute look-up
    for them."""

    qkv_t: Tensor  # [D, 3 I]: queries, keys, values
    out_t: Tensor  # [I, D]
    fc1_t: Tensor  # [D, F]
    fc1_b: Tensor  # [F]
    fc2_t: Tensor  # [F, D]
    fc2_b: Tensor  # [D]
    norm1: tuple[Tensor, Tensor, float]  # the attention's LayerNorm
    norm2: tuple[Tensor, Tensor, float]  # the feed-forward's
    u: Tensor | None
    v: Tensor | None

    @classmethod
    def of(
        cls,
        layer: nn.Module,
        u: Tensor | None,
        v: Tensor | None,
        *,
        dtype: torch.dtype | None = None,
        attn_dtype: torch.dtype | None = None,
    ) -> StepWeights:
        """``layer``'s weights; ``u``, ``v``: the model's shared biases. ``dtype``: the
        products' (None: the weights'); ``attn_dtype``: the biases' (None: the weights')."""
        attn, ff = layer.attn, layer.ff
        own = attn.qkv.weight
        dtype = own.dtype if dtype is None else dtype
        attn_dtype = own.dtype if attn_dtype is None else attn_dtype

        if attn.attn_type != "xl":
            u = v = None
        elif attn.untie_r:
            u, v = attn.u, attn.v

        def bias(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.detach().to(attn_dtype).unsqueeze(1)

        def norm(m: nn.LayerNorm) -> tuple[Tensor, Tensor, float]:
            return m.weight.detach(), m.bias.detach(), m.eps

        return cls(
            qkv_t=one_row_layout(attn.qkv.weight, dtype),
            out_t=one_row_layout(attn.out.weight, dtype),
            fc1_t=one_row_layout(ff.fc1.weight, dtype), fc1_b=ff.fc1.bias.detach().to(dtype),
            fc2_t=one_row_layout(ff.fc2.weight, dtype), fc2_b=ff.fc2.bias.detach().to(dtype),
            norm1=norm(attn.norm), norm2=norm(ff.norm), u=bias(u), v=bias(v),
        )  # fmt: skip
