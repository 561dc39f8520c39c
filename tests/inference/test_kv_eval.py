"""The cached-K/V evaluation path (txlm.inference.kv_eval) equals the model's own forward.

Float64, several segments so the cache is reused and trimmed (mem_len smaller and larger
than the segment), for every encoding and with per-row and per-token document resets.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.models import debug_model
from txlm.config import ModelConfig
from txlm.inference.kv_eval import CachedEvaluator
from txlm.model import TransformerXL

ATOL = 1e-10
B, L, SEGMENTS = 3, 8, 4


make_model = functools.partial(debug_model, dtype=torch.float64, dropout=0.1, dropatt=0.1)


CASES = {
    "xl-sdpa": {},
    "mem-shorter-than-segment": dict(mem_len=5),
    "mem-longer": dict(mem_len=20),
    "same-length-clamp": dict(same_length=True, clamp_len=6, mem_len=12),
    "pre-lnorm-untie-r": dict(pre_lnorm=True, untie_r=True),
    "shaw": dict(attn_type="shaw"),
    "alrfou-math": dict(attn_type="alrfou", attn_impl="math"),
    "adaptive": dict(cutoffs=[16, 40], div_val=2),
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("resets", ["none", "rows", "tokens"])
def test_cached_eval_equals_forward(overrides, resets):
    model = make_model(**overrides)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (B, L * SEGMENTS), generator=g)
    runner, loss_runner = CachedEvaluator(model), CachedEvaluator(model)
    mems = mem_mask = None
    for s, seg in enumerate(ids.split(L, dim=1)):
        reset = None
        if resets == "rows":
            reset = torch.tensor([s == 1, False, s >= 2])
        elif resets == "tokens":
            reset = torch.zeros(B, L, dtype=torch.bool)
            reset[0, 3] = s % 2 == 0
            reset[2, L - 1] = True
        labels = seg.roll(-1, dims=1)
        with torch.no_grad():
            ref = model(seg, mems=mems, reset=reset, mem_mask=mem_mask)
            ref_loss = model(seg, mems=mems, reset=reset, mem_mask=mem_mask, labels=labels).losses
        mems, mem_mask = ref.mems, ref.mem_mask
        # the runners are stateful: one gives log-probs, the other (in step) losses
        out = runner(seg, reset=reset)
        out_loss = loss_runner(seg, labels=labels, reset=reset).losses
        torch.testing.assert_close(out.log_probs, ref.log_probs, atol=ATOL, rtol=0)
        torch.testing.assert_close(out_loss, ref_loss, atol=ATOL, rtol=0)
        assert out.mems == [] and out.mem_mask is None  # the cache is the memory
        # which memory positions the next token may see: the model's mask (none: all)
        valid = runner.cache.memory_valid()
        assert torch.equal(valid, torch.ones_like(valid) if mem_mask is None else mem_mask)
        # the cache holds exactly the memory's projections
        for n in range(model.config.n_layer):
            k, v = runner.cache.window(n)
            attn = model.layers[n].attn
            x = mems[n]
            if model.config.pre_lnorm:
                x = attn.norm(x)
            with torch.no_grad():
                k_ref, v_ref = attn.project_kv(x)
            torch.testing.assert_close(k, k_ref, atol=ATOL, rtol=0)
            torch.testing.assert_close(v, v_ref, atol=ATOL, rtol=0)


def test_cached_eval_refuses_training_mode_and_resets():
    model = make_model()
    runner = CachedEvaluator(model)
    x = torch.randint(0, 64, (2, L))
    model.train()
    with pytest.raises(RuntimeError, match="eval"):
        runner(x)
    model.eval()
    first = runner(x).log_probs
    runner(x)
    runner.reset_state()
    torch.testing.assert_close(runner(x).log_probs, first, atol=ATOL, rtol=0)


def test_cached_eval_float32_long_memory():
    """float32, memory four segments long: the saved projections agree to float rounding."""
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig.from_preset("debug", mem_len=64)).eval()
    ids = torch.randint(0, 64, (2, 16 * 6))
    runner = CachedEvaluator(model)
    mems = None
    for seg in ids.split(16, dim=1):
        with torch.no_grad():
            ref = model(seg, mems=mems)
        mems = ref.mems
        torch.testing.assert_close(runner(seg).log_probs, ref.log_probs, atol=1e-5, rtol=0)
