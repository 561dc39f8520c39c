"""Decoders with narrower weights: bf16 and weight-only int8 layers (txlm.inference.precision).

The int8 weight is per-row symmetric: each entry within half a scale step of the float
weight; the fused CPU kernel computes the product of the dequantised weight; a decoder with
int8 layers and head follows the float32 decoder closely and leaves the model as it was."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import debug_model
from txlm.inference.decode import Decoder
from txlm.inference.precision import (
    Int8Linear,
    RowLinear,
    int8_matmul,
    narrowed,
    quantize_int8,
)

from .test_cache import cached_log_probs


@pytest.mark.parametrize("width", [40, 64])  # (40: padded to the kernel's block of 16)
def test_int8_weights_are_within_half_a_step_and_the_kernel_multiplies_them(width: int) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, width, generator=g) * torch.rand(48, 1, generator=g)
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scales.dtype == torch.bfloat16
    assert q.shape == (48, 48 if width == 40 else 64) and not q[:, width:].any()
    dequantised = q[:, :width].float() * scales.float()[:, None]
    assert ((dequantised - weight).abs() <= scales.float()[:, None] / 2 + 1e-7).all()
    x = torch.randn(3, 5, width, generator=g)
    got = int8_matmul(x, q, scales)
    assert got.shape == (3, 5, 48) and got.dtype == torch.float32
    # the product of the inputs rounded to bf16, its sums rounded to bf16 once
    want = x.bfloat16().float() @ dequantised.t()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=2**-8)
    # (and not the float32 inputs' product: the inputs are bf16)
    assert not torch.allclose(got, x @ dequantised.t(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("overrides", [{}, dict(cutoffs=[20, 40], div_val=2)])
def test_int8_decoder_follows_the_float32_decoder(overrides: dict) -> None:
    model = debug_model(std=0.1, tgt_len=8, mem_len=24, **overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (13,), generator=g).tolist()
    cont = torch.randint(0, 64, (60,), generator=g).tolist()
    want = cached_log_probs(model, prompt, cont)
    dec = Decoder(model, int8=True)
    assert isinstance(dec.net.layers[0].ff.fc1, Int8Linear)
    assert isinstance(dec.head, Int8Linear)
    got = [dec.prefill([prompt])[0]]
    got += [dec.step(torch.tensor([t]))[0] for t in cont[:-1]]
    got = torch.stack(got)
    # weights rounded to 8 bits: log-probs move by a few hundredths, no more
    diff = (got - want).abs()
    assert 0 < diff.max() < 0.1, diff.max()
    # the distributions keep their order where it is clear: the same greedy token
    clear = (want.topk(2).values[:, 0] - want.topk(2).values[:, 1]) > 0.2
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    assert model.layers[0].attn.qkv.weight.dtype == torch.float32
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_narrowed_shares_every_tensor_but_the_projections() -> None:
    model = debug_model(std=0.1)
    for precision in ("fp32", "bf16", "int8"):
        net = narrowed(model, precision)
        assert net.embed.layers[0].weight is model.embed.layers[0].weight
        assert net.layers[0].attn.norm.weight is model.layers[0].attn.norm.weight
        assert net.layers[0].attn.r_net.weight is model.layers[0].attn.r_net.weight
        assert net.layers[0].attn.qkv is not model.layers[0].attn.qkv
    rows = torch.randn(5, model.config.d_model)
    fc1 = model.layers[0].ff.fc1
    torch.testing.assert_close(narrowed(model, "fp32").layers[0].ff.fc1(rows), fc1(rows))


@pytest.mark.parametrize(
    ("out", "inn", "transposed"), [(48, 16, True), (16, 16, True), (16, 48, False)]
)
@pytest.mark.parametrize("bias", [True, False])
def test_row_linear_holds_the_longer_axis_contiguous_and_multiplies_as_linear(
    out: int, inn: int, transposed: bool, bias: bool
) -> None:
    g = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(inn, out, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out, inn, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(out, generator=g))
    row = RowLinear(linear, torch.float32)
    assert row.transposed is transposed
    assert row.held.is_contiguous() and row.held.size(-1) == (out if transposed else inn)
    x = torch.randn(3, inn, generator=g)
    torch.testing.assert_close(row(x), linear(x), atol=1e-5, rtol=1e-5)


def test_the_decoders_head_is_held_for_one_product_in_its_precision() -> None:
    model = debug_model(std=0.1)
    head = Decoder(model).head
    assert isinstance(head, RowLinear) and head.transposed  # V >= D: rows of V entries
    assert Decoder(model, dtype=torch.bfloat16).head.held.dtype == torch.bfloat16
