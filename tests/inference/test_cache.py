"""Contract 9: cached incremental decoding equals full recomputation.

The reference is written here from the model's public forward: the context read in end-aligned
segments, then one token at a time through ``model(...)`` with the hidden-state memory (which
the model re-projects every step). Hundreds of steps with a short memory cross the point where
the memory starts trimming many times.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import pytest
import torch

from tests.helpers.models import debug_model
from txlm.inference.decode import Decoder
from txlm.inference.generate import generate
from txlm.inference.sampling import SamplingConfig
from txlm.model import TransformerXL

ATOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Hundreds of tiny steps: one thread avoids spinning on a shared 2-core machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# weights large enough that attention is far from uniform
make_model = functools.partial(debug_model, std=0.1, tgt_len=8, mem_len=24)


@torch.no_grad()
def reference_log_probs(model: TransformerXL, prompt: list[int], cont: list[int]) -> torch.Tensor:
    """[1 + len(cont), V]: next-token log-probs after the prompt and after each fed token."""
    tgt = model.config.tgt_len
    ids = torch.tensor([prompt])
    first = len(prompt) % tgt or tgt
    cuts = [0, first, *range(first + tgt, len(prompt) + 1, tgt)]
    mems, out = None, None
    for lo, hi in itertools.pairwise(cuts):
        out = model(ids[:, lo:hi], mems=mems)
        mems = out.mems
    rows = [out.log_probs[0, -1]]
    for tok in cont[:-1]:
        out = model(torch.tensor([[tok]]), mems=mems)
        mems = out.mems
        rows.append(out.log_probs[0, -1])
    return torch.stack(rows)


@torch.no_grad()
def cached_log_probs(model: TransformerXL, prompt: list[int], cont: list[int]) -> torch.Tensor:
    dec = Decoder(model)
    rows = [dec.prefill([prompt])[0]]
    for tok in cont[:-1]:
        rows.append(dec.step(torch.tensor([tok]))[0])
    return torch.stack(rows)


# name: (config overrides, decoding steps); mem_len 24, so the memory trims from step 12 on.
CONFIGS = {
    "default": ({}, 300),
    "same_length": (dict(same_length=True), 300),
    "clamp_len": (dict(clamp_len=6), 100),
    "same_length+clamp": (dict(same_length=True, clamp_len=10), 100),
    "pre_lnorm": (dict(pre_lnorm=True), 200),
    "untie_r+math": (dict(untie_r=True, attn_impl="math"), 100),
    "shaw": (dict(attn_type="shaw", n_positions=40), 100),
    "adaptive": (dict(cutoffs=[20, 40], div_val=2), 100),
    "vaswani": (dict(attn_type="vaswani"), 60),
    "alrfou": (dict(attn_type="alrfou", n_positions=40), 60),
    "pre_lnorm+same_length": (dict(pre_lnorm=True, same_length=True), 60),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_matches_recompute_across_trimming(name: str) -> None:
    overrides, steps = CONFIGS[name]
    model = make_model(**overrides)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (13,), generator=g).tolist()  # 13 = 5 + 8: end-aligned
    cont = torch.randint(0, 64, (steps,), generator=g).tolist()
    ref = reference_log_probs(model, prompt, cont)
    got = cached_log_probs(model, prompt, cont)
    assert ref.shape == (steps, 64)
    # Not a vacuous match: the distributions move from step to step.
    assert (ref[1:] - ref[:-1]).abs().max() > 0.1
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def _decode(dec, prompt: list[int], cont: list[int]) -> torch.Tensor:
    out = [dec.prefill([prompt])[0]]
    out += [dec.step(torch.tensor([tok]))[0] for tok in cont[:-1]]
    return torch.stack(out)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_eager_and_static_steps_agree(name: str) -> None:
    """The one-query step over an eager cache (written slots only, position keys in slot
    order, no mask; same_length hides one slot) equals it over a static cache (every slot,
    keys gathered per distance, the additive mask: what is compiled and captured), across
    many ring wrap-arounds (24 + 1 slots), in every configuration."""
    overrides, steps = CONFIGS[name]
    model = make_model(**overrides)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 64, (13,), generator=g).tolist()
    cont = torch.randint(0, 64, (steps,), generator=g).tolist()
    eager, static = Decoder(model), Decoder(model)
    static.static = True  # the cache a compiled or captured step runs over, run eagerly
    rows = {"eager": _decode(eager, prompt, cont), "static": _decode(static, prompt, cont)}
    assert not eager.cache.static and static.cache.static
    assert (rows["static"][1:] - rows["static"][:-1]).abs().max() > 0.1
    torch.testing.assert_close(rows["eager"], rows["static"], atol=ATOL, rtol=0)


def test_every_query_length_runs_the_one_attention_forward(monkeypatch) -> None:
    """The prompt's segments and every decoding step (eager or static) go through
    ``RelativeAttention.forward``, once per layer and call: there is no other attention."""
    from txlm.model.attention import RelativeAttention

    model = make_model()
    qlens: list[int] = []
    real = RelativeAttention.forward

    def counted(self, h, *args, **kwargs):
        assert h.dim() == 3  # [B, L, D] at every query length
        qlens.append(h.size(1))
        return real(self, h, *args, **kwargs)

    monkeypatch.setattr(RelativeAttention, "forward", counted)
    n_layer = model.config.n_layer
    for static in (False, True):
        dec = Decoder(model)
        dec.static = static
        dec.prefill([list(range(1, 14))])  # 13 tokens: segments of 5 and 8
        assert qlens == [5] * n_layer + [8] * n_layer
        for t in range(30):
            dec.step(torch.tensor([t]))
        assert qlens[2 * n_layer :] == [1] * (30 * n_layer)
        qlens.clear()


@pytest.mark.parametrize("name", ["default", "same_length", "pre_lnorm", "adaptive"])
def test_bf16_decoder_follows_the_reference(name: str) -> None:
    """A decoder made under CPU autocast runs its weight products in bf16 (copies made once)
    over a float32 cache (attention, residual and LayerNorm in float32) and follows the
    float32 reference to bf16 accuracy across ring wrap-arounds; its dtype is fixed when it
    is made: its steps are the same inside autocast and out."""
    overrides, steps = CONFIGS[name]
    model = make_model(**overrides)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 64, (13,), generator=g).tolist()
    cont = torch.randint(0, 64, (steps,), generator=g).tolist()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dec = Decoder(model)
        got = _decode(dec, prompt, cont)
    assert dec.net.layers[0].attn.qkv.held.dtype == torch.bfloat16
    assert dec.cache.kv.dtype == torch.float32
    assert model.layers[0].attn.qkv.weight.dtype == torch.float32  # the model is unchanged
    ref = reference_log_probs(model, prompt, cont)
    torch.testing.assert_close(got, ref, atol=0.1, rtol=0)
    assert (got - ref).abs().max() > 0  # bf16 really ran
    outside = Decoder(model, dtype=torch.bfloat16)
    torch.testing.assert_close(_decode(outside, prompt, cont), got, atol=0, rtol=0)


def test_cache_holds_projections_of_the_trimmed_memory() -> None:
    """The cached K/V window equals the projection of the model's memory, step after step."""
    model = make_model(pre_lnorm=True)
    cached, plain = Decoder(model), Decoder(model, cache=False)
    prompt = list(range(1, 20))
    cached.prefill([prompt])
    plain.prefill([prompt])
    for t in range(60):
        tok = torch.tensor([t % 64])
        cached.step(tok)
        plain.step(tok)
        cache = cached.cache
        assert cache.length == min(model.config.mem_len, len(prompt) + t + 1)
        for n, layer in enumerate(model.layers):
            mem = plain.mems[n]
            k, v = layer.attn.project_kv(layer.attn.norm(mem))
            got_k, got_v = cache.window(n)
            torch.testing.assert_close(got_k, k, atol=ATOL, rtol=0)
            torch.testing.assert_close(got_v, v, atol=ATOL, rtol=0)


