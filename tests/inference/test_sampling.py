"""Sampling: top-k, top-p, temperature, greedy, seeds, and the validation of their values."""

from __future__ import annotations

import math

import pytest
import torch

from txlm.config import ModelConfig
from txlm.errors import ConfigError
from txlm.inference.generate import generate
from txlm.inference.sampling import SamplingConfig, filter_log_probs, sample
from txlm.model import TransformerXL

PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])  # order by mass: 1, 3, 2, 0
LOGP = PROBS.log()


def kept_distribution(config: SamplingConfig) -> torch.Tensor:
    return filter_log_probs(LOGP, config).softmax(-1)[0]


def test_top_k_renormalises_the_k_most_likely() -> None:
    got = kept_distribution(SamplingConfig(top_k=2))
    torch.testing.assert_close(got, torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # mass before each token in sorted order: 0, 0.5, 0.8, 0.95
    got = kept_distribution(SamplingConfig(top_k=None, top_p=0.8))
    torch.testing.assert_close(got, torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]))
    got = kept_distribution(SamplingConfig(top_k=None, top_p=0.81))
    torch.testing.assert_close(got, torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)
    got = kept_distribution(SamplingConfig(top_k=None, top_p=0.1))  # the top token always stays
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(kept_distribution(SamplingConfig(top_k=None, top_p=1.0)), PROBS[0])


def test_top_k_then_top_p() -> None:
    got = kept_distribution(SamplingConfig(top_k=3, top_p=0.9))  # top-3 mass 0.95 -> 0.5/.95..
    # after top-3 renormalisation: 0.526, 0.316, 0.158; mass before: 0, .526, .842 -> all kept
    torch.testing.assert_close(got, torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)


def test_temperature_sharpens_and_flattens() -> None:
    for t in (0.5, 2.0):
        got = kept_distribution(SamplingConfig(top_k=None, temperature=t))
        want = PROBS[0] ** (1 / t)
        torch.testing.assert_close(got, want / want.sum())


