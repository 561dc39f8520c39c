"""ARCHITECTURE.md contracts C1-C7 and C10: memory, mask, rel shift, segment equivalence, causality,
per-row reset, in-order adaptive losses — plus gradient flow.

All in float64 so that equalities that hold mathematically hold to 1e-10 here.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.models import debug_model
from txlm.model import rel_shift
from txlm.model.mask import attention_mask, causal_mask

ATOL = 1e-10


@pytest.fixture(autouse=True)
def float64_default():
    """float64 for this module only: a global default would leak into other test files."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


make_model = functools.partial(
    debug_model, dtype=torch.float64, dropout=0.0, dropatt=0.0, attn_impl="math"
)


def tokens(batch: int, length: int, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


# -- 1. memory ------------------------------------------------------------------------


def test_memory_shape_detached_and_trimmed_to_mem_len():
    model = make_model(mem_len=20)
    model.train()
    x = tokens(3, 16)
    out = model(x, labels=x)
    assert len(out.mems) == model.config.n_layer
    assert all(m.shape == (3, 16, 32) for m in out.mems)  # first segment: M = L < mem_len
    out2 = model(x, mems=out.mems, labels=x)
    assert all(m.shape == (3, 20, 32) for m in out2.mems)  # Tail_M: newest 20 of 32
    assert all(not m.requires_grad and m.grad_fn is None for m in out2.mems)


def test_memory_holds_each_layers_input_states_newest_last():
    model = make_model(mem_len=24)
    x1, x2 = tokens(2, 16, seed=1), tokens(2, 16, seed=2)
    out1 = model(x1)
    hidden_inputs = []

    # Record every layer's input during the second segment with forward hooks.
    hooks = [
        layer.register_forward_pre_hook(lambda mod, args: hidden_inputs.append(args[0]))
        for layer in model.layers
    ]
    out2 = model(x2, mems=out1.mems)
    for h in hooks:
        h.remove()
    for n, mem in enumerate(out2.mems):
        expected = torch.cat([out1.mems[n], hidden_inputs[n]], dim=1)[:, -24:]
        torch.testing.assert_close(mem, expected, atol=0, rtol=0)


def test_mem_len_zero_switches_recurrence_off():
    model = make_model(mem_len=0)
    x = tokens(2, 16)
    out = model(x)
    assert all(m.shape == (2, 0, 32) for m in out.mems)
    again = model(x, mems=out.mems)
    torch.testing.assert_close(again.log_probs, out.log_probs, atol=ATOL, rtol=0)


# -- 2. rectangular mask --------------------------------------------------------------


def test_mask_is_rectangular_all_memory_visible_causal_on_current():
    mask = causal_mask(4, 3, mem_len=3, same_length=False)
    expected = torch.tensor(
        [
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_same_length_mask_gives_every_query_mem_len_keys():
    mask = causal_mask(4, 3, mem_len=3, same_length=True)
    expected = torch.tensor(
        [
            [0, 1, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1, 0, 0],
            [0, 0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    # First segment (no memory yet): the window is still mem_len wide, ending at the query.
    first = causal_mask(4, 0, mem_len=2, same_length=True)
    assert first.sum(1).tolist() == [1, 2, 2, 2]


# -- 3. rel shift golden test ---------------------------------------------------------


@pytest.mark.parametrize(("qlen", "mlen"), [(1, 0), (4, 0), (4, 3), (3, 7), (5, 5)])
def test_rel_shift_assigns_distance_i_minus_j(qlen: int, mlen: int):
    klen = qlen + mlen
    # Column c of the per-distance scores is labelled with its distance K-1-c.
    labels = torch.arange(klen - 1, -2, -1, dtype=torch.float64)
    per_distance = labels.expand(2, 3, qlen, klen + 1).clone()  # [B, H, L, K+1]
    shifted = rel_shift(per_distance)
    assert shifted.shape == (2, 3, qlen, klen)
    query = torch.arange(qlen)[:, None] + mlen  # query i sits at key index M + i
    key = torch.arange(klen)[None, :]
    visible = key <= query
    expected = (query - key).to(torch.float64).expand(2, 3, qlen, klen)
    assert torch.equal(shifted[..., visible], expected[..., visible])


def test_rel_shift_gradient_reaches_only_the_used_distances():
    x = torch.zeros(1, 1, 3, 6, requires_grad=True)  # L=3, K=5 -> M=2
    shifted = rel_shift(x)
    visible = causal_mask(3, 2, mem_len=2, same_length=False)
    shifted[..., visible].sum().backward()
    # Row i uses columns c = L-1-i+j for j <= M+i: c in [2-i, 4]; never the -1 column (c=5).
    expected = torch.zeros(3, 6)
    for i in range(3):
        expected[i, 2 - i : 5] = 1
    assert torch.equal(x.grad[0, 0], expected)


# -- 4. queries and loss from the current segment only --------------------------------


def test_outputs_and_loss_cover_current_segment_only():
    model = make_model(mem_len=16)
    x1, x2 = tokens(2, 16, seed=1), tokens(2, 8, seed=2)
    out1 = model(x1)
    out2 = model(x2, mems=out1.mems, labels=x2)
    assert out2.losses.shape == (2, 8)
    assert out2.hidden.shape == (2, 8, 32)
    log_probs = model(x2, mems=out1.mems).log_probs
    assert log_probs.shape == (2, 8, 64)
    picked = -log_probs.gather(2, x2[..., None]).squeeze(2)
    torch.testing.assert_close(out2.losses, picked, atol=ATOL, rtol=0)


# -- 5. segment equivalence -----------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(pre_lnorm=True),
        dict(untie_r=True),
        dict(clamp_len=5),
        dict(attn_type="shaw", n_positions=40),
        dict(cutoffs=[16, 40], div_val=2),
        dict(attn_impl="sdpa"),
    ],
    ids=["xl", "pre_lnorm", "untie_r", "clamp", "shaw", "adaptive", "sdpa"],
)
def test_two_segments_with_memory_equal_one_long_segment(variant):
    model = make_model(mem_len=16, **variant)
    x = tokens(2, 32)
    whole = model(x).log_probs
    first = model(x[:, :16])
    second = model(x[:, 16:], mems=first.mems)
    torch.testing.assert_close(first.log_probs, whole[:, :16], atol=ATOL, rtol=0)
    torch.testing.assert_close(second.log_probs, whole[:, 16:], atol=ATOL, rtol=0)


def test_same_length_two_segments_equal_one_long_segment():
    model = make_model(mem_len=16, same_length=True)
    x = tokens(2, 32)
    whole = model(x).log_probs
    first = model(x[:, :16])
    second = model(x[:, 16:], mems=first.mems)
    torch.testing.assert_close(second.log_probs, whole[:, 16:], atol=ATOL, rtol=0)


# -- 6. causality ---------------------------------------------------------------------


@pytest.mark.parametrize("attn_type", ["xl", "shaw", "vaswani", "alrfou"])
def test_changing_token_t_never_changes_earlier_log_probs_across_segments(attn_type):
    model = make_model(mem_len=16, attn_type=attn_type, n_positions=64)
    x = tokens(1, 48)
    t = 27  # inside the second of three segments
    y = x.clone()
    y[0, t] = (x[0, t] + 1) % 64

    def run(ids):
        outs, mems = [], None
        for s in range(0, 48, 16):
            out = model(ids[:, s : s + 16], mems=mems)
            outs.append(out.log_probs)
            mems = out.mems
        return torch.cat(outs, dim=1)

    a, b = run(x), run(y)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=ATOL, rtol=0)
    assert (a[:, t:] - b[:, t:]).abs().max() > 1e-6  # and the change does propagate


# -- 7. per-row reset -----------------------------------------------------------------


def test_reset_row_equals_running_that_row_alone_with_empty_memory():
    model = make_model(mem_len=16)
    x1, x2, x3 = (tokens(3, 8, seed=s) for s in (1, 2, 3))
    first = model(x1)
    reset = torch.tensor([False, True, False])
    second = model(x2, mems=first.mems, reset=reset)
    third = model(x3, mems=second.mems, mem_mask=second.mem_mask)

    # Row 1 restarted at x2: equal to that row alone from x2, memory empty.
    alone2 = model(x2[1:2])
    alone3 = model(x3[1:2], mems=alone2.mems)
    torch.testing.assert_close(second.log_probs[1:2], alone2.log_probs, atol=ATOL, rtol=0)
    torch.testing.assert_close(third.log_probs[1:2], alone3.log_probs, atol=ATOL, rtol=0)

    # Rows 0 and 2 are untouched by row 1's reset.
    plain2 = model(x2, mems=first.mems)
    plain3 = model(x3, mems=plain2.mems)
    for row in (0, 2):
        torch.testing.assert_close(second.log_probs[row], plain2.log_probs[row], atol=ATOL, rtol=0)
        torch.testing.assert_close(third.log_probs[row], plain3.log_probs[row], atol=ATOL, rtol=0)


def test_reset_masks_memory_rather_than_zeroing_it():
    model = make_model(mem_len=16)
    x1, x2 = tokens(1, 8, seed=1), tokens(1, 8, seed=2)
    first = model(x1)
    masked = model(x2, mems=first.mems, reset=torch.tensor([True])).log_probs
    zeroed = model(x2, mems=[torch.zeros_like(m) for m in first.mems]).log_probs
    alone = model(x2).log_probs
    torch.testing.assert_close(masked, alone, atol=ATOL, rtol=0)
    assert (zeroed - alone).abs().max() > 1e-4  # zero vectors still take attention weight


def test_token_level_document_start_inside_a_segment():
    model = make_model(mem_len=16)
    x1, x2 = tokens(2, 8, seed=1), tokens(2, 8, seed=2)
    first = model(x1)
    starts = torch.zeros(2, 8, dtype=torch.bool)
    starts[0, 5] = True  # row 0: a new document begins at token 5 of the second segment
    out = model(x2, mems=first.mems, reset=starts)
    alone = model(x2[0:1, 5:])
    torch.testing.assert_close(out.log_probs[0, 5:], alone.log_probs[0], atol=ATOL, rtol=0)
    plain = model(x2, mems=first.mems)
    torch.testing.assert_close(out.log_probs[0, :5], plain.log_probs[0, :5], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.log_probs[1], plain.log_probs[1], atol=ATOL, rtol=0)
    # The next segment of row 0 sees only the new document in its memory.
    x3 = tokens(2, 8, seed=3)
    nxt = model(x3, mems=out.mems, mem_mask=out.mem_mask)
    alone_next = model(x3[0:1], mems=alone.mems)
    torch.testing.assert_close(nxt.log_probs[0], alone_next.log_probs[0], atol=ATOL, rtol=0)


def test_next_memory_validity_is_aligned_with_the_trimmed_memory():
    starts = torch.tensor([[False, False, True, False]])
    mask, valid = attention_mask(4, 3, mem_len=5, same_length=False, reset=starts)
    assert mask.shape == (1, 1, 4, 7)
    # keys: 3 memory + 4 current; the open document starts at current token 2.
    assert valid.tolist() == [[False, False, False, True, True]]


# -- 10. adaptive softmax: per-token losses in input order ----------------------------


@pytest.mark.parametrize("div_val", [1, 2])
def test_adaptive_losses_in_input_order_and_ignore_index(div_val):
    model = make_model(cutoffs=[8, 24], div_val=div_val, d_embed=32)
    x = tokens(2, 16)
    labels = tokens(2, 16, seed=5)
    labels[0, 3] = -100
    out = model(x, labels=labels)
    log_probs = model(x).log_probs
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(2, 16))
    safe = labels.clamp(min=0)
    expected = -log_probs.gather(2, safe[..., None]).squeeze(2)
    expected[0, 3] = 0.0
    torch.testing.assert_close(out.losses, expected, atol=ATOL, rtol=0)


def test_full_softmax_ignore_index():
    model = make_model()
    x = tokens(2, 16)
    labels = x.clone()
    labels[:, :4] = -100
    loss = model(x, labels=labels).losses
    assert torch.all(loss[:, :4] == 0) and torch.all(loss[:, 4:] > 0)


# -- gradients ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(cutoffs=[8, 24], div_val=2),
        dict(attn_type="shaw"),
        dict(attn_type="alrfou"),
        dict(untie_r=True, pre_lnorm=True),
        dict(attn_impl="sdpa"),
    ],
    ids=["xl", "adaptive", "shaw", "alrfou", "untied-prelnorm", "sdpa"],
)
def test_every_parameter_gets_a_gradient_and_memory_gets_none(variant):
    model = make_model(**variant)
    model.train()
    x = tokens(2, 16)
    first = model(x)
    mems = [m.clone().requires_grad_(True) for m in first.mems]
    # Targets all in the shortlist: the tail clusters see no tokens yet still get gradients.
    out = model(x, mems=mems, labels=x % 8)
    out.losses.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    assert all(m.grad is not None for m in mems)  # used as context ...
    # ... but nothing from the new memory leads back into the graph.
    assert all(m.grad_fn is None for m in out.mems)


def test_sdpa_and_math_paths_agree():
    x = tokens(2, 16)
    a = make_model(attn_impl="math", same_length=True, clamp_len=6)
    b = make_model(attn_impl="sdpa", same_length=True, clamp_len=6)
    m1, m2 = a(x), b(x)
    torch.testing.assert_close(m1.log_probs, m2.log_probs, atol=1e-9, rtol=0)
    r1 = a(x, mems=m1.mems, reset=torch.tensor([True, False]))
    r2 = b(x, mems=m2.mems, reset=torch.tensor([True, False]))
    torch.testing.assert_close(r1.log_probs, r2.log_probs, atol=1e-9, rtol=0)
