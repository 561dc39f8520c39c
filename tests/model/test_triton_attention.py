"""The Triton relative attention equals the math path, forward and backward (ARCHITECTURE.md
C34).

The kernels run under Triton's interpreter on the CPU (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton), ``tl.dot`` included, in float64 so that
any wrong index, mask or gradient term shows far above rounding. Block sizes of 16 against
segments of 37 queries and 60 keys put block edges inside every axis: the boundary masking,
the loops that skip blocks no row can see, and the gathered position scores at the edges.
A layer with attn_impl "triton" is compared with the same layer on the math path over its
output and the gradients of its input, u, v and every parameter (q, k, v, rk reached
through the projections); the whole model too, padded for tensor cores as on CUDA.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from tests.helpers.env import subprocess_env
from txlm.config import ModelConfig
from txlm.errors import ConfigError
from txlm.model import TransformerXL, align
from txlm.model.align import Stored
from txlm.model.attention import RelativeAttention
from txlm.model.mask import attention_mask
from txlm.model.positional import relative_distances, sinusoid

pytest.importorskip("triton")
from txlm.model import triton_attention

if not triton_attention.INTERPRETED:
    pytest.skip("the kernels were decorated without TRITON_INTERPRET=1", allow_module_level=True)

L, M, D, H, DH = 37, 23, 16, 2, 8  # K = 60; blocks of 16 divide neither
MEM_LEN = 23


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(triton_attention, "BLOCK", (16, 16))


def layer_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=50, n_layer=1, n_head=H, d_model=D, d_head=DH, d_inner=32, mem_len=MEM_LEN,
        dropout=0.0, dropatt=0.0, attn_impl="math",
    )  # fmt: skip
    return ModelConfig(**{**base, **overrides})


def run_layer(impl: str, config: ModelConfig, *, mlen: int, dtype=torch.float64, **mask_kw):
    """One training-mode forward and backward of a layer with fixed non-zero weights;
    (output, {name: gradient}) over the input, u, v and every parameter."""
    torch.manual_seed(0)
    layer = RelativeAttention(config).to(dtype).train()
    layer.attn_impl = impl
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, L, D, generator=gen, dtype=dtype, requires_grad=True)
    mem = torch.randn(2, mlen, D, generator=gen, dtype=dtype) if mlen else None
    u = torch.randn(H, 1, DH, generator=gen, dtype=dtype, requires_grad=True)  # [H, 1, Dh]
    v = torch.randn(H, 1, DH, generator=gen, dtype=dtype, requires_grad=True)
    mask, _ = attention_mask(L, mlen, mem_len=MEM_LEN, **mask_kw)
    pos = None  # vaswani: the encoding is added to the embeddings, no position term here
    if config.attn_type == "xl":
        pos = sinusoid(relative_distances(L + mlen, 0), D).to(dtype)
    elif config.attn_type == "shaw":  # distances that index its learned rows
        pos = relative_distances(L + mlen, 0)
    out, _ = layer(h, mem, mask, pos, u, v)
    out.backward(torch.randn(out.shape, generator=gen, dtype=dtype))
    grads = {"h": h.grad, "u": u.grad, "v": v.grad}
    grads |= {n: p.grad for n, p in layer.named_parameters()}
    return out, {n: g for n, g in grads.items() if g is not None}


def doc_resets() -> torch.Tensor:
    flags = torch.zeros(2, L, dtype=torch.bool)
    flags[0, [5, 20, 21]] = True  # new documents inside row 0's segment
    flags[1, 0] = True  # row 1 drops its memory at once
    return flags


CASES = {
    "memory": dict(mlen=M),
    "no_memory": dict(mlen=0),
    "same_length": dict(mlen=M, same_length=True),
    "document_resets": dict(mlen=M, reset="docs"),
    # memory validity that is no suffix: keys hidden in the middle of a row's window
    "memory_validity": dict(mlen=M, mem_valid="holes"),
    "pre_lnorm+untie_r": dict(mlen=M, same_length=True, reset="docs", pre_lnorm=True,
                              untie_r=True),
    "shaw": dict(mlen=M, attn_type="shaw", n_positions=80),
    "vaswani": dict(mlen=M, attn_type="vaswani"),  # no position term
}  # fmt: skip


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_layer_equals_math_path_forward_and_backward(case) -> None:
    case = dict(case)
    mlen = case.pop("mlen")
    mask_kw = {"same_length": case.pop("same_length", False)}
    if case.pop("reset", None):
        mask_kw["reset"] = doc_resets()
    if case.pop("mem_valid", None):
        mask_kw["mem_valid"] = torch.rand(2, mlen, generator=torch.Generator().manual_seed(3)) > 0.4
    config = layer_config(**case)
    out_math, grads_math = run_layer("math", config, mlen=mlen, **mask_kw)
    out_tri, grads_tri = run_layer("triton", config, mlen=mlen, **mask_kw)
    torch.testing.assert_close(out_tri, out_math, atol=1e-12, rtol=0)
    assert grads_tri.keys() == grads_math.keys()
    for name, g in grads_math.items():
        torch.testing.assert_close(grads_tri[name], g, atol=1e-11, rtol=0, msg=name)


def test_float32_within_rounding() -> None:
    config = layer_config()
    kw = dict(mlen=M, same_length=True, reset=doc_resets(), dtype=torch.float32)
    out_math, grads_math = run_layer("math", config, **kw)
    out_tri, grads_tri = run_layer("triton", config, **kw)
    torch.testing.assert_close(out_tri, out_math, atol=2e-5, rtol=0)
    for name, g in grads_math.items():
        torch.testing.assert_close(grads_tri[name], g, atol=5e-4, rtol=1e-4, msg=name)


def model_pair(**overrides) -> tuple[TransformerXL, TransformerXL]:
    config = ModelConfig.from_preset(
        "debug", **{"n_head": 3, "d_head": 5, "dropout": 0.0, "dropatt": 0.0,
                    "attn_impl": "math", **overrides}
    )  # fmt: skip
    torch.manual_seed(0)
    math_model = TransformerXL(config).double()
    with torch.no_grad():  # non-zero u, v and biases: every term counts
        for p in math_model.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.3)
    tri_model = copy.deepcopy(math_model)
    for layer in tri_model.layers:
        layer.attn.attn_impl = "triton"
    return math_model, tri_model


def two_segments(model: TransformerXL, ids: torch.Tensor) -> torch.Tensor:
    first = model(ids[:, :20], labels=ids[:, 1:21])
    second = model(
        ids[:, 20:40], mems=first.mems, reset=torch.tensor([False, True]),
        mem_mask=first.mem_mask, labels=ids[:, 21:41],
    )  # fmt: skip
    return first.losses.sum() + second.losses.sum()


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_model_equals_math_path_with_memory_and_resets(padded, monkeypatch) -> None:
    """Two segments, memory carried with a document reset, the whole model's loss and every
    gradient; padded as for CUDA: heads of 8, widths of 8 and keys aligned to 8 by masked
    slots in front (the kernel's bounds skip them). Blocks of 32 (fewer interpreted
    programs) against 20 queries and 40 (48 aligned) keys."""
    monkeypatch.setattr(triton_attention, "BLOCK", (32, 32))
    calls = []  # the kernel path runs (no silent fall-back to the math path)
    real = triton_attention.relative_attention
    monkeypatch.setattr(
        triton_attention, "relative_attention", lambda *a: calls.append(1) or real(*a)
    )
    math_model, tri_model = model_pair()
    if padded:
        stored = Stored.aligned(math_model.config)
        math_model, tri_model = (align.padded(m, stored) for m in (math_model, tri_model))
        for layer in tri_model.layers:  # built from the configuration: the math path's
            layer.attn.attn_impl = "triton"
        assert tri_model.layers[0].attn.key_multiple == 8
    ids = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(1))
    loss_math = two_segments(math_model.train(), ids)
    loss_tri = two_segments(tri_model.train(), ids)
    assert len(calls) == 2 * tri_model.config.n_layer
    torch.testing.assert_close(loss_tri, loss_math, atol=1e-10, rtol=0)
    loss_math.backward()
    loss_tri.backward()
    grads = dict(math_model.named_parameters())
    for name, p in tri_model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-10, rtol=0, msg=name)


class OpShapes(TorchDispatchMode):
    """Records (op name, number of elements) of each tensor an op returns in storage of its
    own (views and in-place results are not new tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.ops.append((str(func), t.numel()))
        return out


class Opaque:
    """A kernel whose launch the recorder does not look into: on a GPU it is one kernel,
    under the interpreter it also copies its arguments' storages to and from "the host"."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _disable_current_modes():
                self.kernel[grid](*args, **kwargs)

        return launch


def big_outputs(impl: str, monkeypatch) -> tuple[list[list[str]], list[str]]:
    """The ops of a layer's forward and of its backward that return B H L K elements or
    more, and every op that reads a value back to the host."""
    for name in ("_attention_fwd_kernel", "_attention_bwd_kernel"):
        monkeypatch.setattr(triton_attention, name, Opaque(getattr(triton_attention, name)))
    config = layer_config(attn_impl=impl)
    torch.manual_seed(0)
    layer = RelativeAttention(config).double().train()
    h = torch.randn(2, L, D, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(2, M, D, dtype=torch.float64)
    u, v = (torch.randn(H, 1, DH, dtype=torch.float64) for _ in range(2))
    mask, _ = attention_mask(L, M, mem_len=MEM_LEN, same_length=False, reset=doc_resets())
    pos = sinusoid(relative_distances(L + M, 0), D).double()
    pairs = 2 * H * L * (L + M)
    with OpShapes() as fwd:
        out, _ = layer(h, mem, mask, pos, u, v)
    with OpShapes() as bwd:
        out.sum().backward()
    syncs = [n for n, _ in fwd.ops + bwd.ops if "_local_scalar_dense" in n or "nonzero" in n]
    big = [[n for n, size in rec.ops if size >= pairs] for rec in (fwd, bwd)]
    return big, syncs


def test_no_per_pair_tensor_beyond_the_position_scores(monkeypatch) -> None:
    """The kernel path makes one tensor of B H L K elements or more in the forward, the
    per-distance position scores P [B, H, L, K+1] (a matmul), and one in the backward, its
    gradient (zero-filled, then written by the kernel); no host sync. The math path, which
    the assertion would catch, makes the per-pair bias, scores and probabilities."""
    (fwd, bwd), syncs = big_outputs("triton", monkeypatch)
    assert fwd == ["aten.bmm.default"]  # P = (scale qp) @ rk^T
    assert bwd == ["aten.zeros_like.default"]  # dP
    assert syncs == []
    (fwd_math, bwd_math), _ = big_outputs("math", monkeypatch)
    assert len(fwd_math) >= 4 and len(bwd_math) >= 2, (fwd_math, bwd_math)


def test_attention_dropout_takes_the_math_path(monkeypatch) -> None:
    """The kernel has no attention dropout: with dropatt > 0 a training forward takes the
    math path, an evaluation forward the kernel."""
    calls = []
    real = triton_attention.relative_attention
    monkeypatch.setattr(
        triton_attention, "relative_attention", lambda *a: calls.append(1) or real(*a)
    )
    layer = RelativeAttention(layer_config(attn_impl="triton", dropatt=0.1)).double()
    h = torch.randn(2, L, D, dtype=torch.float64)
    mask, _ = attention_mask(L, 0, mem_len=MEM_LEN, same_length=False)
    pos = sinusoid(relative_distances(L, 0), D).double()
    u, v = (torch.zeros(H, 1, DH, dtype=torch.float64) for _ in range(2))
    layer.train()(h, None, mask, pos, u, v)
    assert calls == []
    layer.eval()(h, None, mask, pos, u, v)
    assert calls == [1]


def test_triton_is_refused_where_it_cannot_run(monkeypatch) -> None:
    """A config naming triton without the package, and a CPU run whose kernels were not
    decorated for the interpreter: one ConfigError line each."""
    assert layer_config(attn_impl="triton").attn_impl == "triton"
    import importlib.util

    real_find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find(name)
    )
    with pytest.raises(ConfigError, match="needs the triton package"):
        layer_config(attn_impl="triton")
    monkeypatch.undo()
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        triton_attention.check_device(torch.device("cpu"))
    triton_attention.check_device(torch.device("cuda"))  # compiled kernels there


COMPILE = """
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from txlm.model import triton_attention as ta

out = []
for fn in (ta._attention_fwd_kernel, ta._attention_bwd_kernel):
    for dt in ("bf16",):
        const = {"HAS_P": True, "BM": ta.BLOCK[0], "BN": ta.BLOCK[1], "BD": 64,
                 "ACC": tl.float32}
        sig = {}
        for n in fn.arg_names:
            if n in const:
                sig[n] = "constexpr"
            elif n in ("LO", "HI", "KOK", "QLO", "QHI"):
                sig[n] = "*i32"
            elif n in ("LSE", "DELTA"):
                sig[n] = "*fp32"
            elif n == "scale":
                sig[n] = "fp32"
            elif n.isupper() and n not in ("H", "L", "KLEN", "DH", "NKB"):
                sig[n] = "*" + dt
            else:
                sig[n] = "i32"
        consts = {(fn.arg_names.index(k),): v for k, v in const.items()}
        kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))
        out.append([fn.__name__, dt, kernel.metadata.shared, len(kernel.asm["cubin"])])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernels_compile_for_cuda(tmp_path) -> None:
    """The interpreter runs Python, which accepts more than Triton's compiler: both kernels
    are compiled here, without a GPU, for an sm_90 target through the wheel's own ptxas
    (bf16, what CUDA training runs; the default blocks; the head dim of a padded
    wt103-base), each within an H100/H200's 227 KiB of shared memory per block."""
    env = subprocess_env(TRITON_CACHE_DIR=str(tmp_path))
    env.pop("TRITON_INTERPRET")  # compiled kernels, not interpreted ones
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(name, dt) for name, dt, _, _ in rows] == [
        ("_attention_fwd_kernel", "bf16"), ("_attention_bwd_kernel", "bf16"),
    ]  # fmt: skip
    for name, dt, shared, cubin in rows:
        assert 0 < shared <= 227 * 1024 and cubin > 1000, (name, dt, shared)


