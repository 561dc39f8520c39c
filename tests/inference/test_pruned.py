"""The pruned adaptive softmax draws the tokens the full softmax draws.

For greedy, top-k (with and without top-p, at several temperatures) and plain sampling, the
same generator state must give the same token whether the next-token distribution is built
over the whole vocabulary (``sample(softmax.log_prob(h))``) or only over the clusters that can
hold the draw (``softmax.log_prob(h, need)``, ``need`` from
txlm.inference.sampling.clusters_needed):
thousands of draws, in small batches so that clusters are really skipped, every cluster drawn
from.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import spread_weights
from txlm.config import ModelConfig
from txlm.inference.sampling import SamplingConfig, clusters_needed, draw_noise, sample
from txlm.model import TransformerXL
from txlm.model.adaptive import AdaptiveLogSoftmax

CUTOFFS = [8, 24, 40]  # a shortlist of 8 and three tail clusters of 16, 16 and 24 tokens
BOUNDS = list(zip([0, *CUTOFFS], [*CUTOFFS, 64], strict=True))


def _softmax() -> tuple[AdaptiveLogSoftmax, int]:
    config = ModelConfig.from_preset(
        "debug", vocab_size=64, cutoffs=CUTOFFS, div_val=2, d_model=32, d_embed=32
    )
    torch.manual_seed(0)
    model = TransformerXL(config).eval()
    with torch.no_grad():  # weights large enough that distributions are far from uniform
        for p in model.softmax.parameters():
            p.normal_(0.0, 0.6)
    return model.softmax, config.d_model


def _cluster_of(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(tokens, torch.tensor(CUTOFFS), right=True)


def _pruned_draw(softmax, h, config, generator, branch="host"):
    """(the tokens, the pruned log-probs) of one draw, its random numbers from ``generator``."""
    noise = draw_noise(config, h.size(0), softmax.vocab_size, generator)
    need = clusters_needed(config, softmax.shortlist, noise)
    log_probs = softmax.log_prob(h, need, branch=branch)
    return sample(log_probs, config, noise=noise), log_probs


def _computed(log_probs: torch.Tensor) -> list[bool]:
    """Per tail cluster, whether it was computed: a skipped one holds one value (its mass
    spread evenly), a computed one its tokens' own log-probabilities."""
    return [bool((log_probs[:, lo:hi] != log_probs[:, lo : lo + 1]).any()) for lo, hi in BOUNDS[1:]]


CONFIGS = {
    "greedy": SamplingConfig(greedy=True),
    "top_k": SamplingConfig(top_k=5),
    "top_k_cold": SamplingConfig(top_k=3, temperature=0.6),
    "top_k_top_p": SamplingConfig(top_k=8, top_p=0.7, temperature=1.3),
    "plain": SamplingConfig(top_k=None),
    # the controls: bans in the shortlist (the k-th best, the argmax and the CDF taken
    # without them) and in the tail, min-p alone and under top-p at a temperature
    "greedy_ban": SamplingConfig(greedy=True, ban=(0, 3, 30)),
    "top_k_ban": SamplingConfig(top_k=4, ban=(1, 2, 5, 50)),
    "plain_ban": SamplingConfig(top_k=None, ban=(0, 4, 6)),
    "min_p": SamplingConfig(top_k=None, min_p=0.02),
    "min_p_hot": SamplingConfig(top_k=None, min_p=0.05, temperature=1.5),
    "min_p_top_p": SamplingConfig(top_k=None, min_p=0.05, top_p=0.9),
    "min_p_ban": SamplingConfig(top_k=None, min_p=0.02, ban=(2, 7, 33)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pruned_draws_equal_the_full_softmax_draws(name: str) -> None:
    softmax, dim = _softmax()
    config = CONFIGS[name]
    assert clusters_needed(config, softmax.shortlist, torch.zeros(1, 1)) is not None
    computed = [0] * len(CUTOFFS)  # batches that computed cluster i
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3000, dim, generator=g) * 1.5
    full_gen, pruned_gen = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    full, pruned = [], []
    batches = hidden.split(3)
    with torch.no_grad():
        for h in batches:
            full.append(sample(softmax.log_prob(h), config, full_gen))
            tokens, log_probs = _pruned_draw(softmax, h, config, pruned_gen)
            pruned.append(tokens)
            computed = [n + c for n, c in zip(computed, _computed(log_probs), strict=True)]
            # a skipped cluster keeps its share of the distribution
            mass = log_probs.exp().sum(-1)
            torch.testing.assert_close(mass, torch.ones_like(mass), atol=1e-5, rtol=0)
    full, pruned = torch.cat(full), torch.cat(pruned)
    assert torch.equal(pruned, full)
    assert not set(full.tolist()) & set(config.ban)
    assert set(_cluster_of(full).tolist()) == {0, 1, 2, 3}  # every cluster drawn from
    # clusters really are skipped, and each is still computed where it may hold the draw
    assert all(0 < n < len(batches) for n in computed), computed
    if name == "greedy":
        assert max(computed) < len(batches) / 2


@pytest.mark.parametrize("rows", [1, 6])
def test_branch_free_draws_are_the_same_and_compile_to_one_graph(rows: int) -> None:
    """Without a host branch each cluster is chosen on the device (for one row, a cluster no
    row needs reads one row of its weight): the same tokens, and a compiled greedy draw
    traces into one graph (no break)."""
    softmax, dim = _softmax()
    hidden = torch.randn(60, dim, generator=torch.Generator().manual_seed(3)) * 1.5
    config = SamplingConfig(top_k=4)
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    greedy = SamplingConfig(greedy=True)
    need = clusters_needed(greedy, softmax.shortlist, None)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda h: sample(softmax.log_prob(h, need, branch="none"), greedy),
        fullgraph=True, backend="aot_eager",
    )  # fmt: skip
    with torch.no_grad():
        for h in hidden.split(rows):
            want, _ = _pruned_draw(softmax, h, config, g1)
            assert torch.equal(_pruned_draw(softmax, h, config, g2, branch="none")[0], want)
            assert torch.equal(compiled(h), sample(softmax.log_prob(h), greedy))