def test_sampled_tokens_never_leave_the_top_k_and_follow_it() -> None:
    torch.manual_seed(0)
    logp = torch.randn(1, 50).log_softmax(-1).expand(4000, 50)
    top = set(logp[0].topk(5).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    draws = sample(logp, SamplingConfig(top_k=5), gen)
    assert set(draws.tolist()) <= top and len(set(draws.tolist())) == 5
    # frequencies follow the renormalised top-5 (4000 draws: a few percent of noise)
    want = logp[0].exp()[sorted(top)]
    want = want / want.sum()
    freq = torch.bincount(draws, minlength=50)[sorted(top)].float() / draws.numel()
    assert (freq - want).abs().max() < 0.04


def test_greedy_is_argmax() -> None:
    logp = torch.randn(6, 30).log_softmax(-1)
    got = sample(logp, SamplingConfig(greedy=True, temperature=0.0))
    assert torch.equal(got, logp.argmax(-1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(top_k=0), "top-k"),
        (dict(top_k=-3), "top-k"),
        (dict(top_p=0.0), "top-p"),
        (dict(top_p=1.5), "top-p"),
        (dict(top_p=-0.1), "top-p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=math.nan), "temperature"),
    ],
)
def test_bad_sampling_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SamplingConfig(**kwargs)


def test_temperature_zero_is_fine_when_greedy() -> None:
    assert SamplingConfig(temperature=0.0, greedy=True).greedy


def _model() -> TransformerXL:
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig.from_preset("debug"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


def test_same_seed_same_tokens_and_cache_does_not_change_them() -> None:
    model = _model()
    [a] = generate(model, [1, 2, 3], max_new_tokens=40, seed=7)
    assert [a] == generate(model, [1, 2, 3], max_new_tokens=40, seed=7)
    assert [a] == generate(model, [1, 2, 3], max_new_tokens=40, seed=7, use_cache=False)
    assert [a] != generate(model, [1, 2, 3], max_new_tokens=40, seed=8)
    assert len(a) == 40 and all(0 <= t < 64 for t in a)


def test_shapes_of_results() -> None:
    model = _model()
    # one type whatever the prompt's shape: a list of rows, prompts x samples
    assert generate(model, [1, 2], max_new_tokens=0) == [[]]
    assert generate(model, [[1, 2], [3]], max_new_tokens=0, num_samples=2) == [[]] * 4
    [one] = generate(model, torch.tensor([1, 2]), max_new_tokens=3, seed=0)
    assert len(one) == 3
    samples = generate(model, [1, 2], max_new_tokens=4, seed=0, num_samples=3)
    assert len(samples) == 3 and all(len(s) == 4 for s in samples)
    assert len({tuple(s) for s in samples}) > 1  # independent draws
    rows = generate(model, torch.tensor([[1, 2], [3, 4]]), max_new_tokens=2, seed=0)
    assert len(rows) == 2 and all(len(r) == 2 for r in rows)
    # the same seed, the same ids; the model has no generate of its own (it does not
    # import the generation layer above it)
    assert generate(model, [1, 2], max_new_tokens=5, seed=3) == generate(
        model, [1, 2], max_new_tokens=5, seed=3
    )
    assert not hasattr(model, "generate")


def test_empty_prompt_starts_from_the_start_token() -> None:
    model = _model()
    got = generate(model, [], max_new_tokens=5, greedy=True, start_id=0)
    assert got == generate(model, [0], max_new_tokens=5, greedy=True)
    with pytest.raises(ConfigError, match="empty prompt"):
        generate(model, [], max_new_tokens=5)


def test_out_of_range_ids_are_refused() -> None:
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        generate(_model(), [1, 64], max_new_tokens=2)


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(top_k=5),
        SamplingConfig(top_k=5, temperature=0.7),
        SamplingConfig(top_k=8, top_p=0.6, temperature=1.3),
        SamplingConfig(top_k=1),
    ],
)
def test_top_k_candidates_are_the_filtered_distribution(config: SamplingConfig) -> None:
    """The fast draw over k candidates uses exactly filter_log_probs' distribution."""
    from txlm.inference.sampling import top_k_candidates

    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 3
    top = top_k_candidates(scores, config)
    assert top is not None
    probs, ids = top
    got = torch.zeros(3, 50).scatter(1, ids, probs)
    want = filter_log_probs(scores.log_softmax(-1), config).softmax(-1)
    torch.testing.assert_close(got, want)
    # logits and log-probabilities give the same candidates (only differences matter)
    probs2, ids2 = top_k_candidates(scores.log_softmax(-1), config)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(probs, probs2)


def test_top_k_keeps_exactly_k_even_on_a_tie() -> None:
    """A tie at the k-th score is broken by ``topk``'s order (deciding it on the host would
    cost a synchronisation per token); the full-vocabulary rule keeps the same k tokens."""
    from txlm.inference.sampling import top_k_candidates

    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])  # top-2: 3 and a tie at 2
    config = SamplingConfig(top_k=2)
    _, ids = top_k_candidates(scores, config)
    assert ids[0, 0] == 0 and ids[0, 1].item() in (2, 3)
    full = filter_log_probs(scores, config)
    assert torch.isfinite(full).sum() == 2 and torch.isfinite(full[0, ids[0]]).all()
    draws = sample(scores.expand(2000, 5), config, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, ids[0, 1].item()}


def test_the_draw_is_multinomials_for_the_same_generator_state() -> None:
    """The top-k draw (a race over an exponential per candidate) skips torch.multinomial's
    input checks but not its arithmetic."""
    from txlm.inference.sampling import race

    probs = torch.randn(4, 40, generator=torch.Generator().manual_seed(5)).softmax(-1)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for _ in range(50):
        noise = torch.empty_like(probs).exponential_(generator=g1)
        assert torch.equal(race(probs, noise), torch.multinomial(probs, 1, generator=g2))
