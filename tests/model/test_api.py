"""The public model API: keyword-only arguments, ``loss`` / ``losses``, lengths as an
argument of the call (``Lengths``; ``model.lengths`` the built ones), a configuration fixed
at construction (ARCHITECTURE.md, C12)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from txlm.config import ModelConfig
from txlm.errors import ConfigError
from txlm.model import TransformerXL
from txlm.model.attention import RelativeAttention
from txlm.model.dropout import Dropout
from txlm.model.lengths import Lengths


def _model(**overrides) -> TransformerXL:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=40, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=64,
        tgt_len=8, mem_len=8, dropout=0.0,
    ).replace(**overrides)  # fmt: skip
    return TransformerXL(config).eval()


def test_arguments_after_mems_are_keyword_only():
    model = _model()
    x = torch.randint(0, 40, (2, 8))
    with pytest.raises(TypeError):
        model(x, None, x)  # would have read the labels as document-start flags
    model(x, None, labels=x)


def test_loss_is_the_mean_over_labelled_tokens_and_losses_are_per_token():
    model = _model()
    x = torch.randint(0, 40, (2, 8))
    labels = torch.randint(0, 40, (2, 8))
    labels[0, :5] = -100  # masked positions must not dilute the mean
    out = model(x, labels=labels)
    assert out.losses.shape == (2, 8)
    assert torch.all(out.losses[0, :5] == 0)
    kept = labels != -100
    assert out.loss.dim() == 0
    torch.testing.assert_close(out.loss, out.losses[kept].mean())
    # the per-token values are the log-probs of the labels, in input order
    log_probs = model(x).log_probs
    picked = -log_probs[kept].gather(-1, labels[kept][:, None]).squeeze(-1)
    torch.testing.assert_close(out.losses[kept], picked)
    out.loss.backward()  # a scalar: backward needs no argument


def test_loss_with_no_labelled_token_is_zero_not_nan():
    model = _model()
    x = torch.randint(0, 40, (1, 8))
    out = model(x, labels=torch.full((1, 8), -100))
    assert out.loss.item() == 0.0


def test_lengths_are_an_argument_of_the_call_and_change_nothing_after_it():
    model = _model()
    before = model.config
    lengths = model.lengths.replace(mem_len=32, tgt_len=16, clamp_len=5, same_length=True)
    assert isinstance(lengths, Lengths) and lengths != model.lengths
    out = model(torch.randint(0, 40, (1, 4)), lengths=lengths)
    out = model(torch.randint(0, 40, (1, 4)), mems=out.mems, lengths=lengths)
    assert out.mems[0].size(1) == 8  # 4 + 4 states: below the call's mem_len of 32
    for _ in range(10):
        out = model(torch.randint(0, 40, (1, 4)), mems=out.mems, lengths=lengths)
    assert out.mems[0].size(1) == 32  # trimmed to the call's memory, not the model's 8
    assert model.config == before and model.lengths == Lengths.of(before)
    assert model(torch.randint(0, 40, (1, 4)), mems=out.mems).mems[0].size(1) == 8


def test_lengths_are_frozen_and_validated():
    model = _model()
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.lengths.mem_len = 99
    for bad in ({"tgt_len": 0}, {"mem_len": -1}, {"clamp_len": 1.5}, {"memory": 3},
                {"mem_len": 0, "same_length": True}):  # fmt: skip
        with pytest.raises(ConfigError):
            model.lengths.replace(**bad)
    assert model.lengths == Lengths.of(model.config)


def test_every_length_takes_effect():
    """Each field of the lengths changes what a forward computes."""
    model = _model()
    x = torch.randint(0, 40, (1, 8))
    assert model(x, lengths=model.lengths.replace(mem_len=3)).mems[0].size(1) == 3
    # clamp_len and same_length change the numbers of a forward with memory
    mems = model(x).mems
    base = model(x, mems=mems).hidden
    for change in ({"clamp_len": 1}, {"same_length": True}):
        got = model(x, mems=mems, lengths=model.lengths.replace(**change)).hidden
        assert not torch.allclose(got, base)
    # a cache holds the lengths it was made for: no other may be given with it
    cache = model.new_cache(1, lengths=model.lengths.replace(mem_len=4))
    assert cache.lengths.mem_len == 4 and cache.slots == 4 + 8
    with pytest.raises(ValueError, match="differ from the cache"):
        model.transform(x, cache=cache, lengths=model.lengths)


def test_the_config_is_what_the_model_was_built_with():
    """``model.config`` cannot be reassigned: dropout, attention kernel and lengths are fixed
    at construction (lengths per call through ``lengths=``)."""
    model = _model(dropout=0.1, dropatt=0.1)
    before = model.config
    with pytest.raises(AttributeError):
        model.config = model.config.replace(dropout=0.3)
    assert model.config is before
    assert all(m.p == 0.1 for m in model.modules() if isinstance(m, Dropout))
    attns = [m for m in model.modules() if isinstance(m, RelativeAttention)]
    assert attns and all(a.dropatt == 0.1 and a.attn_impl == "sdpa" for a in attns)
