"""Contract 36: the compiled token step, ids + the draw's random numbers -> next ids.

A decoding step of ``CachedDecoder(compile=...)`` holds the draw: the step and the sampling
in one graph (``torch.compile(fullgraph=True, dynamic=False)``: a graph break is an error),
through the pruned adaptive softmax (a ``torch.cond`` per tail cluster, in the graph). The
random numbers come in as an input, drawn from the caller's generator just before the step,
so the compiled step must draw the tokens of the eager pruned step and of the reference
decoder's full-softmax draw with the same generator: greedy, top-k, top-k with top-p, top-p
alone, plain sampling; hundreds of tokens over several rows, the cache's ring wrapping many
times, no recompile, every cluster drawn from. With aot_eager (the traced graph as it is) and
inductor (generated code).
"""

from __future__ import annotations

import pytest
import torch

from conftest import spread_weights
from txlm.config import ModelConfig
from txlm.decode import CachedDecoder, UncachedDecoder
from txlm.model import TransformerXL
from txlm.sampling import SamplingConfig

CUTOFFS = [8, 24, 40]  # a shortlist of 8, tail clusters of 16, 16 and 24 tokens
_g = torch.Generator().manual_seed(0)  # 8 prompts of 1 to 11 tokens: left padding
PROMPTS = [
    torch.randint(0, 64, (int(torch.randint(1, 12, (1,), generator=_g)),), generator=_g).tolist()
    for _ in range(8)
]
CONFIGS = {
    "greedy": SamplingConfig(greedy=True),
    "top_k": SamplingConfig(top_k=5),
    "top_k_top_p": SamplingConfig(top_k=8, top_p=0.7, temperature=1.3),
    "top_p": SamplingConfig(top_k=None, top_p=0.8),  # not pruned: the full draw in the graph
    "plain": SamplingConfig(top_k=None),
}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _model() -> TransformerXL:
    config = ModelConfig.from_preset(
        "debug", vocab_size=64, cutoffs=CUTOFFS, div_val=2, tgt_len=8, mem_len=16
    )
    torch.manual_seed(1)
    model = TransformerXL(config).eval()
    spread_weights(model, 0.5)  # far from uniform: greedy reaches every cluster
    return model


def _tokens(decoder, sampling: SamplingConfig, steps: int) -> torch.Tensor:
    """[B, steps + 1] tokens drawn by the decoder, seed 3."""
    g = torch.Generator().manual_seed(3)
    tokens = decoder.prefill_tokens(PROMPTS, sampling, g)
    out = [tokens]
    for _ in range(steps):
        tokens = decoder.step_tokens(tokens, sampling, g)
        out.append(tokens)
    return torch.stack(out, dim=1)


class Recorder:
    """A torch.compile backend that keeps each traced graph and runs it as it is."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs):
        self.graphs.append(gm)
        return gm.forward

    def conds(self) -> int:
        return sum(
            n.target is torch.ops.higher_order.cond for g in self.graphs for n in g.graph.nodes
        )


def _check(backend, name: str, steps: int) -> None:
    torch._dynamo.reset()
    model = _model()
    sampling = CONFIGS[name]
    eager = CachedDecoder(model)
    compiled = CachedDecoder(model, compile=backend)
    assert compiled._prunes(sampling) == (name != "top_p") == eager._prunes(sampling)
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):  # mem_len 16: ~20 ring turns
        got = _tokens(compiled, sampling, steps)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(got, _tokens(eager, sampling, steps))  # the eager pruned draws
    assert torch.equal(got, _tokens(UncachedDecoder(model), sampling, steps))  # full softmax
    clusters = torch.bucketize(got, torch.tensor(CUTOFFS), right=True)
    assert set(clusters.flatten().tolist()) == {0, 1, 2, 3}, name  # every cluster drawn
    if isinstance(backend, Recorder):  # one cond per tail cluster, inside the one graph
        assert backend.conds() == (len(CUTOFFS) if name != "top_p" else 0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_token_step_draws_the_eager_and_full_softmax_tokens(name: str) -> None:
    _check("aot_eager", name, steps=300)


@pytest.mark.parametrize("name", ["greedy", "top_k", "plain"])
def test_the_traced_step_holds_a_cond_per_cluster(name: str) -> None:
    _check(Recorder(), name, steps=40)


@pytest.mark.parametrize("name", ["top_k", "plain"])
def test_inductor_token_step_draws_the_same_tokens(name: str) -> None:
    _check("inductor", name, steps=60)


def test_scores_step_and_token_step_share_the_cache() -> None:
    """``step`` (scores) and ``step_tokens`` are two functions over one cache: alternating
    them gives the eager decoder's log-probabilities and tokens."""
    torch._dynamo.reset()
    model = _model()
    sampling = SamplingConfig(top_k=5)
    eager, compiled = CachedDecoder(model), CachedDecoder(model, compile="aot_eager")
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = eager.prefill_tokens(PROMPTS, sampling, g1)
    b = compiled.prefill_tokens(PROMPTS, sampling, g2)
    for t in range(30):
        if t % 3 == 0:
            want, got = eager.step(a), compiled.step(b)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            a, b = want.argmax(-1), got.argmax(-1)
        a, b = eager.step_tokens(a, sampling, g1), compiled.step_tokens(b, sampling, g2)
        assert torch.equal(a, b)
