"""The generation controls (repetition penalty, min-p, banned tokens, temperature 0) against a
brute-force reference.

The reference recomputes every next-token distribution with the model's plain forward over
the whole context (no memory, no cache, the full adaptive softmax), applies each control by
hand in plain torch (one row at a time, the penalty token by token), and draws with the same
mechanism from a generator in the same state (an exponential race over the top-k candidates,
else the inverse CDF at one uniform), row r from its own generator seeded seed + r. The
ids of ``txlm.generate`` (cached, pruned adaptive softmax, batches, samples) must equal its.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.helpers.models import spread_weights
from txlm.config import ModelConfig
from txlm.inference.generate import generate
from txlm.inference.sampling import SamplingConfig, clusters_needed
from txlm.model import TransformerXL

CUTOFFS = [8, 24, 40]  # an adaptive softmax: a shortlist of 8, three tail clusters
PROMPTS = [[1, 2, 3, 9, 30, 11], [50, 7, 6]]  # (lengths not 1 mod tgt_len: see the report)
NEW = 10


@pytest.fixture(scope="module")
def model() -> TransformerXL:
    # the memory holds every context here (prompt + new tokens < mem_len), so the cached
    # decoder computes what one forward over the whole context does
    config = ModelConfig.from_preset(
        "debug", vocab_size=64, cutoffs=CUTOFFS, div_val=2, tgt_len=4, mem_len=40
    )
    torch.manual_seed(1)
    return spread_weights(TransformerXL(config).eval(), 0.3)


def reference_scores(log_probs: torch.Tensor, config: SamplingConfig, present: list[int]):
    """One row's log-probabilities [V] -> its sampling scores [V] (-inf: excluded), by hand."""
    s = log_probs.clone().double()
    r = config.repetition_penalty
    for tok in set(present):  # CTRL: divide a positive score, multiply a negative one
        s[tok] = s[tok] / r if s[tok] > 0 else s[tok] * r
    for tok in config.ban:
        s[tok] = -math.inf
    if config.greedy:
        return s
    s = s / config.temperature
    order = s.argsort(descending=True)
    keep = torch.zeros_like(s, dtype=torch.bool)
    k = config.top_k or len(s)
    kept = order[:k]
    if config.top_p is not None:
        p = (s[kept] - s[kept].logsumexp(0)).exp()
        mass_before = torch.cat([p.new_zeros(1), p.cumsum(0)[:-1]])
        kept = kept[mass_before < config.top_p]
    if config.min_p:
        best = s[order[0]]
        kept = kept[(s[kept] - best).exp() >= config.min_p]
    keep[kept] = True
    return s.masked_fill(~keep, -math.inf)


def reference_draw(scores: torch.Tensor, config: SamplingConfig, g: torch.Generator) -> int:
    if config.greedy:
        return int(scores.argmax())
    if config.top_k is not None and config.top_k < len(scores):
        ids = scores.argsort(descending=True)[: config.top_k]
        p = scores[ids].softmax(0)
        e = torch.empty(1, config.top_k).exponential_(generator=g)[0]
        return int(ids[(p / e).argmax()])
    u = torch.empty(1, 1).uniform_(generator=g)[0, 0].item()
    cdf = scores.softmax(0).cumsum(0)
    return min(int((cdf <= u).sum()), len(scores) - 1)


def reference_generate(model, prompts, config, seed, num_samples, new=NEW):
    rows = [list(p) for p in prompts for _ in range(num_samples)]
    rows = [(r, seed + i) for i, r in enumerate(rows)]  # row i's own generator, seed + i
    out = []
    for prompt, row_seed in rows:
        g = torch.Generator().manual_seed(row_seed)
        ids = list(prompt)
        for _ in range(new):
            with torch.no_grad():
                logp = model(torch.tensor([ids])).log_probs[0, -1]
            ids.append(reference_draw(reference_scores(logp, config, ids), config, g))
        out.append(ids[len(prompt) :])
    return out


