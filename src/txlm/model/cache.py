"""A static-shape key/value cache: what inference keeps instead of re-projecting the memory.

Dimension legend
    N  layers     B  rows     H  heads     Dh head dim     L  segment (query) length
    M  mem_len    S  slots = M + max_len (the longest segment the cache takes)

Transformer-XL's memory holds each layer's *input* hidden states and a forward projects all
of them to keys and values again. With fixed weights and no dropout (inference) those
projections never change, so the cache keeps them: per layer the keys and values of the newest
positions of every row, in a ring of S slots. Position p lives in slot p mod S; a segment of L
tokens writes its L slots first and then attends over all S, the slots it may not see masked.
Every shape is fixed once the cache exists, and the write position is a device tensor, so a
decoding step (L = 1) has the same shapes and the same operations every time: it can be
compiled once and captured in a CUDA graph.

What a query may see is the model's rule (txlm.model.mask), written on slot positions:
query at position t + i (t: the segment's first) sees key position p when
    t - M <= p <= t + i        the memory (the M newest before the segment) and the causal past
    t + i - p < M              with same_length only
    doc(p) == doc(t + i)       document ids, per row: a reset starts a new document
The position term needs the distance t + i - p per (query, slot): ``index`` [L, S], which picks
each pair's score from the per-distance scores (q + v) . W_kR R_d, d = 0 .. S-1 (``table``).

Static and eager steps. A static cache (the default) gives every step the same shapes and
operations, as compiling and graph capture need. An eager decoder (``static=False``) keeps
the write position on the host as well, so a one-token step that needs no mask (no document
ids, every written slot inside the memory) skips it: it attends over the written slots only,
and reads its position keys already in slot order from a ring table (``ring_tables``: a
slice, where the static step gathers). With same_length such a step hides at most one slot
(``CacheStep.hidden``: the oldest of a full ring). The same slots and the same arithmetic,
with a fraction of the per-token operations (what bounds a CPU step at batch 1).

The cache is made for one ``Lengths`` (txlm.model.lengths): its memory, its position table
(clamped by ``clamp_len``) and its masks (``same_length``) follow them for its whole life.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from txlm.model.lengths import Lengths
from txlm.model.mask import document_starts

_EMPTY = -(2**40)  # position of a slot never written: outside every memory window


def slot_scores(q: Tensor, keys: Tensor, index: Tensor | None) -> Tensor:
    """Queries q [B, H, L, Dh] against position keys [H, T, Dh], per (query, slot) pair:
    [B, H, L, S], pair (i, s) scored with the key of its distance ``index[i, s]`` ([L, S]);
    with no index the keys are the slots' already, in slot order (T = S).

    Per head, every row's queries meet every distance in one product, and the pairs are
    gathered from that ([B, H, L, T], then S): the keys gathered first would be
    [H, L, S, Dh], L times the table. The function takes part in torch's
    ``__torch_function__`` protocol, so a mode can compute it another way: a one-row compiled
    step gathers the keys first, as the loads of one sum per pair
    (txlm.inference.reductions)."""
    if has_torch_function((q, keys)):
        return handle_torch_function(slot_scores, (q, keys), q, keys, index)
    batch, heads, qlen, d_head = q.shape
    rows = q.transpose(0, 1).reshape(heads, batch * qlen, d_head)
    scores = torch.bmm(rows, keys.transpose(1, 2)).view(heads, batch, qlen, -1).transpose(0, 1)
    return scores if index is None else scores.gather(-1, index.expand(batch, heads, -1, -1))


@dataclass
class CacheStep:
    """One segment's step over the cache, what every layer's attention is given (made once
    per segment by ``KVCache.advance``): the slots it writes, its mask and distance index,
    and the layers' keys, values and position keys through ``update`` and ``table``."""

    cache: KVCache
    slots: Tensor  # [L] the slots this segment writes
    mask: Tensor | None  # additive 0 / -inf [L, S] or [B, 1, L, S] in the cache's dtype; None:
    # every slot of the window is visible (an eager one-token step, see KVCache.advance)
    index: Tensor | None  # [L, S] distance of each (query, slot) pair, clamped into the table;
    # None: the position keys come in slot order (``ring``) and need no gather
    width: int  # slots the queries attend over: S, or the W < S written ones (eager only)
    ring: int = 0  # eager one-token step: where its slot-ordered keys start in ``ring_tables``
    hidden: int | None = None  # eager one-token step with same_length: the one slot it may
    # not see (the oldest of a full ring), None when it sees every written slot
    traced: bool = False  # made inside a torch.compile trace: how ``update`` writes
    # (decided once a segment, not per layer)

    def table(self, layer: int) -> Tensor | None:
        """Layer ``layer``'s position keys (None for absolute encodings): of distances
        0 .. S-1, [H, S, Dh], to be gathered by ``index``; or, when the index is None, those
        of the W slots in slot order, [H, W, Dh]."""
        cache = self.cache
        if cache.tables is None:
            return None
        if self.index is None:
            return cache.ring_tables[layer].narrow(1, self.ring, self.width)
        return cache.tables[layer]

    def update(self, layer: int, kv: Tensor) -> tuple[Tensor, Tensor]:
        """Store this segment's keys and values of layer ``layer``, ``kv`` [2, B, H, L, Dh]
        (one tensor: one write for both); returns the keys and values of the slots it attends
        over, [B, H, S or W, Dh] each (gpt-fast's ``k, v = cache.update(...)``)."""
        cache = self.cache
        buffer = cache.kv[layer]  # [2, B, H, S, Dh]
        kv = kv if kv.dtype == buffer.dtype else kv.to(buffer.dtype)
        if self.traced:
            # Traced, a write into a view of the buffer becomes a copy of the whole layer
            # (functionalisation), every layer and segment; indexing the buffer itself with
            # tensors (layer, slots) is an in-place scatter of the written rows only. Eagerly
            # the view's index_copy_ is the cheaper call.
            index = cache.layer_ids.narrow(0, layer, 1)
            cache.kv[index, :, :, :, self.slots] = kv.permute(3, 0, 1, 2, 4)  # [L, 2, B, H, Dh]
        else:
            buffer.index_copy_(3, self.slots, kv)
        if self.width < cache.slots:
            buffer = buffer.narrow(3, 0, self.width)
        return buffer.unbind(0)


