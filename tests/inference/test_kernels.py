"""C35: the compiled decoding step runs few kernels per token, and gives eager's outputs.

A decoded token is bound by how many kernels it launches, not by the bytes it reads
(ARCHITECTURE.md, C35). The layers' one forward, traced by torch.compile for one row and
one query over the cache (``CacheStep.fused``), writes each matrix-vector product as a
reduction (``attention.matmul``) the compiler fuses with what surrounds it (the
cache write, the position gather, mask, softmax, the weighted sum of values, biases, ReLU,
residuals and LayerNorms), and the cache write is an in-place scatter (no copy of a layer's
keys and values). Counted here on inductor's CPU code, as ``benchmarks/profile_step.py
--ops --compiled`` counts it at the wt103-base shape.

Two counts. On the CPU, inductor's C++ backend puts many loop nests into one kernel
function, so its count flatters: at most 5 kernels per layer plus 6 (16 x 5 + 6 = 86 at
wt103-base), and its loop nests at most 12 per layer plus 10. What a GPU launches is the
graph partitioned into Triton kernels, each one reduction and what fuses with it; inductor
writes those here too, without running them (``inductor_code.triton_partition``). A layer is
then 10 kernels: the qkv product, the cache write, the scores (content and position terms in
one reduction over Dh), the softmax statistics, the weighted sum of values, the output
product, residual + LayerNorm, the first feed-forward product, the second with its ReLU, and
residual + LayerNorm; the output layer and embedding add 9 (two tail clusters). So
wt103-base's step is 16 x 10 + 9 = 169 kernels per token, above the issue's budget of 100:
the bound below holds today's partition, so that a change that adds kernels fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import txlm
from txlm.config import ModelConfig
from txlm.inference.compiled import StepCompile
from txlm.inference.decode import Decoder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from inductor_code import compiled_code, kernel_counts, loop_nests, triton_partition

LAYERS = 2
PER_LAYER, FIXED = 5, 6  # the CPU's C++ kernels (see the docstring)
NESTS_PER_LAYER, NESTS_FIXED = 12, 10
TRITON_PER_LAYER, TRITON_FIXED = 10, 9  # a GPU's kernels: 16 x 10 + 9 = 169 at wt103-base

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _model() -> txlm.TransformerXL:
    """wt103-base's per-layer structure (post-LN, shared u/v, ReLU feed-forward, adaptive
    softmax with two tail clusters), narrow and short so it compiles in seconds."""
    config = ModelConfig.from_preset(
        "wt103-base", vocab_size=600, cutoffs=[200, 400], n_layer=LAYERS, d_model=64,
        n_head=4, d_head=16, d_inner=128, mem_len=16, tgt_len=8, dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = txlm.TransformerXL(config).eval()
    with torch.no_grad():  # non-trivial u, v, biases and LayerNorms
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def test_compiled_decoding_step_runs_within_the_kernel_budget_and_equals_eager() -> None:
    model = _model()
    prompt = torch.randint(0, 600, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        eager = Decoder(model)
        compiled = Decoder(model, compile=StepCompile(), cuda_graph=False)
        want, got = eager.prefill([prompt]), compiled.prefill([prompt])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        ids = want.argmax(-1)
        # the first compiled step, with the code it ran; the ring wraps around (16 + 1 slots)
        codes = compiled_code(compiled._stepper(), ids)
        eager.step(ids)
        for _ in range(20):
            want = eager.step(ids)
            got = compiled.step(ids)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            ids = want.argmax(-1)

    kernels = kernel_counts(codes)
    assert sum(kernels.values()) <= LAYERS * PER_LAYER + FIXED, kernels
    # the layers call no library product: the only ones left are the output layer's (one per
    # cluster: its shortlist and two tails)
    assert kernels.get("extern_kernels.addmm", 0) <= 3, kernels
    assert not {k for k in kernels if k not in ("fused", "extern_kernels.addmm")}, kernels
    assert loop_nests(codes) <= LAYERS * NESTS_PER_LAYER + NESTS_FIXED
    # the cache is written in place: no loop over a whole layer's keys and values
    slots = model.config.mem_len + 1
    layer_kv = 2 * model.config.n_head * slots * model.config.d_head
    assert not any(f"<static_cast<int64_t>({layer_kv}L)" in code for code in codes)


def test_the_step_partitioned_for_a_gpu_runs_ten_kernels_per_layer() -> None:
    model = _model()
    prompt = torch.randint(0, 600, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        decoder = Decoder(model, compile=StepCompile(), cuda_graph=False)
        ids = decoder.prefill([prompt]).argmax(-1)
        with triton_partition():
            codes = compiled_code(decoder._stepper(), ids)
    kernels = kernel_counts(codes)
    assert set(kernels) == {"fused", "extern_kernels.addmm"}, kernels  # no other library call
    assert kernels["extern_kernels.addmm"] == 3, kernels  # the output layer's three clusters
    assert sum(kernels.values()) <= LAYERS * TRITON_PER_LAYER + TRITON_FIXED, kernels
