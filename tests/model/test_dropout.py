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


# -- variational (locked) dropout ---------------------------------------------------------------
def test_a_locked_mask_is_shared_across_positions_and_differs_across_rows_and_features():
    torch.manual_seed(3)
    b, length, f, p = 64, 12, 96, 0.4
    x = torch.randn(b, length, f, requires_grad=True)
    y = dropout(x, p, True, locked=True)
    keep = y.detach() != 0  # x has no zeros
    # one mask per (row, feature): every position of a row sees the same one
    assert torch.equal(keep, keep[:, :1].expand_as(keep))
    scale = 2**21 / (2**21 - round(p * 2**21))
    torch.testing.assert_close(y[keep], x[keep] * scale)
    kept = keep[:, 0]
    # rows differ from each other, features within a row differ
    assert len({tuple(row.tolist()) for row in kept}) == b
    assert all(0 < int(row.sum()) < f for row in kept)
    # the drop rate is p over the rows and features
    sigma = math.sqrt(p * (1 - p) / kept.numel())
    assert abs((1 - kept.float().mean()).item() - p) < 6 * sigma
    # the gradient is the same mask
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, keep * scale)


def test_locked_dropout_limits_and_shapes():
    x = torch.randn(2, 5, 7)
    assert dropout(x, 0.3, False, locked=True) is x
    assert dropout(x, 0.0, True, locked=True) is x
    assert dropout(x.bfloat16(), 0.3, True, locked=True).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\[B, L, F\]"):
        dropout(torch.randn(10, 7), 0.3, True, locked=True)


def _record_sites(monkeypatch):
    """Every functional dropout call of the model: (p, input shape, locked, kept)."""
    from txlm.model import attention, transformer

    calls = []

    def recording(x, p, training, locked=False):
        # the mask: the same draws applied to ones (the generator put back between the two)
        state = torch.get_rng_state()
        mask = dropout(torch.ones_like(x), p, training, locked)
        torch.set_rng_state(state)
        y = dropout(x, p, training, locked)
        torch.testing.assert_close(y, x * mask)
        calls.append((p, tuple(x.shape), locked, mask.detach() != 0))
        return y

    monkeypatch.setattr(transformer, "dropout", recording)
    monkeypatch.setattr(attention, "dropout", recording)
    return calls


@pytest.mark.parametrize("variational", [True, False])
def test_the_models_hidden_state_sites_use_the_setting(monkeypatch, variational):
    """With ``variational_dropout`` every hidden-state site (the embedding output, each
    layer's attention output, feed-forward inner activation and output, the last layer's
    output: 2 + 3 n_layer) draws one mask per row and feature, shared by the segment's
    positions; without it none is locked and masks vary along the positions."""
    from tests.helpers.models import debug_model

    model = debug_model(0, dropout=0.3, dropatt=0.2, variational_dropout=variational).train()
    calls = _record_sites(monkeypatch)
    torch.manual_seed(5)
    ids = torch.randint(0, 64, (4, 16))
    model(ids, labels=ids)
    n_layer = model.config.n_layer
    hidden = [c for c in calls if c[0] == 0.3]
    assert len(hidden) == 2 + 3 * n_layer
    for _, shape, locked, keep in hidden:
        assert len(shape) == 3 and shape[:2] == (4, 16), shape
        assert locked == variational
        assert torch.equal(keep, keep[:, :1].expand_as(keep)) == variational
    # the attention probabilities' dropout stays element-wise
    attention_probs = [c for c in calls if c[0] == 0.2]
    assert len(attention_probs) == n_layer and not any(c[2] for c in attention_probs)


def test_variational_dropout_changes_nothing_in_evaluation_and_repeats_under_a_seed():
    from tests.helpers.models import debug_model

    plain = debug_model(0, dropout=0.3)
    locked = debug_model(0, dropout=0.3, variational_dropout=True)
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    a, b = plain(ids, labels=ids), locked(ids, labels=ids)
    assert torch.equal(a.losses, b.losses)  # eval mode: the same computation
    locked.train()
    losses = []
    for _ in range(2):
        torch.manual_seed(9)
        losses.append(locked(ids, labels=ids).losses.detach())
    assert torch.equal(losses[0], losses[1])
    assert not torch.equal(losses[0], b.losses)