class KVCache:
    """Per-layer keys and values ``kv`` [N, 2, B, H, S, Dh] of the newest positions (one
    buffer, so a step stores both with one copy per layer), plus their positions and
    document ids; ``tables`` holds each layer's position keys [H, S, Dh] for the distances
    0 .. S-1, built once (``ensure_tables``)."""

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_head: int,
        d_head: int,
        *,
        lengths: Lengths,
        max_len: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        static: bool = True,
    ) -> None:
        self.lengths = lengths
        mem_len, max_len = lengths.mem_len, lengths.tgt_len if max_len is None else max_len
        self.mem_len, self.max_len = mem_len, max_len
        self.slots = mem_len + max_len
        self.static = static
        shape = (n_layer, 2, batch, n_head, self.slots, d_head)
        # zeros, not empty: a masked slot still enters the products (0 weight x finite value)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.full((self.slots,), _EMPTY, dtype=torch.long, device=device)
        self.doc = torch.zeros(batch, self.slots, dtype=torch.long, device=device)
        self.open_doc = torch.zeros(batch, dtype=torch.long, device=device)
        self.next_pos = torch.zeros((), dtype=torch.long, device=device)  # position t
        self.per_row = False  # True once a reset was given: the mask is per row from then on
        self.tables: list[Tensor] | None = None
        self.ring_tables: list[Tensor] = []  # eager caches: see ensure_tables
        self.written = 0  # eager caches: next_pos on the host (a static step never reads it)
        self._stale = False  # eager caches: pos / next_pos lag ``written`` (see _sync)
        self._slot_ids = torch.arange(self.slots, device=device)
        self.layer_ids = torch.arange(n_layer, device=device)  # index tensors (CacheStep.update)
        self.padding = 0  # rows at the end that hold no sequence (``pad_rows``)

    @property
    def batch(self) -> int:
        """Rows held, padding included."""
        return self.kv.size(2)

    @property
    def rows(self) -> int:
        """Rows that hold a sequence: the first ``batch - padding``."""
        return self.kv.size(2) - self.padding

    def ensure_tables(self, build: Callable[[int, int], list[Tensor]]) -> list[Tensor]:
        """Per layer [H, S, Dh] position keys of distances 0 .. S-1 clamped at the cache's
        clamp_len (``build(S, clamp_len)``), made once."""
        if self.tables is None:
            tables = build(self.slots, self.lengths.clamp_len)
            self.tables = [t.to(self.kv.dtype) for t in tables]
        if not self.static and not self.ring_tables:
            # Column c holds distance (S - 1 - c) mod S, c < 2S - 1: the query in slot j sees
            # slot i at distance (j - i) mod S, so columns S-1-j .. 2S-2-j are the keys of
            # slots 0 .. S-1 in order (a slice per step instead of a gather per layer).
            cols = (self.slots - 1 - torch.arange(2 * self.slots - 1)) % self.slots
            cols = cols.to(self.pos.device)
            self.ring_tables = [t.index_select(1, cols) for t in self.tables]
        return self.tables

    def unmasked(self, qlen: int, reset: Tensor | None) -> bool:
        """Whether ``advance(qlen, reset)`` of this (eager) cache gives an unmasked step: one
        query whose written slots are all inside its memory window (a ring of M + 1, or at
        most M + 1 positions written), no document ids; then the written slots 0 .. W-1 are
        what it sees, less the one at distance M under same_length (``CacheStep.hidden``)."""
        return (
            not self.static and qlen == 1 and reset is None and not self.per_row
            and (self.slots == self.mem_len + 1 or self.written <= self.mem_len)
        )  # fmt: skip

    def advance(self, qlen: int, reset: Tensor | None) -> CacheStep:
        """Take the next ``qlen`` positions: their slots, document ids, and the mask and
        distance index every layer of this segment uses. Device work only (no host sync)."""
        if qlen > self.max_len:
            raise ValueError(
                f"a segment of {qlen} tokens does not fit a cache made for {self.max_len}"
            )
        same_length = self.lengths.same_length
        if not self.static:
            unmasked = self.unmasked(qlen, reset)
            if not unmasked:  # the bookkeeping of the positions before this segment
                self._sync()
            t = self.written
            self.written += qlen
            if unmasked:
                # pos / next_pos follow from ``written`` (position p sits in slot p mod S):
                # brought up to date only when something reads them (``_sync``), so an
                # unmasked step writes no bookkeeping to the device
                slot = t % self.slots
                self._stale = True
                width = min(t + 1, self.slots)
                # same_length: the query sees the M newest positions, itself included
                hidden = (
                    (t - self.mem_len) % self.slots if same_length and t >= self.mem_len else None
                )
                return CacheStep(
                    self, self._slot_ids.narrow(0, slot, 1), None, None, width,
                    self.slots - 1 - slot, hidden,
                )  # fmt: skip
        device = self.pos.device
        qpos = self.next_pos + torch.arange(qlen, device=device)  # [L]
        slots = qpos % self.slots
        first = self.next_pos - self.mem_len  # oldest memory position
        self.pos.index_copy_(0, slots, qpos)
        dist = qpos[:, None] - self.pos[None, :]  # [L, S]
        visible = (dist >= 0) & (self.pos >= first)[None, :]
        if same_length:
            visible = visible & (dist < self.mem_len)
        if reset is not None or self.per_row:
            self.per_row = True
            doc = self.open_doc[:, None].expand(-1, qlen)
            if reset is not None:  # a start makes its token and every later one a new document
                doc = doc + document_starts(reset, qlen).to(device).long().cumsum(1)
            self.doc.index_copy_(1, slots, doc)
            self.open_doc.copy_(doc[:, -1])
            same_doc = self.doc[:, None, :] == doc[:, :, None]  # [B, L, S]
            visible = (visible & same_doc)[:, None]
        self.next_pos.add_(qlen)
        # one 0 / -inf bias for every layer of the segment
        mask = torch.zeros(visible.shape, dtype=self.kv.dtype, device=device)
        mask.masked_fill_(~visible, float("-inf"))
        index = dist.clamp(0, self.slots - 1)
        traced = torch.compiler.is_compiling()
        return CacheStep(self, slots, mask, index, self.slots, traced=traced)

    def _sync(self) -> None:
        """Bring the device's pos / next_pos up to ``written`` after unmasked eager steps:
        slot s holds the newest position p < written with p = s mod S (none: empty)."""
        if not self._stale:
            return
        self._stale = False
        end = self.written
        with torch.inference_mode():  # (the decoder's cache is an inference tensor)
            last = end - 1 - (end - 1 - self._slot_ids) % self.slots  # [S]
            self.pos.copy_(torch.where(last >= 0, last, torch.full_like(last, _EMPTY)))
            self.next_pos.fill_(end)

    @property
    def length(self) -> int:
        """Positions in the memory now, M' = min(written, mem_len). Reads the device: not for
        use inside a step."""
        self._sync()
        return min(int(self.next_pos), self.mem_len)

    def _memory_slots(self) -> Tensor:
        """[M'] the memory's slots, oldest first."""
        self._sync()
        end = int(self.next_pos)
        return torch.arange(end - self.length, end, device=self.pos.device) % self.slots

    def window(self, layer: int) -> tuple[Tensor, Tensor]:
        """The memory's keys and values [B, H, M', Dh], oldest first: for inspection and
        tests (the forward reads the slots where they are)."""
        order = self._memory_slots()
        return self.kv[layer, 0].index_select(2, order), self.kv[layer, 1].index_select(2, order)

    def memory_valid(self) -> Tensor:
        """bool [B, M']: which memory positions the next token may attend to (its document's)."""
        return self.doc[:, self._memory_slots()] == self.open_doc[:, None]

    def resized(self, max_len: int) -> KVCache:
        """The same memory in a cache for segments of at most ``max_len`` (e.g. 1 to decode
        after reading a prompt in longer segments): copies the M' newest positions once."""
        n_layer, _, batch, n_head, _, d_head = self.kv.shape
        new = KVCache(
            n_layer, batch, n_head, d_head, lengths=self.lengths, max_len=max_len,
            device=self.kv.device, dtype=self.kv.dtype, static=self.static,
        )  # fmt: skip
        self._sync()
        end = int(self.next_pos)
        new.written = end
        src = torch.arange(end - self.length, end, device=self.pos.device)
        dst = src % new.slots
        src = src % self.slots
        new.kv[..., dst, :] = self.kv[..., src, :]
        new.pos[dst] = self.pos[src]
        new.doc[:, dst] = self.doc[:, src]
        new.open_doc.copy_(self.open_doc)
        new.next_pos.copy_(self.next_pos)
        new.per_row = self.per_row
        new.padding = self.padding
        if self.tables is not None and new.slots <= self.slots:  # distances 0 .. S'-1: a prefix
            new.tables = [t[:, : new.slots].contiguous() for t in self.tables]
        return new

    def repeat_rows(self, repeats: int) -> None:
        """Each row becomes ``repeats`` consecutive rows (row b's copies: b * repeats ..), its
        keys, values and document state with it: a prompt read once, decoded as several
        samples. Positions and tables are shared by all rows and stay."""
        self._unpad()
        self.kv = self.kv.repeat_interleave(repeats, dim=2)  # [N, 2, B, H, S, Dh]
        self.doc = self.doc.repeat_interleave(repeats, dim=0)
        self.open_doc = self.open_doc.repeat_interleave(repeats, dim=0)

    def keep_rows(self, index: Tensor) -> None:
        """Keep only the rows ``index`` [B'] (in that order; rows holding a sequence, padding
        dropped), their keys, values and document state: rows that leave a batch. Positions
        and tables are shared and stay."""
        index = index.to(self.kv.device)
        self.kv = self.kv.index_select(2, index)
        self.doc = self.doc.index_select(0, index)
        self.open_doc = self.open_doc.index_select(0, index)
        self.padding = 0

    def pad_rows(self, batch: int) -> None:
        """Hold ``batch`` rows, the ones past ``rows`` padding: copies of row 0 (a sequence
        like any other, so a step over them is finite; rows never mix, so they change no real
        row's result, and their outputs are to be dropped). What a step compiled for a batch
        of ``batch`` rows runs over (txlm.inference.compiled: batch buckets)."""
        rows = self.rows
        if batch == self.batch:
            return
        if not rows <= batch:
            raise ValueError(f"{rows} rows do not fit a padded batch of {batch}")
        index = torch.arange(batch, device=self.kv.device)
        self.keep_rows(index.masked_fill(index >= rows, 0))
        self.padding = batch - rows

    def _unpad(self) -> None:
        if self.padding:
            self.keep_rows(torch.arange(self.rows, device=self.kv.device))

    def splice(self, other: KVCache) -> None:
        """Append ``other``'s rows to this cache, their memory aligned to this cache's
        position: rows that join a batch between steps (continuous batching).

        Only distances enter attention (relative positions), so ``other``'s M' newest
        positions u - M' .. u - 1 are written to the slots of this cache's positions
        t - M' .. t - 1; the slots before them are hidden from the new rows by their
        document ids, and slots this cache never wrote get positions (older than t, slot
        order kept) hidden from every old row the same way. Each row then sees exactly the
        keys it saw alone, at the same distances. Both caches: one-token (eager) caches of
        the same lengths, dtype and device."""
        if other.slots != self.slots or other.lengths != self.lengths:
            raise ValueError("splice needs caches of the same lengths and slots")
        if (other.kv.dtype, other.static) != (self.kv.dtype, self.static):
            raise ValueError("splice needs caches of the same dtype, both static or neither")
        self._unpad()
        other._unpad()
        self._sync()
        other._sync()
        t, u, m = int(self.next_pos), int(other.next_pos), other.length
        slot_ids = self._slot_ids
        never = self.pos == _EMPTY
        # every slot a position: the newest p < t with p = slot mod S (negative if unwritten)
        self.pos.copy_(t - 1 - (t - 1 - slot_ids) % self.slots)
        self.doc[:, never] = self.open_doc[:, None] - 1
        src = torch.arange(u - m, u, device=self.pos.device)
        dst = (src - u + t) % self.slots
        src = src % other.slots
        rows = other.batch
        kv = torch.zeros_like(self.kv[:, :, :1]).expand(-1, -1, rows, -1, -1, -1).clone()
        kv[..., dst, :] = other.kv[..., src, :]
        doc = (other.open_doc[:, None] - 1).expand(rows, self.slots).clone()
        doc[:, dst] = other.doc[:, src]
        self.kv = torch.cat([self.kv, kv], dim=2)
        self.doc = torch.cat([self.doc, doc], dim=0)
        self.open_doc = torch.cat([self.open_doc, other.open_doc], dim=0)
        self.per_row = True  # the rows' histories differ: the mask is per row from now on
