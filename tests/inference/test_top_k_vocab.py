"""top-k with k equal to or above the vocabulary size cuts nothing: one token per row, the
token plain sampling (no top-k) draws from the same generator state, through
``txlm.inference.sampling.sample``, the pruned adaptive softmax (``clusters_needed``) and the
decoder
(``txlm.generate``, eager and compiled)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import spread_weights
from txlm.config import ModelConfig
from txlm.inference.generate import generate
from txlm.inference.sampling import SamplingConfig, clusters_needed, draw_noise, noise_shape, sample
from txlm.model import TransformerXL

V = 64
KS = [V, V + 1, 1000]
PLAIN = SamplingConfig(top_k=None)


def _model(**overrides) -> TransformerXL:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("debug", vocab_size=V, tgt_len=8, mem_len=16, **overrides)
    return spread_weights(TransformerXL(config).eval(), 0.2)  # far from uniform, not one-hot


@pytest.mark.parametrize("k", KS)
def test_sample_with_k_at_or_above_the_vocabulary_draws_as_without_top_k(k: int) -> None:
    config = SamplingConfig(top_k=k)
    assert noise_shape(config, 6, V) == noise_shape(PLAIN, 6, V)  # the same random numbers
    scores = torch.randn(6, V, generator=torch.Generator().manual_seed(1)) * 2
    g1, g2 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    draws = []
    for _ in range(50):
        got = sample(scores, config, g1)
        assert got.shape == (6,) and got.dtype == torch.long
        assert torch.equal(got, sample(scores, PLAIN, g2))
        draws.append(got)
    assert torch.equal(g1.get_state(), g2.get_state())  # and as many of them
    assert len(set(torch.cat(draws).tolist())) > 12  # really sampled, not one argmax


@pytest.mark.parametrize("k", KS)
def test_the_adaptive_softmax_draws_as_without_top_k(k: int) -> None:
    """k above the shortlist: the draw is from the whole distribution, as plain sampling's
    (pruned there), the same token per row."""
    softmax = _model(cutoffs=[8, 24, 40], div_val=2).softmax
    hidden = torch.randn(40, 32, generator=torch.Generator().manual_seed(3)) * 1.5
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)

    def draw(h, config, g):
        noise = draw_noise(config, h.size(0), V, g)
        need = clusters_needed(config, softmax.shortlist, noise)
        assert (need is None) == (config != PLAIN)
        return sample(softmax.log_prob(h, need), config, noise=noise)

    with torch.no_grad():
        for h in hidden.split(4):
            got = draw(h, SamplingConfig(top_k=k), g1)
            assert got.shape == (4,)
            assert torch.equal(got, draw(h, PLAIN, g2))


@pytest.mark.parametrize("overrides", [{}, dict(cutoffs=[8, 24, 40], div_val=2)],
                         ids=["full", "adaptive"])  # fmt: skip
def test_generation_with_k_at_or_above_the_vocabulary_is_plain_sampling(overrides) -> None:
    model = _model(**overrides)
    prompts = [[1, 2, 3], [7], [5, 9, 11, 13, 2]]
    want = generate(model, prompts, max_new_tokens=40, sampling=PLAIN, seed=5)
    assert [len(row) for row in want] == [40] * 3
    assert len({t for row in want for t in row}) > 12  # really sampled
    for k in KS:
        got = generate(model, prompts, max_new_tokens=40, sampling=SamplingConfig(top_k=k),
                       seed=5)  # fmt: skip
        assert got == want, k


def test_compiled_generation_with_k_equal_to_the_vocabulary_is_plain_sampling(
    fresh_dynamo,
) -> None:
    """The compiled decoding step holds its draw's random numbers as an input: the same
    numbers, so the same tokens, as plain sampling."""
    model = _model(cutoffs=[8, 24, 40], div_val=2)
    prompts = [[1, 2, 3], [7]]
    kw = dict(max_new_tokens=20, seed=6, compile="aot_eager")
    want = generate(model, prompts, sampling=PLAIN, **kw)
    got = generate(model, prompts, sampling=SamplingConfig(top_k=V), **kw)
    assert [len(row) for row in got] == [20, 20] and got == want
