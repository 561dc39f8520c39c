"""The fused adaptive-softmax training loss computes what the plain composition computes.

The reference is the loss written out with autograd's own operations: the head's
log-softmax over shortlist + cluster logits, each tail cluster's log-softmax on its tokens
(chosen with ``nonzero``), added in input order. In float64, on Zipfian labels that hit
every cluster (and some ignored ones): the same per-token losses and the same gradients
for every parameter and for the hidden states, with the buckets sized by the counts or
holding every token. Compiled, the loss and its backward are one graph with no break.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from txlm.config import ModelConfig
from txlm.model import TransformerXL
from txlm.model.adaptive import AdaptiveLogSoftmax


def reference_nll(sm: AdaptiveLogSoftmax, hidden, target, ignore_index=-100):
    """Per-token NLL by plain autograd operations (slices, ``nonzero``, ``index_add``)."""
    ignore = target == ignore_index
    target = target.masked_fill(ignore, 0)

    def logits(h, i):
        proj = sm.projs[i] if len(sm.projs) else None
        if sm.div_val == 1:
            lo, hi = sm.bounds[i]
            w, b = sm.layers[0].weight[lo:hi], sm.layers[0].bias[lo:hi]
        else:
            w, b = sm.layers[i].weight, sm.layers[i].bias
        if i == 0 and sm.n_clusters:
            w, b = torch.cat([w, sm.cluster_weight]), torch.cat([b, sm.cluster_bias])
        return F.linear(h if proj is None else h @ proj, w, b)

    head = F.log_softmax(logits(hidden, 0), -1)
    if not sm.n_clusters:
        return (-head.gather(1, target[:, None]).squeeze(1)).masked_fill(ignore, 0.0)
    cluster = torch.bucketize(target, torch.tensor(sm.cutoffs), right=True)
    head_col = torch.where(cluster == 0, target, sm.shortlist + cluster - 1)
    nll = -head.gather(1, head_col[:, None]).squeeze(1)
    for i in range(1, sm.n_clusters + 1):
        idx = ((cluster == i) & ~ignore).nonzero().squeeze(1)
        tail = F.log_softmax(logits(hidden.index_select(0, idx), i), -1)
        picked = tail.gather(1, (target[idx] - sm.bounds[i][0])[:, None]).squeeze(1)
        nll = nll.index_add(0, idx, -picked)
    return nll.masked_fill(ignore, 0.0)


def zipf_labels(n: int, vocab: int, seed: int, cutoffs: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    labels = torch.multinomial(weights, n, replacement=True, generator=g)
    # every tail cluster hit at least twice, some tokens ignored
    for i, lo in enumerate(cutoffs):
        labels[2 * i : 2 * i + 2] = lo + i
    labels[-3:] = -100
    return labels[torch.randperm(n, generator=g)]


CASES = {
    "div1": dict(cutoffs=[10, 30, 60], div_val=1),
    "div4": dict(cutoffs=[10, 30, 60], div_val=4, d_embed=64),
    "div2+proj": dict(cutoffs=[20, 50], div_val=2, d_embed=48),
    "div1+proj": dict(cutoffs=[20], div_val=1, d_embed=24),
    "full": dict(cutoffs=[]),
}


def build(overrides) -> TransformerXL:
    config = ModelConfig.from_preset("debug", vocab_size=100, d_model=32, **overrides)
    torch.manual_seed(0)
    model = TransformerXL(config).double()
    with torch.no_grad():  # non-zero biases and projections: every term matters
        for name, p in model.named_parameters():
            if "softmax" in name or "embed" in name:
                p.normal_(0, 0.5)
    return model


# the tail buckets' sizes: the clusters' counts (None), every token (150 = N), 48 each
@pytest.mark.parametrize("bucket", [None, 150, 48], ids=["counted", "all", "k"])
@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_fused_loss_equals_the_reference_losses_and_gradients(overrides, bucket) -> None:
    model = build(overrides)
    sm = model.softmax
    sizes = None if bucket is None else [bucket] * sm.n_clusters
    n = 150
    hidden = torch.randn(n, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    labels = zipf_labels(n, 100, 4, sm.cutoffs)
    g = torch.rand(n, dtype=torch.float64)  # per-token upstream weights: not just a mean
    results = []
    for fn in (reference_nll, functools.partial(AdaptiveLogSoftmax.nll, sizes=sizes)):
        model.zero_grad()
        h = hidden.clone().requires_grad_()
        nll = fn(sm, h, labels)
        (nll * g).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((nll.detach(), h.grad, grads))
    (ref, ref_h, ref_g), (got, got_h, got_g) = results
    assert (got[labels == -100] == 0).all()
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(got_h, ref_h, atol=1e-12, rtol=0)
    assert got_g.keys() == ref_g.keys()
    for k in ref_g:
        torch.testing.assert_close(got_g[k], ref_g[k], atol=1e-12, rtol=0, msg=k)


def test_a_full_bucket_gives_nan_never_a_wrong_loss() -> None:
    """Buckets of k tokens, k below a cluster's count: that cluster's extra tokens get NaN,
    every other token its exact loss."""
    model = build(CASES["div1"])
    hidden = torch.randn(150, 32, dtype=torch.float64)
    labels = zipf_labels(150, 100, 4, model.softmax.cutoffs)
    want = reference_nll(model.softmax, hidden, labels)
    got = model.softmax.nll(hidden, labels, sizes=[4, 4, 4])
    cluster = torch.bucketize(labels.clamp(min=0), torch.tensor([10, 30, 60]), right=True)
    over = torch.zeros(150, dtype=torch.bool)
    for i in (1, 2, 3):
        members = (cluster == i) & (labels != -100)
        assert members.sum() > 4
        over |= members & (members.cumsum(0) > 4)
    assert got[over].isnan().all()
    torch.testing.assert_close(got[~over], want[~over], atol=1e-12, rtol=0)


def test_chunked_loss_equals_one_chunk(monkeypatch) -> None:
    """Chunks over the tokens (as for a large head in half precision) change nothing."""
    from txlm.model import adaptive

    model = build(CASES["div1"])
    hidden = torch.randn(97, 32, dtype=torch.float64, requires_grad=True)
    labels = zipf_labels(97, 100, 5, model.softmax.cutoffs)
    outs = []
    for elements in (1 << 24, 7 * 13):  # one chunk; chunks of a few rows
        monkeypatch.setattr(adaptive, "CHUNK_ELEMENTS", elements)
        hidden.grad = None
        nll = model.softmax.nll(hidden, labels)
        nll.sum().backward()
        outs.append((nll.detach(), hidden.grad.clone()))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-12, rtol=0)


def test_compiled_adaptive_training_step_is_one_graph_without_breaks() -> None:
    """A training forward + backward of a model with tail clusters, compiled: torch._dynamo
    reports one graph and no graph break (no data-dependent cluster selection)."""
    import torch._dynamo

    # one layer: the softmax is what is traced here
    config = ModelConfig.from_preset("debug", vocab_size=100, cutoffs=[10, 30, 60], div_val=2,
                                     d_embed=32, n_layer=1)  # fmt: skip
    torch.manual_seed(0)
    model = TransformerXL(config)
    ids = torch.randint(0, 100, (2, 16))
    labels = zipf_labels(32, 100, 6, config.cutoffs).view(2, 16)

    def loss(i, y):  # buckets of every token (32): static shapes
        return model(i, labels=y, bucket_sizes=[32, 32, 32]).loss

    torch._dynamo.reset()
    explain = torch._dynamo.explain(loss)(ids, labels)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    # the traced loss and its AOT-traced backward equal the eager ones (aot_eager: the graphs
    # inductor is handed, run as they are; inductor's code for them is inductor's to prove)
    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        value = fn(ids, labels)
        value.backward()
        grads.append([value.detach()] + [p.grad.clone() for p in model.parameters()])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