def test_incremental_matches_one_long_forward_without_trimming() -> None:
    """With mem_len >= everything seen, decoding equals a single forward over the sequence."""
    model = make_model(mem_len=300)
    ids = torch.randint(0, 64, (1, 200), generator=torch.Generator().manual_seed(2))
    full = model(ids).log_probs[0]  # one segment, no memory
    got = cached_log_probs(model, ids[0, :10].tolist(), ids[0, 10:].tolist())
    torch.testing.assert_close(got, full[9:-1], atol=ATOL, rtol=0)


def test_zero_memory_sees_only_itself() -> None:
    model = make_model(mem_len=0)
    prompt, cont = [3, 4, 5], [6, 7, 8, 9]
    torch.testing.assert_close(
        cached_log_probs(model, prompt, cont), reference_log_probs(model, prompt, cont),
        atol=ATOL, rtol=0,
    )  # fmt: skip


@torch.no_grad()
def test_batch_of_different_lengths_equals_each_row_alone() -> None:
    model = make_model(same_length=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (21, 3, 1, 8, 30)]
    cont = torch.randint(0, 64, (len(prompts), 50), generator=g)
    dec = Decoder(model)
    rows = [dec.prefill(prompts)]
    for t in range(cont.size(1) - 1):
        rows.append(dec.step(cont[:, t]))
    batched = torch.stack(rows, dim=1)  # [B, steps, V]
    for b, prompt in enumerate(prompts):
        alone = reference_log_probs(model, prompt, cont[b].tolist())
        torch.testing.assert_close(batched[b], alone, atol=ATOL, rtol=0)
    # and greedy generation of the batch equals generating each prompt alone
    together = generate(model, prompts, max_new_tokens=20, greedy=True)
    assert together == [generate(model, p, max_new_tokens=20, greedy=True)[0] for p in prompts]


