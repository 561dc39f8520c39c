"""Attention maps (Appendix D): distance bookkeeping, normalisation and the separate terms."""

from __future__ import annotations

import pytest
import torch

from txlm import ModelConfig, TransformerXL
from txlm.analysis import attention_maps as am


def test_by_distance_on_a_hand_built_tensor():
    # one head, 2 queries, 1 memory key (K = 3): query i sits at key index 1 + i
    probs = torch.tensor([[[[0.25, 0.75, 0.0], [0.5, 0.2, 0.3]]]])  # [1, 1, 2, 3]
    got = am.by_distance(probs, 4)[0, 0]
    # query 0: distance 0 -> key 1 (0.75), distance 1 -> key 0 (0.25), farther: nothing
    # query 1: distance 0 -> key 2 (0.3), 1 -> key 1 (0.2), 2 -> key 0 (0.5)
    assert torch.equal(got, torch.tensor([[0.75, 0.25, 0.0, 0.0], [0.3, 0.2, 0.5, 0.0]]))


def test_by_distance_matches_a_loop():
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(2, 3, 4, 7), -1)
    got = am.by_distance(probs, 8)
    mlen = 3
    for i in range(4):
        for d in range(8):
            j = mlen + i - d
            want = probs[..., i, j] if 0 <= j < 7 else torch.zeros(2, 3)
            assert torch.allclose(got[..., i, d], want)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TransformerXL(ModelConfig.from_preset("debug")).eval()
    for p in m.parameters():
        p.data.normal_(0.0, 0.3)
    return m


def test_every_head_average_is_a_distribution_over_the_memory_span(model):
    ids = torch.randint(0, 64, (120,))
    maps = am.attention_maps(model, ids, tgt_len=16, mem_len=32)
    n, h, d = maps.mean.shape
    assert (n, h, d) == (2, 2, 48)
    assert torch.allclose(maps.mean.sum(-1), torch.ones(n, h), atol=1e-5)
    # full memory + same_length: every query sees exactly 32 keys, distances 0..31
    assert float(maps.mean[..., 32:].abs().max()) == 0.0
    # only segments after the memory filled are averaged: segments 2..7 (the last holds 8)
    assert maps.queries == 120 - 32
    for t in "abd":
        assert torch.allclose(maps.terms[t].sum(-1), torch.ones(n, h), atol=1e-5)
    spans = maps.head_spans()
    (layer, head, dist), *_ = maps.widest_heads(4)
    assert dist == pytest.approx(float(spans.max()))
    assert maps.segment is not None and (maps.segment.layer, maps.segment.head) == (layer, head)
    assert model.config.mem_len == 16 and not model.config.same_length  # restored


def test_term_d_is_uniform_when_the_position_bias_v_is_zero(model):
    saved = model.v.data.clone()
    try:
        model.v.data.zero_()  # term (d) = v . W_kR R = 0 for every pair: a uniform softmax
        maps = am.attention_maps(model, torch.randint(0, 64, (96,)), tgt_len=16, mem_len=32)
    finally:
        model.v.data.copy_(saved)
    d = maps.terms["d"]
    assert torch.allclose(d[..., :32], torch.full_like(d[..., :32], 1 / 32), atol=1e-6)
    assert not torch.allclose(maps.terms["b"][..., :32], d[..., :32], atol=1e-3)


def test_figure6_view_of_a_chosen_head_and_position(model, tmp_path):
    ids = torch.randint(0, 64, (80,))
    maps = am.attention_maps(model, ids, tgt_len=16, mem_len=32, head=(1, 0), position=40)
    view = maps.segment
    assert (view.layer, view.head, view.segment_start, view.query) == (1, 0, 32, 8)
    assert view.probs.shape == (16, 48)
    assert torch.allclose(view.probs.sum(-1), torch.ones(16), atol=1e-5)
    for plot, name in [
        (am.plot_heads_by_distance, "f5.png"),
        (am.plot_head_segment, "f6.png"),
        (am.plot_terms, "f7.png"),
    ]:
        plot(maps, tmp_path / name)
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_one_head_at_one_position_by_distance(model):
    # Figure 6's view: weight at distance d is the row's key M + query - d, and the summary's
    # most attended distances are those weights, heaviest first.
    ids = torch.randint(0, 64, (120,))
    maps = am.attention_maps(model, ids, tgt_len=16, mem_len=32, head=(1, 0), position=70)
    seg = maps.segment
    assert seg is not None and (seg.layer, seg.head, seg.position) == (1, 0, 70)
    assert (seg.segment_start, seg.query, seg.mem_len) == (64, 6, 32)
    weights = seg.by_distance()
    assert weights.shape == (32 + 6 + 1,)
    for d in range(len(weights)):
        assert float(weights[d]) == float(seg.probs[6, 32 + 6 - d])
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-5)
    top = seg.top_distances(3)
    order = weights.argsort(descending=True)[:3].tolist()
    assert [d for d, _ in top] == order
    assert [w for _, w in top] == [float(weights[d]) for d in order]
    text = am.format_table(maps, top=3)
    line = next(x for x in text.splitlines() if x.startswith("head 1:0 at position 70"))
    assert f"{order[0]} ({float(weights[order[0]]):.4f})" in line
    fig6 = am.summary(maps, top=3)["figure6"]
    assert fig6["position"] == 70 and [t["distance"] for t in fig6["top_distances"]] == order