@pytest.mark.parametrize("rows", [1, 6])
def test_a_branch_in_the_graph_skips_what_the_host_branch_skips(rows: int, fresh_dynamo) -> None:
    """A branch in the traced graph (``torch.cond``, what a compiled step on a CPU takes): one
    graph with one conditional per tail cluster, the host branch's log-probabilities
    (skipped clusters spread, the others computed) and tokens."""
    softmax, dim = _softmax()
    hidden = torch.randn(60, dim, generator=torch.Generator().manual_seed(3)) * 1.5
    greedy = SamplingConfig(greedy=True)
    need = clusters_needed(greedy, softmax.shortlist, None)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(
        lambda h: softmax.log_prob(h, need, branch="graph"), fullgraph=True, backend=keep
    )
    skipped = 0
    with torch.no_grad():
        for h in hidden.split(rows):
            want = softmax.log_prob(h, need, branch="host")
            got = compiled(h)
            # (one row's branch sums its products in another order than the library's)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            assert _computed(got) == _computed(want)
            skipped += _computed(want).count(False)
            assert torch.equal(sample(got, greedy), sample(softmax.log_prob(h), greedy))
    assert len(graphs) == 1 and skipped > 0
    conds = [n for n in graphs[0].graph.nodes if n.target is torch.ops.higher_order.cond]
    assert len(conds) == softmax.n_clusters


def test_settings_it_cannot_prune_draw_from_the_full_distribution() -> None:
    softmax, _ = _softmax()
    noise = torch.rand(1, 1)
    for config in (SamplingConfig(top_k=None, top_p=0.8), SamplingConfig(top_k=None,
                   temperature=0.7), SamplingConfig(top_k=20),  # (20 > the shortlist)
                   SamplingConfig(top_k=None, ban=(2, 30)),  # a tail ban moves the CDF
                   # tempered, a skipped cluster's spread mass is not its own: top-p moves
                   SamplingConfig(top_k=None, min_p=0.05, top_p=0.9, temperature=1.5),
                   SamplingConfig(greedy=True, repetition_penalty=1.2)):  # fmt: skip
        assert clusters_needed(config, softmax.shortlist, noise) is None


def test_generation_of_an_adaptive_model_draws_through_the_pruned_head(monkeypatch) -> None:
    """``txlm.generate`` on a CPU decodes an adaptive model through the pruned softmax: the same
    tokens as the reference decoder, which draws from the full distribution."""
    from txlm.inference import decode
    from txlm.inference.generate import generate

    config = ModelConfig.from_preset(
        "debug", vocab_size=64, cutoffs=CUTOFFS, div_val=2, tgt_len=8, mem_len=16
    )
    torch.manual_seed(1)
    model = TransformerXL(config).eval()
    spread_weights(model, 0.3)
    calls = []
    rule = decode.clusters_needed
    monkeypatch.setattr(decode, "clusters_needed", lambda *a: calls.append(1) or rule(*a))
    prompts = [[1, 2, 3, 4, 5], [9, 30, 50]]
    for kw in (dict(greedy=True), dict(top_k=5), dict(top_k=None)):
        calls.clear()
        got = generate(model, prompts, max_new_tokens=40, seed=3, **kw)
        assert len(calls) == 40
        assert got == generate(model, prompts, max_new_tokens=40, seed=3, use_cache=False, **kw)
