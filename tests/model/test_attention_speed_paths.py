"""The optimised attention paths compute the paper's scores: fewer passes, same numbers.

- ``_bias`` + ``_scores`` (scale on the queries, additive mask, baddbmm) equal the textbook sum
  of the score terms (a)+(c) and the shifted (b)+(d), scaled and masked, for the shared and
  the per-row mask, with and without a position term;
- the "sdpa" and "math" implementations give the same outputs and the same gradients in
  training (dropatt = 0), and "sdpa" falls back to "math" exactly where the CPU kernel has no
  bias backward;
- the training forward traces into one torch.compile graph (no graph breaks);
- bf16 autocast training runs and stays close to float32.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.models import debug_model
from txlm.config import ModelConfig
from txlm.model.attention import RelativeAttention, rel_shift

ATOL = 1e-10


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


make_model = functools.partial(debug_model, dropout=0.0, dropatt=0.0)


def reference_scores(attn, q, k, rk, mask, u, v):
    scores = (q + u[:, None, :]) @ k.transpose(-1, -2)  # (a) + (c)
    if rk is not None:  # (b) + (d), per distance, then per pair
        scores = scores + rel_shift((q + v[:, None, :]) @ rk.transpose(-1, -2))
    return (scores * attn.scale).masked_fill(~mask, float("-inf"))


@pytest.mark.parametrize("per_row", [False, True], ids=["shared-mask", "per-row-mask"])
@pytest.mark.parametrize("with_position", [True, False], ids=["xl", "no-position"])
def test_fused_scores_equal_reference(float64, per_row, with_position):
    config = ModelConfig.from_preset("debug", attn_impl="math")
    attn = RelativeAttention(config)
    b, h, qlen, mlen, dh = 3, config.n_head, 5, 7, config.d_head
    klen = mlen + qlen
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, qlen, h, dh, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(b, klen, h, dh, generator=g).transpose(1, 2).requires_grad_()
    rk = torch.randn(h, klen + 1, dh, generator=g, requires_grad=True) if with_position else None
    u = torch.randn(h, dh, generator=g, requires_grad=True)
    v = torch.randn(h, dh, generator=g, requires_grad=True)
    mask = torch.ones(qlen, klen, dtype=torch.bool).tril(mlen)
    if per_row:
        mask = mask.expand(b, 1, qlen, klen).clone()
        mask[1, :, :, :mlen] = False  # a reset row: no memory
    inputs = [q, k, u] + ([rk, v] if with_position else [])

    bias, fresh = attn._bias(q, rk, mask, v.unsqueeze(1), None)  # v as [H, 1, Dh]
    got = attn._scores(q + u[:, None, :], k, bias, fresh)  # [B H, L, K]
    assert got.shape == (b * h, qlen, klen)
    got = got.view(b, h, qlen, klen)
    want = reference_scores(attn, q, k, rk, mask, u, v)
    assert got.shape == (b, h, qlen, klen)
    assert torch.equal(torch.isinf(got), ~mask.expand_as(got))
    torch.testing.assert_close(
        got[mask.expand_as(got)], want[mask.expand_as(want)], atol=ATOL, rtol=0
    )

    weights = torch.randn(got.shape, generator=g)
    grads_got = torch.autograd.grad((got.softmax(-1) * weights).sum(), inputs)
    grads_want = torch.autograd.grad((want.softmax(-1) * weights).sum(), inputs)
    for a, w in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(a, w, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(same_length=True, clamp_len=6), dict(pre_lnorm=True, untie_r=True)],
    ids=["xl", "same-length-clamp", "prelnorm-untie"],
)
def test_sdpa_and_math_agree_in_training_with_grads(float64, overrides):
    models = {impl: make_model(attn_impl=impl, **overrides).train() for impl in ("sdpa", "math")}
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
    reset = torch.tensor([False, True, False])
    results = {}
    for impl, model in models.items():
        out1 = model(x, labels=x)
        out2 = model(x, mems=out1.mems, reset=reset, mem_mask=out1.mem_mask, labels=x)
        (out1.losses.sum() + out2.losses.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[impl] = (out2.losses.detach(), grads)
    torch.testing.assert_close(results["sdpa"][0], results["math"][0], atol=ATOL, rtol=0)
    assert results["sdpa"][1].keys() == results["math"][1].keys()
    for name, g in results["sdpa"][1].items():
        torch.testing.assert_close(g, results["math"][1][name], atol=ATOL, rtol=0, msg=name)


def test_sdpa_falls_back_to_math_only_where_the_cpu_kernel_lacks_a_bias_backward():
    attn = RelativeAttention(ModelConfig.from_preset("debug", attn_impl="sdpa"))
    q = torch.randn(1, 2, 3, 16, requires_grad=True)
    rk = torch.randn(2, 4, 16)
    assert not attn._use_sdpa(q, rk, return_probs=False)  # training: bias needs a grad
    with torch.no_grad():
        assert attn._use_sdpa(q, rk, return_probs=False)  # evaluation: fused kernel
    assert attn._use_sdpa(q, None, return_probs=False)  # no bias (absolute encodings)
    assert not attn._use_sdpa(q.detach(), rk, return_probs=True)  # probabilities asked for


def test_training_forward_has_no_graph_breaks():
    """torch.compile can take the whole training forward (with memory) as one graph."""
    import torch._dynamo

    model = make_model(dropout=0.1).train()
    x = torch.randint(0, 64, (2, 16))
    mems = model(x).mems

    def step(ids, mems):
        out = model(ids, mems=mems, labels=ids)
        return out.losses.mean(), out.mems

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(x, mems)
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_bf16_autocast_training_close_to_float32(impl):
    model = make_model(attn_impl=impl).train()
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    out32 = model(x, labels=x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out16 = model(x, labels=x)
        out16b = model(x, mems=out16.mems, labels=x)
    assert out16.losses.dtype == torch.float32  # log-softmax in float32
    out16b.losses.mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    torch.testing.assert_close(out16.losses, out32.losses, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("attn_impl", ["sdpa", "math"])
def test_training_projects_the_memory_apart_with_the_same_gradients(attn_impl):
    """With a constant memory, training projects it in its own product (no input gradient for
    its rows); the weights' gradients equal those of the joint [memory; segment] product,
    which runs when the memory itself asks for a gradient."""
    model = make_model(attn_impl=attn_impl).train()
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(4))
    mems = [m.detach() for m in model(x).mems]
    grads = []
    for needs_grad in (False, True):
        model.zero_grad(set_to_none=True)
        feed = [m.clone().requires_grad_(needs_grad) for m in mems]
        out = model(x.flip(1), mems=feed, labels=x)
        out.losses.mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], atol=1e-6, rtol=1e-5, msg=name)
    assert grads[0]["layers.0.attn.qkv.weight"].abs().sum() > 0
