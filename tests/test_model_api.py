"""The public model API: keyword-only arguments, ``loss`` / ``losses``, ``model.lengths`` and
configuration changes that either take effect or fail (ARCHITECTURE.md, "Model API")."""

from __future__ import annotations

import pytest
import torch

from txlm.config import ModelConfig
from txlm.errors import ConfigError
from txlm.model import TransformerXL
from txlm.model.attention import RelativeAttention
from txlm.model.dropout import Dropout


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


def test_lengths_apply_inside_the_block_and_are_restored_after_it():
    model = _model()
    before = model.config
    seen = []
    with model.lengths(mem_len=32, tgt_len=16, clamp_len=5, same_length=True) as m:
        assert m is model
        c = model.config
        seen.append((c.mem_len, c.tgt_len, c.clamp_len, c.same_length))
        out = model(torch.randint(0, 40, (1, 4)))
        out = model(torch.randint(0, 40, (1, 4)), mems=out.mems)
        assert out.mems[0].size(1) == 8  # 4 + 4 states: below the block's mem_len of 32
        for _ in range(10):
            out = model(torch.randint(0, 40, (1, 4)), mems=out.mems)
        assert out.mems[0].size(1) == 32  # trimmed to the block's memory, not the model's 8
    assert seen == [(32, 16, 5, True)]
    assert model.config == before


def test_lengths_are_restored_when_the_block_raises():
    model = _model()
    before = model.config
    with pytest.raises(RuntimeError, match="boom"), model.lengths(mem_len=99):
        assert model.config.mem_len == 99
        raise RuntimeError("boom")
    assert model.config == before
    with pytest.raises(ConfigError), model.lengths(tgt_len=0):  # invalid: refused, restored
        pass
    assert model.config == before


def test_every_runtime_field_takes_effect():
    """Changing a field through ``model.config`` is never a silent no-op."""
    model = _model(dropout=0.1, dropatt=0.1)
    model.config = model.config.replace(dropout=0.3, dropatt=0.2, attn_impl="math")
    drops = [m.p for m in model.modules() if isinstance(m, Dropout)]
    assert drops and all(p == 0.3 for p in drops)
    attns = [m for m in model.modules() if isinstance(m, RelativeAttention)]
    assert all(a.dropatt == 0.2 and a.attn_impl == "math" for a in attns)

    # lengths are read at every forward: memory is trimmed to the new mem_len
    x = torch.randint(0, 40, (1, 8))
    model.config = model.config.replace(mem_len=3)
    assert model(x).mems[0].size(1) == 3
    # clamp_len and same_length change the numbers of a forward with memory
    mems = model(x).mems
    base = model(x, mems=mems).hidden
    model.config = model.config.replace(clamp_len=1)
    assert not torch.allclose(model(x, mems=mems).hidden, base)
    model.config = model.config.replace(clamp_len=-1, same_length=True)
    assert not torch.allclose(model(x, mems=mems).hidden, base)


@pytest.mark.parametrize(
    "change", [{"n_head": 2, "d_head": 16}, {"pre_lnorm": True}, {"attn_type": "shaw"},
               {"init_std": 0.5}, {"vocab_size": 41}],
)  # fmt: skip
def test_fields_fixed_at_construction_refuse_to_change(change):
    model = _model()
    before = model.config
    with pytest.raises(ConfigError, match="cannot change on a built model"):
        model.config = model.config.replace(**change)
    assert model.config == before