def test_model_is_left_in_its_mode_and_unchanged() -> None:
    model = make_model()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generate(model, [1, 2, 3], max_new_tokens=5, seed=0)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@torch.no_grad()
@pytest.mark.parametrize(
    "overrides", [{}, dict(cutoffs=[20, 40], div_val=2), dict(cutoffs=[20, 40], div_val=1)]
)
def test_decoder_log_probs_are_the_models_with_and_without_clusters(overrides: dict) -> None:
    """The decoder's output layer (the model's adaptive softmax, its head's weight joined
    with the cluster rows once, div_val 1 and 2) gives the model's log-probabilities."""
    model = make_model(**overrides)
    prompt, cont = list(range(1, 14)), [5, 9, 2, 40, 7, 7, 1, 30]
    dec = Decoder(model)
    rows = [dec.prefill([prompt])[0]]
    rows += [dec.step(torch.tensor([t]))[0] for t in cont[:-1]]
    got = torch.stack(rows)
    torch.testing.assert_close(got, reference_log_probs(model, prompt, cont), atol=ATOL, rtol=0)


def test_results_are_ordinary_tensors() -> None:
    """The cached decoder runs in inference mode; what it hands out may still enter autograd."""
    model = make_model()
    dec = Decoder(model)
    greedy = SamplingConfig(greedy=True)
    out = [dec.prefill([[1, 2, 3]]), dec.prefill([[1, 2, 3]], sampling=greedy)]
    out += [dec.step(torch.tensor([4])), dec.step(torch.tensor([5]), greedy)]
    assert not any(t.is_inference() for t in out)
    # while the cache the steps narrowed and wrote is an inference tensor (no version counter
    # bumped by each step's writes)
    assert dec.cache.max_len == 1 and dec.cache.kv.is_inference()
    weight = torch.ones(64, requires_grad=True)
    (out[2][0] * weight).sum().backward()  # saving it for backward is allowed
    assert torch.equal(weight.grad, out[2][0])


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element counts of dtype casts (``_to_copy``) made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    CASTS = (
        torch.ops.aten._to_copy.default,
        torch.ops.aten.to.dtype,
        torch.ops.aten.to.dtype_layout,
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.CASTS and out is not args[0]:
            self.sizes.append(args[0].numel())
        return out


def test_bf16_autocast_decoding_holds_weights_in_bf16() -> None:
    """Under CPU autocast the decoder holds bf16 copies of the weights, made once (the cached
    attention stays float32 on a CPU): a step casts no weight (autocast would cast all of
    them every token) and still follows the float32 reference to bf16 accuracy."""
    model = make_model(d_inner=96)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 64, (13,), generator=g).tolist()
    cont = torch.randint(0, 64, (40,), generator=g).tolist()
    ref = reference_log_probs(model, prompt, cont)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dec = Decoder(model)
        rows = [dec.prefill([prompt])[0]]
        casts = _Casts()
        for i, tok in enumerate(cont[:-1]):
            with casts if i == 20 else contextlib.nullcontext():
                rows.append(dec.step(torch.tensor([tok]))[0])
    got = torch.stack(rows)
    assert dec.net.layers[0].attn.qkv.held.dtype == torch.bfloat16  # a bf16 copy, made once
    assert dec.cache.kv.dtype == torch.float32  # CPU: one-query attention stays float32
    layer = model.layers[0]
    linears = (layer.attn.qkv, layer.attn.out, layer.ff.fc1, layer.ff.fc2)
    smallest_weight = min(m.weight.numel() for m in linears)
    assert casts.sizes and max(casts.sizes) < smallest_weight, casts.sizes
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=0.1, rtol=0)
    assert (got - ref).abs().max() > 0  # bf16 really ran