CONFIGS = {
    "penalty_top_k": SamplingConfig(repetition_penalty=1.6, top_k=5),
    "penalty_below_one_plain": SamplingConfig(repetition_penalty=0.6, top_k=None),
    "penalty_greedy": SamplingConfig(repetition_penalty=2.0, greedy=True),
    "min_p_plain": SamplingConfig(top_k=None, min_p=0.05),
    "min_p_top_p_hot": SamplingConfig(top_k=None, min_p=0.1, top_p=0.9, temperature=1.4),
    "min_p_top_k": SamplingConfig(top_k=6, min_p=0.2),
    "ban_top_k": SamplingConfig(top_k=4, ban=(0, 6, 27)),
    "ban_shortlist_plain": SamplingConfig(top_k=None, ban=(0, 5)),
    "ban_tail_plain": SamplingConfig(top_k=None, ban=(5, 48, 59)),
    "ban_greedy": SamplingConfig(greedy=True, ban=(6, 14)),
    "temperature_zero": SamplingConfig(temperature=0.0, ban=(0,)),
    "all": SamplingConfig(
        top_k=10, top_p=0.95, min_p=0.02, temperature=0.9, repetition_penalty=1.3, ban=(5, 23)
    ),
}
# which of them the adaptive softmax still prunes (the others draw from the full softmax)
PRUNED = {"min_p_plain", "min_p_top_k", "ban_top_k", "ban_shortlist_plain",
          "ban_greedy", "temperature_zero"}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_controls_draw_the_brute_force_references_tokens(model, name: str) -> None:
    config = CONFIGS[name]
    assert (clusters_needed(config, 8, torch.rand(1, 1)) is not None) == (name in PRUNED)
    want = reference_generate(model, PROMPTS, config, seed=5, num_samples=2)
    got = generate(model, PROMPTS, max_new_tokens=NEW, sampling=config, seed=5, num_samples=2)
    assert got == want
    assert not {t for row in got for t in row} & set(config.ban)
    if config.ban:  # the bans take tokens the same draws would take without them
        free = generate(model, PROMPTS, max_new_tokens=NEW, sampling=replace(config, ban=()),
                        seed=5, num_samples=2)  # fmt: skip
        assert {t for row in free for t in row} & set(config.ban)


@pytest.mark.parametrize("name", ["penalty_top_k", "ban_tail_plain", "all"])
def test_controls_without_a_cache_draw_the_same(model, name: str) -> None:
    config = CONFIGS[name]
    kw = dict(max_new_tokens=NEW, sampling=config, seed=5, num_samples=2)
    assert generate(model, PROMPTS, use_cache=False, **kw) == generate(model, PROMPTS, **kw)


def test_a_repetition_penalty_changes_the_draws_and_counts_the_prompt(model) -> None:
    greedy = generate(model, PROMPTS, max_new_tokens=NEW, greedy=True)
    penalised = generate(model, PROMPTS, max_new_tokens=NEW, greedy=True, repetition_penalty=3.0)
    assert greedy != penalised

    # a strong penalty: repeats are rarer than without it
    def repeats(rows):
        return sum(len(r) - len(set(r)) for r in rows)

    assert repeats(penalised) < repeats(greedy)


def test_temperature_zero_is_greedy(model) -> None:
    greedy = generate(model, PROMPTS, max_new_tokens=NEW, greedy=True, seed=1)
    assert generate(model, PROMPTS, max_new_tokens=NEW, temperature=0, seed=2) == greedy
    assert SamplingConfig(temperature=0).greedy


def test_each_row_is_drawn_again_alone_from_its_own_seed(model) -> None:
    rows = generate(model, PROMPTS, max_new_tokens=NEW, seed=11, num_samples=3, top_k=None)
    assert len({tuple(r) for r in rows}) == 6
    for i, prompt in enumerate(PROMPTS):
        for j in range(3):
            alone = generate(model, prompt, max_new_tokens=NEW, seed=11 + 3 * i + j, top_k=None)
            assert alone == [rows[3 * i + j]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(min_p=1.5), "min-p"),
        (dict(min_p=-0.1), "min-p"),
        (dict(repetition_penalty=0.0), "repetition penalty"),
        (dict(repetition_penalty=math.inf), "repetition penalty"),
        (dict(ban=(-1,)), "banned"),
        (dict(ban=(64,)), "outside the vocabulary"),
        (dict(ban=tuple(range(64))), "every token"),
        (dict(ban=("<unk>",)), "needs the vocabulary"),
        (dict(stop=("\n",)), "vocabulary"),
        (dict(stop=("",)), "stop strings"),
    ],
)
def test_bad_control_values_are_refused(model, kwargs: dict, message: str) -> None:
    from txlm.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        generate(model, PROMPTS, max_new_tokens=2, **kwargs)


def test_sample_each_draws_every_row_as_it_would_alone() -> None:
    """A server's batch: each row its own settings and generator; the same ids as drawing
    each row alone."""
    from txlm.inference.sampling import sample, sample_each, seen_tokens

    logp = (torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 3).log_softmax(-1)
    configs = [CONFIGS[n] for n in ("penalty_top_k", "min_p_plain", "penalty_top_k",
                                    "ban_greedy", "all", "min_p_plain")]  # fmt: skip
    seen = seen_tokens([[1, 2], [3], [4, 5, 6], [7], [8, 9], []], 64)
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed * 10 + b) for b in range(6)]
        got = sample_each(logp, configs, gens, seen=seen)
        for b in range(6):
            g = torch.Generator().manual_seed(seed * 10 + b)
            alone = sample(logp[b : b + 1], configs[b], g, seen=seen[b : b + 1])
            assert int(got[b]) == int(alone[0])
