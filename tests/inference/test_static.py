"""The decoding step is static: one compiled graph for hundreds of tokens, no host sync.

What a CUDA graph (or torch.compile's "reduce-overhead") needs, checked on the CPU: the step
(``Decoder.step``) traces into a single graph (fullgraph=True: a graph break is an
error), is never recompiled while the cache's ring wraps around many times (a recompile
would mean some shape or Python value changed from token to token), gives the eager step's
log-probabilities, and reads nothing back to the host: no ``aten::_local_scalar_dense`` (what
``.item()`` and ``bool(tensor)`` dispatch to) and no ``nonzero``. (``.tolist()`` reads the
data without dispatching; the step's code has none, and the compiled graph could not hold one.)
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.models import spread_weights
from txlm.config import ModelConfig
from txlm.inference.decode import Decoder
from txlm.inference.sampling import SamplingConfig, sample
from txlm.model import TransformerXL

STEPS = 600


def tiny_model(**overrides) -> TransformerXL:
    config = ModelConfig.from_preset(
        "debug", **{"n_layer": 2, "d_model": 16, "n_head": 2, "d_head": 8, "d_inner": 32,
                    "tgt_len": 8, "mem_len": 12, **overrides}
    )  # fmt: skip
    torch.manual_seed(0)
    model = TransformerXL(config).eval()
    spread_weights(model, 0.2)
    return model


class HostSyncs(TorchDispatchMode):
    """Counts the operations that copy a device value to the host (or wait for one)."""

    SYNCS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.SYNCS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides", [{}, dict(same_length=True, clamp_len=5)])
def test_compiled_step_runs_600_tokens_with_one_graph(overrides) -> None:
    torch._dynamo.reset()
    model = tiny_model(**overrides)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8]]  # padded rows: per-row masks
    eager, compiled = Decoder(model), Decoder(model, compile="aot_eager")
    want, got = eager.prefill(prompt), compiled.prefill(prompt)
    torch.testing.assert_close(got, want)
    ids = torch.randint(0, 64, (STEPS, 2), generator=torch.Generator().manual_seed(1))
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(STEPS):  # mem_len 12: the ring wraps ~50 times
            want, got = eager.step(ids[t]), compiled.step(ids[t])
            if t % 50 == 0 or t == STEPS - 1:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("overrides", [{}, dict(vocab_size=64, cutoffs=[8, 24], div_val=2)])
def test_no_host_sync_inside_a_step_or_a_draw(overrides) -> None:
    """Also with adaptive embeddings of several widths (div_val > 1, as the published
    wt103 model), whose lookup once selected each cluster's tokens with nonzero."""
    model = tiny_model(**overrides)
    dec = Decoder(model)
    scores = dec.prefill([[3, 1, 4], [1, 5, 9, 2, 6]])
    g = torch.Generator().manual_seed(0)
    configs = [
        SamplingConfig(top_k=5, temperature=0.8),
        SamplingConfig(top_k=None, top_p=0.9),
        SamplingConfig(greedy=True),
    ]
    tokens = sample(scores, configs[0], g)
    for t in range(30):  # past the point where the memory trims
        with HostSyncs() as syncs:
            scores = dec.step(tokens)
            tokens = sample(scores, configs[t % len(configs)], g)
        assert syncs.count == 0, t
    # the mode does see a sync when there is one
    with HostSyncs() as syncs:
        tokens.sum().item()
        bool(tokens.any())
    assert syncs.count == 2


def test_compiled_cached_evaluation_equals_the_forward() -> None:
    """``txlm eval --kv-cache --compile``'s runner: the compiled transform with the cache
    gives the model's losses segment after segment (same shapes: one graph after the first)."""
    from txlm.inference.kv_eval import CachedEvaluator

    torch._dynamo.reset()
    model = tiny_model()
    ids = torch.randint(0, 64, (2, 8 * 5), generator=torch.Generator().manual_seed(2))
    runner = CachedEvaluator(model, compile="aot_eager")
    mems = None
    with torch.no_grad():
        for seg in ids.split(8, dim=1):
            ref = model(seg, mems=mems, labels=seg)
            mems = ref.mems
            got = runner(seg, labels=seg)
            torch.testing.assert_close(got.losses, ref.losses, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_cache", [False, True])
def test_evaluate_compile_option_gives_the_same_loss(kv_cache, monkeypatch) -> None:
    """``evaluate_tokens(compile=True)`` (``txlm eval --compile``) compiles and agrees; the
    backend is swapped for "aot_eager" (the same tracing, no code generation)."""
    from txlm.inference.evaluate import evaluate_tokens

    real_compile = torch.compile
    calls = []

    def fast_compile(fn, **kwargs):
        calls.append(fn)
        return real_compile(fn, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", fast_compile)
    torch._dynamo.reset()
    model = tiny_model()
    tokens = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(4))
    args = dict(
        batch_size=2, lengths=model.lengths.replace(tgt_len=8, mem_len=12), kv_cache=kv_cache
    )
    plain = evaluate_tokens(model, tokens, **args)
    compiled = evaluate_tokens(model, tokens, compile=True, **args)
    assert len(calls) == 1
    assert compiled["tokens"] == plain["tokens"]
    assert abs(compiled["loss"] - plain["loss"]) < 1e-5
