"""``txlm.model.cache``: the ring of slots on its own, without a model. Position p lives in
slot p mod S; a segment sees the memory window the model's rule gives (the M newest before
it, causal inside it, ``same_length``, documents); the memory it keeps, resized or repeated,
is the same positions; an eager one-token step sees exactly the static step's slots."""

from __future__ import annotations

import pytest
import torch

from txlm.model.cache import KVCache
from txlm.model.lengths import Lengths

N, B, H, DH = 2, 2, 1, 1


def _cache(mem: int, tgt: int, *, same_length: bool = False, static: bool = True, **kw):
    lengths = Lengths(tgt_len=tgt, mem_len=mem, same_length=same_length)
    return KVCache(N, B, H, DH, lengths=lengths, static=static, **kw)


def _write(cache: KVCache, start: int, qlen: int, reset=None):
    """Advance by ``qlen`` positions and store, in every layer, keys = the position and
    values = -(position) (rows: + 1000 * row), so what a slot holds names its position."""
    step = cache.advance(qlen, reset)
    pos = torch.arange(start, start + qlen, dtype=torch.float32)
    rows = torch.arange(B, dtype=torch.float32)[:, None] * 1000
    k = (pos + rows)[:, None, :, None].expand(B, H, qlen, DH)
    for layer in range(N):
        step.update(layer, torch.stack([k, -k]))
    return step


def _visible(step) -> torch.Tensor:
    """The slots each query sees: [L, S] (or [B, L, S] with documents)."""
    mask = step.mask if step.mask.dim() == 2 else step.mask[:, 0]
    return torch.isfinite(mask)


def _rule(cache: KVCache, t: int, qlen: int, same_length: bool) -> torch.Tensor:
    """The model's rule on slot positions: t - M <= p <= t + i, and t + i - p < M with
    same_length (txlm.model.mask, written out)."""
    q = torch.arange(t, t + qlen)[:, None]
    p = cache.pos[None, :]
    seen = (p >= t - cache.mem_len) & (p <= q)
    return seen & (q - p < cache.mem_len) if same_length else seen


@pytest.mark.parametrize("same_length", [False, True])
def test_each_segment_sees_the_models_window_in_a_ring(same_length) -> None:
    cache = _cache(5, 3, same_length=same_length)
    assert cache.slots == 8
    t = 0
    for qlen in (3, 2, 3, 1, 3, 3):  # wraps the ring several times
        step = _write(cache, t, qlen)
        assert step.slots.tolist() == [(t + i) % 8 for i in range(qlen)]
        assert torch.equal(_visible(step), _rule(cache, t, qlen, same_length))
        index = (torch.arange(t, t + qlen)[:, None] - cache.pos[None, :]).clamp(0, 7)
        assert torch.equal(step.index, index)  # each pair's distance, into the table
        t += qlen
    assert cache.length == 5
    keys, values = cache.window(1)  # [B, H, M', Dh], oldest first
    assert keys[0, 0, :, 0].tolist() == [float(p) for p in range(t - 5, t)]
    assert torch.equal(values, -keys)
    assert keys[1, 0, :, 0].tolist() == [1000.0 + p for p in range(t - 5, t)]


def test_a_reset_starts_a_document_the_memory_then_hides() -> None:
    cache = _cache(4, 3)
    _write(cache, 0, 3)
    reset = torch.tensor([[False, True, False], [False, False, False]])
    step = _write(cache, 3, 3, reset)  # row 0: a document starts at position 4
    seen = _visible(step)  # [B, L, S]
    slot = {int(p): s for s, p in enumerate(cache.pos.tolist()) if p >= 0}
    assert seen[0, 0, slot[0]] and not seen[0, 1, slot[0]] and not seen[0, 2, slot[3]]
    assert seen[0, 2, slot[4]] and seen[1, 2, slot[0]]  # row 1 keeps its one document
    assert cache.memory_valid().tolist() == [[False, False, True, True], [True] * 4]


def test_resized_keeps_the_same_memory_for_shorter_segments() -> None:
    cache = _cache(4, 3)
    for t in (0, 3, 6):  # row 0: a document starts at position 7
        _write(cache, t, 3, torch.tensor([[False, t == 6, False], [False] * 3]))
    one = cache.resized(1)
    assert one.slots == 5 and one.length == 4
    for a, b in zip(cache.window(0), one.window(0), strict=True):
        assert torch.equal(a, b)
    assert one.memory_valid().tolist() == [[False, False, True, True], [True] * 4]
    step = _write(one, 9, 1)
    seen = _visible(step)  # [B, 1, S]: the rule, and row 0's new document only
    assert torch.equal(seen[1], _rule(one, 9, 1, False))
    assert torch.equal(seen[0], _rule(one, 9, 1, False) & (one.pos >= 7))
    assert one.window(0)[0][0, 0, :, 0].tolist() == [6.0, 7.0, 8.0, 9.0]


def test_repeated_rows_carry_their_rows_keys_and_documents() -> None:
    cache = _cache(4, 3)
    _write(cache, 0, 3, torch.tensor([[False, True, False], [False, False, False]]))
    cache.repeat_rows(3)
    assert cache.batch == 3 * B
    keys = cache.window(0)[0][:, 0, :, 0]
    assert torch.equal(keys[:3], keys[0].expand(3, -1))
    assert torch.equal(keys[3:], keys[3].expand(3, -1)) and not torch.equal(keys[0], keys[3])
    assert cache.memory_valid().tolist() == [[False, True, True]] * 3 + [[True] * 3] * 3


@pytest.mark.parametrize("same_length", [False, True])
def test_an_eager_one_token_step_sees_the_static_steps_slots(same_length) -> None:
    """Unmasked eager steps attend over the W written slots less ``hidden``: the slots the
    static cache's mask leaves visible, step after step past a full ring."""
    static, eager = _cache(3, 1, same_length=same_length), _cache(3, 1, same_length=same_length,
                                                                  static=False)  # fmt: skip
    for t in range(9):
        want = _visible(_write(static, t, 1))[0]
        step = _write(eager, t, 1)
        assert step.mask is None and step.index is None
        got = torch.zeros(static.slots, dtype=torch.bool)
        got[: step.width] = True
        if step.hidden is not None:
            got[step.hidden] = False
        assert torch.equal(got, want), t
    for a, b in zip(static.window(1), eager.window(1), strict=True):
        assert torch.equal(a, b)


def test_a_segment_longer_than_the_cache_was_made_for_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        _cache(4, 2).advance(3, None)


@pytest.mark.parametrize("same_length", [False, True])
def test_a_masked_segment_after_one_token_steps_sees_the_static_steps_slots(same_length) -> None:
    """Eager one-token steps leave the ring's bookkeeping to be brought up to date; a longer
    segment after them must see the positions before it only (a prompt of 1 + L tokens read
    as a segment of 1, then one of L, is the case a decoder meets)."""
    static, eager = _cache(6, 4, same_length=same_length), _cache(6, 4, same_length=same_length,
                                                                  static=False)  # fmt: skip
    t = 0
    for qlen in (1, 1, 4, 1, 3):
        want = _visible(_write(static, t, qlen))
        step = _write(eager, t, qlen)
        if step.mask is not None:
            assert torch.equal(_visible(step), want), (t, qlen)
        t += qlen
    for a, b in zip(static.window(1), eager.window(1), strict=True):
        assert torch.equal(a, b)
