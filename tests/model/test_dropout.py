"""txlm.model.dropout: the CPU mask drops at rate p, independently, and scales without bias."""

from __future__ import annotations

import math

import pytest
import torch

from txlm.model.dropout import Dropout, dropout, keep_mask

CPU = torch.device("cpu")


@pytest.mark.parametrize("p", [0.1, 0.25, 0.6])
def test_each_packed_field_drops_at_rate_p(p):
    torch.manual_seed(0)
    n = 3 * 400_000
    keep = keep_mask((n,), p, CPU).view(-1, 3).float()  # column f: field f of each draw
    sigma = math.sqrt(p * (1 - p) / keep.size(0))
    dropped = 1 - keep.mean(0)
    assert (dropped - p).abs().max() < 6 * sigma, dropped
    # neighbours come from disjoint bits of one draw (or from different draws): uncorrelated
    centred = keep - keep.mean(0)
    corr = (centred[:, 0] * centred[:, 1]).mean() / (p * (1 - p))
    corr_next = (centred[:-1, 2] * centred[1:, 0]).mean() / (p * (1 - p))
    assert abs(corr) < 6 / math.sqrt(keep.size(0))
    assert abs(corr_next) < 6 / math.sqrt(keep.size(0))


def test_mask_shape_and_odd_sizes():
    for shape in [(1,), (2,), (4,), (3, 5, 7), (2, 1, 128, 257)]:
        assert keep_mask(shape, 0.3, CPU).shape == torch.Size(shape)
    assert keep_mask((0, 4), 0.3, CPU).shape == (0, 4)


def test_kept_values_are_scaled_by_the_inverse_keep_probability():
    torch.manual_seed(1)
    x = torch.randn(64, 333)
    y = dropout(x, 0.1, True)
    kept = y != 0
    scale = 2**21 / (2**21 - round(0.1 * 2**21))
    torch.testing.assert_close(y[kept], x[kept] * scale)
    assert abs(scale - 1 / 0.9) < 1e-6
    # unbiased: the mean of many dropped copies of 1 is 1
    ones = dropout(torch.ones(2_000_000), 0.1, True)
    assert abs(ones.mean().item() - 1.0) < 6 * math.sqrt(0.1 / 0.9 / 2_000_000)


def test_seeded_masks_repeat_and_differ_across_seeds():
    torch.manual_seed(7)
    a = dropout(torch.ones(1000), 0.5, True)
    torch.manual_seed(7)
    b = dropout(torch.ones(1000), 0.5, True)
    torch.manual_seed(8)
    c = dropout(torch.ones(1000), 0.5, True)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(2)
    x = torch.randn(8, 50, requires_grad=True)
    y = dropout(x, 0.2, True)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, (y / x).detach())  # mask * scale where kept, 0 else


def test_identity_and_limits():
    x = torch.randn(4, 9)
    assert dropout(x, 0.1, False) is x
    assert dropout(x, 0.0, True) is x
    assert torch.equal(dropout(x, 1.0, True), torch.zeros_like(x))
    assert dropout(x.bfloat16(), 0.1, True).dtype == torch.bfloat16
    module = Dropout(0.3)
    assert "p=0.3" in repr(module)
    assert module.eval()(x) is x
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(1.5)