def test_spliced_rows_decode_as_each_alone():
    """KVCache.splice / keep_rows (continuous batching): a prompt read at another time and
    spliced into a running batch, past a full ring, gives the log-probs it gives alone; a row
    that leaves leaves the others as they were."""
    from tests.helpers.models import debug_model
    from txlm.inference.decode import Decoder

    model = debug_model(std=0.1)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 40))

    def alone(prompt, steps):
        d = Decoder(model)
        lp = d.prefill([prompt])
        for _ in range(steps):
            lp = d.step(lp.argmax(-1))
        return lp[0]

    d = Decoder(model)
    lp_a = d.prefill([a])
    batch = d.cache.resized(1)
    token_a = lp_a.argmax(-1)
    for _ in range(3):  # the batch runs on before b joins
        d.cache = batch
        token_a = d.step(token_a).argmax(-1)
    lp_b = d.prefill([b])
    joined = d.cache.resized(1)
    with torch.inference_mode():
        batch.splice(joined)
    ids = torch.cat([token_a, lp_b.argmax(-1)])
    for _ in range(20):  # both past the memory (16): the ring wraps
        d.cache = batch
        lp = d.step(ids)
        ids = lp.argmax(-1)
    # another batch shape and a mask: float32 rounding, not bits
    torch.testing.assert_close(lp[0], alone(a, 23), atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[1], alone(b, 20), atol=1e-5, rtol=0)
    with torch.inference_mode():
        batch.keep_rows(torch.tensor([1]))
    d.cache = batch
    torch.testing.assert_close(d.step(ids[1:])[0], alone(b, 21), atol=1e-5, rtol=0)


@pytest.mark.parametrize("other", ["bf16", "static"])
def test_a_cache_of_another_kind_is_not_spliced(other: str):
    """Rows join a batch only from a cache of its dtype and kind (static or not): a server's
    caches are all made for one step."""
    model = debug_model(std=0.1)
    batch = model.new_cache(1, dtype=torch.float32, static=False).resized(1)
    kind = {"bf16": dict(dtype=torch.bfloat16, static=False), "static": dict(static=True)}
    joining = model.new_cache(1, **kind[other]).resized(1)
    with torch.inference_mode(), pytest.raises(ValueError, match="same dtype"):
        batch.splice(joining)
