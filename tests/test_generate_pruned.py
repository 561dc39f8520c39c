"""The pruned adaptive softmax draws the tokens the full softmax draws (txlm.head).

For greedy, top-k (with and without top-p, at several temperatures) and plain sampling, the
same generator state must give the same token whether the next-token distribution is built
over the whole vocabulary (``sample(head.scores(h))``) or only over the clusters that can
hold the draw (``head.select``): thousands of draws, in small batches so that clusters are
really skipped, every cluster drawn from.
"""

from __future__ import annotations

import pytest
import torch

from conftest import spread_weights
from txlm.config import ModelConfig
from txlm.head import DecodingHead
from txlm.model import TransformerXL
from txlm.sampling import SamplingConfig, sample

CUTOFFS = [8, 24, 40]  # a shortlist of 8 and three tail clusters of 16, 16 and 24 tokens


def _head() -> tuple[DecodingHead, int]:
    config = ModelConfig.from_preset(
        "debug", vocab_size=64, cutoffs=CUTOFFS, div_val=2, d_model=32, d_embed=32
    )
    torch.manual_seed(0)
    model = TransformerXL(config).eval()
    with torch.no_grad():  # weights large enough that distributions are far from uniform
        for p in model.softmax.parameters():
            p.normal_(0.0, 0.6)
    return DecodingHead(model.softmax, torch.float32), config.d_model


def _cluster_of(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(tokens, torch.tensor(CUTOFFS), right=True)


CONFIGS = {
    "greedy": SamplingConfig(greedy=True),
    "top_k": SamplingConfig(top_k=5),
    "top_k_cold": SamplingConfig(top_k=3, temperature=0.6),
    "top_k_top_p": SamplingConfig(top_k=8, top_p=0.7, temperature=1.3),
    "plain": SamplingConfig(top_k=None),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pruned_draws_equal_the_full_softmax_draws(name: str, monkeypatch) -> None:
    head, dim = _head()
    config = CONFIGS[name]
    assert head.prunes(config)
    computed = {i: 0 for i in range(1, len(CUTOFFS) + 1)}  # batches that computed cluster i
    logits = head.logits

    def counted(i: int, hidden: torch.Tensor, needed: torch.Tensor | None = None) -> torch.Tensor:
        if i > 0:
            computed[i] += 1
        return logits(i, hidden, needed)

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3000, dim, generator=g) * 1.5
    full_gen, pruned_gen = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    full, pruned = [], []
    batches = hidden.split(3)
    for h in batches:
        full.append(sample(head.scores(h), config, full_gen))
        monkeypatch.setattr(head, "logits", counted)
        pruned.append(head.select(h, config, pruned_gen))
        monkeypatch.setattr(head, "logits", logits)
    full, pruned = torch.cat(full), torch.cat(pruned)
    assert torch.equal(pruned, full)
    assert set(_cluster_of(full).tolist()) == {0, 1, 2, 3}  # every cluster drawn from
    # clusters really are skipped, and each is still computed where it may hold the draw
    assert all(0 < n < len(batches) for n in computed.values()), computed
    if name == "greedy":
        assert max(computed.values()) < len(batches) / 2


@pytest.mark.parametrize("rows", [1, 6])
def test_branch_free_draws_are_the_same_and_compile_to_one_graph(rows: int) -> None:
    """Without a host branch each cluster is chosen on the device (for one row, a cluster no
    row needs reads one column of its weight): the same tokens, and a compiled greedy draw
    traces into one graph (no break)."""
    head, dim = _head()
    hidden = torch.randn(60, dim, generator=torch.Generator().manual_seed(3)) * 1.5
    config = SamplingConfig(top_k=4)
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    for h in hidden.split(rows):
        want = head.select(h, config, g1)
        assert torch.equal(head.select(h, config, g2, host_branch=False), want)
    greedy = SamplingConfig(greedy=True)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda h: head.select(h, greedy, host_branch=False), fullgraph=True, backend="aot_eager"
    )
    for h in hidden.split(rows):
        assert torch.equal(compiled(h), sample(head.scores(h), greedy))


def test_settings_it_cannot_prune_draw_from_the_full_distribution() -> None:
    head, dim = _head()
    hidden = torch.randn(50, dim, generator=torch.Generator().manual_seed(5))
    for config in (SamplingConfig(top_k=None, top_p=0.8), SamplingConfig(top_k=None,
                   temperature=0.7), SamplingConfig(top_k=20)):  # fmt: skip
        assert not head.prunes(config)  # (top-k 20 > the shortlist of 8)
        g1, g2 = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
        assert torch.equal(head.select(hidden, config, g1), sample(head.scores(hidden), config, g2))


def test_generation_of_an_adaptive_model_draws_through_the_pruned_head(monkeypatch) -> None:
    """``txlm.generate`` on a CPU decodes an adaptive model through ``select``: the same
    tokens as the reference decoder, which draws from the full distribution."""
    from txlm.generate import generate

    config = ModelConfig.from_preset(
        "debug", vocab_size=64, cutoffs=CUTOFFS, div_val=2, tgt_len=8, mem_len=16
    )
    torch.manual_seed(1)
    model = TransformerXL(config).eval()
    spread_weights(model, 0.3)
    calls = []
    select = DecodingHead.select
    monkeypatch.setattr(DecodingHead, "select", lambda *a, **k: calls.append(1) or select(*a, **k))
    prompts = [[1, 2, 3, 4, 5], [9, 30, 50]]
    for kw in (dict(greedy=True), dict(top_k=5), dict(top_k=None)):
        calls.clear()
        got = generate(model, prompts, max_new_tokens=40, seed=3, **kw)
        assert len(calls) == 40
        assert got == generate(model, prompts, max_new_tokens=40, seed=3, use_cache=False, **kw)
