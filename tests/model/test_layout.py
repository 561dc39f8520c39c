"""``txlm.model.layout``: a layer's weights as a decoder holds them. Each is the layer's own
weight transposed, in the products' dtype: a contiguous copy on the CPU up to
``SMALL_WEIGHT`` elements, a view above it; the position biases are the layer's or the
model's shared ones; the model is left as it was."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import debug_model
from txlm.model.layout import SMALL_WEIGHT, one_row_layout


def test_a_small_weight_is_a_contiguous_copy_a_large_one_a_view() -> None:
    small = torch.randn(24, 40)
    got = one_row_layout(small, torch.float32)
    assert got.is_contiguous() and got.data_ptr() != small.data_ptr()
    assert torch.equal(got, small.t())
    large = torch.empty(SMALL_WEIGHT // 100 + 1, 100)
    view = one_row_layout(large, torch.float32)
    assert view.data_ptr() == large.data_ptr() and not view.is_contiguous()
    assert one_row_layout(small, torch.float64).dtype == torch.float64


@pytest.mark.parametrize("untie_r", [False, True])
def test_step_weights_are_each_layers_own(untie_r) -> None:
    model = debug_model(0, untie_r=untie_r)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = model.step_weights(dtype=torch.float64, attn_dtype=torch.float64)
    for layer, w in zip(model.layers, weights, strict=True):
        attn, ff = layer.attn, layer.ff
        assert torch.equal(w.qkv_t, attn.qkv.weight.t().double())
        assert torch.equal(w.out_t, attn.out.weight.t().double())
        assert torch.equal(w.fc1_t, ff.fc1.weight.t().double())
        assert torch.equal(w.fc2_b, ff.fc2.bias.double())
        assert w.norm1[0] is not None and torch.equal(w.norm1[0], attn.norm.weight)
        u = attn.u if untie_r else model.u
        assert torch.equal(w.u, u.double().unsqueeze(1))  # [H, 1, Dh]
    state = model.state_dict()
    assert all(torch.equal(before[k], state[k]) for k in before)  # the model untouched