def test_bounds_reproduce_the_mask_exactly() -> None:
    """The kernels' rule, lo_i <= j <= hi_i and key j seen at all, gives back every mask the
    model builds (per row, shared, memory validity with holes, same_length) and a row that
    sees nothing."""
    holes = torch.rand(2, M, generator=torch.Generator().manual_seed(3)) > 0.4
    masks = [
        attention_mask(L, M, mem_len=MEM_LEN, same_length=s, reset=r, mem_valid=mv)[0]
        for s in (False, True)
        for r in (None, doc_resets())
        for mv in (None, holes)
    ]
    blind = masks[-1].clone()
    blind[1, 0, 4] = False  # a query that sees no key
    for mask in [*masks, blind]:
        lo, hi, kok, qlo, qhi = triton_attention._bounds(mask, L, L + M, mask.device)
        j = torch.arange(L + M)
        rebuilt = (j >= lo[..., None]) & (j <= hi[..., None]) & (kok[:, None, :] != 0)
        assert torch.equal(rebuilt, mask.reshape(-1, L, L + M))
        # every query that sees key j lies in [qlo_j, qhi_j]
        i = torch.arange(L)[:, None]
        assert not (mask.reshape(-1, L, L + M) & ((i < qlo[:, None]) | (i > qhi[:, None]))).any()
