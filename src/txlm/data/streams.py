"""Stream iterators: the batches Transformer-XL's recurrence needs.

Recurrence is only correct if the memory of batch row ``b`` holds the text that really
precedes row ``b``'s current segment. So these iterators are state machines over B fixed
streams, not samplers of independent examples:

* ``StreamIterator`` lays a split into B contiguous rows. Row b is tokens
  ``[b*S, (b+1)*S]`` with ``S = (N - 1) // B`` (rows share one boundary token, used as the
  last label of row b and the first input of row b+1), and segment t+1 of a row starts where
  segment t ended. The ``(N - 1) % B`` tail tokens are left out.
* ``SentenceStreamIterator`` (lm1b) gives each row its own stream of whole sentences, in a
  fresh order every epoch; epoch e's order depends only on (seed, e).

DDP: the row layout is a function of the *global* batch size only. Rank r of W takes rows
``[r*B/W, (r+1)*B/W)``, so one process with batch 2B and two with B see the same rows, and
every rank has the same number of batches (no collective ever waits for a finished rank).

Document modes:

* ``continue`` (the paper): documents are simply concatenated; ``Batch.reset`` is None.
  The first batch of an epoch (``Batch.index == 0``) starts every row afresh: a trainer that
  wants no carry-over from the previous epoch drops its memory there.
* ``reset``: ``Batch.reset`` is a bool [b, L] tensor, True at every token that starts a
  document, and at position 0 of every row in an epoch's first batch. The model then lets
  that token and the rest of its row attend neither to memory nor to earlier tokens.
  Labels are not altered: the token after a document's last token is still predicted (from
  that document), as in ``continue`` mode, so both modes score the same tokens.

Iterating continues from the current position to the end of that epoch; the next loop
starts the next epoch. For evaluation, build a fresh iterator (or call ``set_epoch(0)``) for
every pass over a split. The last batch of an epoch may be shorter than ``tgt_len`` so that
every token of the rows is used.

``state_dict()`` records (epoch, next batch) and the settings that define the layout; a
resumed iterator yields exactly the batches an uninterrupted one would, also with another
world size. The token array stays where it is (usually a read-only memmap); only batches are
copied, and only then moved to ``device``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from txlm.errors import DataError

STATE_VERSION = 1
VARLEN_STD = 5  # the original's std of the segment length when varlen is on
VARLEN_HALF_P = 0.05  # probability that a segment's mean length is tgt_len / 2
VARLEN_MAX_EXTRA = 3 * VARLEN_STD  # lengths are capped at tgt_len + 3 std


@dataclass
class Batch:
    input_ids: torch.Tensor  # [b, L] int64
    labels: torch.Tensor  # [b, L] int64; labels[:, t] follows input_ids[:, t]
    reset: torch.Tensor | None  # [b, L] bool in reset mode, else None
    epoch: int = 0
    index: int = 0  # position of this batch in its epoch; 0 = every row starts afresh
    # [b, L] the labels as read, on the host: what a step may count without reading
    # anything back from the device
    host_labels: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


class _SegmentStream:
    """What both iterators share: segment schedule, sharding arithmetic, position, state."""

    kind = "base"

    def __init__(
        self,
        n_tokens: int,
        batch_size: int,
        tgt_len: int,
        *,
        doc_mode: str,
        rank: int,
        world_size: int,
        varlen: bool,
        seed: int,
        device: str | torch.device,
    ) -> None:
        if batch_size < 1 or tgt_len < 1:
            raise DataError(f"batch_size and tgt_len must be >= 1 (got {batch_size}, {tgt_len})")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in a world of size {world_size}")
        if batch_size % world_size:
            raise DataError(
                f"global batch size {batch_size} does not divide over {world_size} processes"
            )
        if doc_mode not in ("continue", "reset"):
            raise DataError(f"doc_mode must be 'continue' or 'reset', not {doc_mode!r}")
        self.n_tokens = int(n_tokens)
        self.batch_size = batch_size
        self.tgt_len = tgt_len
        self.doc_mode = doc_mode
        self.rank = rank
        self.world_size = world_size
        self.varlen = varlen
        self.seed = seed
        self.device = torch.device(device)
        per = batch_size // world_size
        self.local_rows = slice(rank * per, (rank + 1) * per)
        self._epoch = 0
        self._batch = 0
        self._cuts_cache: tuple[int, np.ndarray] | None = None

    # -- the segment schedule ---------------------------------------------------------------

    def _row_length(self, epoch: int) -> int:
        """Input positions per row in this epoch."""
        raise NotImplementedError

    def _cuts(self, epoch: int) -> np.ndarray:
        """Segment boundaries [0, ..., S] within a row; the same for every row and rank."""
        if self._cuts_cache is not None and self._cuts_cache[0] == epoch:
            return self._cuts_cache[1]
        s = self._row_length(epoch)
        if not self.varlen:
            cuts = np.append(np.arange(0, s, self.tgt_len, dtype=np.int64), s)
        else:
            # The original's varlen: mostly tgt_len, sometimes tgt_len/2, jittered, so that
            # segment starts move relative to the text between epochs. Drawn from
            # (seed, epoch) alone, hence reproducible on resume and equal on every rank.
            rng = np.random.default_rng([self.seed, epoch, 1])
            lo = max(1, min(5, self.tgt_len))
            hi = self.tgt_len + VARLEN_MAX_EXTRA
            pos, out = 0, [0]
            while pos < s:
                mean = self.tgt_len / 2 if rng.random() < VARLEN_HALF_P else self.tgt_len
                n = int(np.clip(int(rng.normal(mean, VARLEN_STD)), lo, hi))
                pos = min(s, pos + n)
                out.append(pos)
            cuts = np.asarray(out, dtype=np.int64)
        self._cuts_cache = (epoch, cuts)
        return cuts

    def __len__(self) -> int:
        """Batches in the current epoch (the same on every rank)."""
        return len(self._cuts(self._epoch)) - 1

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch at the next iteration."""
        self._epoch = int(epoch)
        self._batch = 0

    def __iter__(self) -> Iterator[Batch]:
        if self._batch >= len(self):  # the previous pass finished: move on to the next epoch
            self._epoch += 1
            self._batch = 0
        epoch = self._epoch
        cuts = self._cuts(epoch)
        while self._batch < len(cuts) - 1 and self._epoch == epoch:
            i = self._batch
            batch = self._make(epoch, i, int(cuts[i]), int(cuts[i + 1]))
            self._batch = i + 1  # advanced before yielding: state_dict() counts it as consumed
            yield batch

    def _make(self, epoch: int, index: int, a: int, b: int) -> Batch:
        raise NotImplementedError

    def _to_batch(
        self, chunk: np.ndarray, flags: np.ndarray | None, epoch: int, index: int
    ) -> Batch:
        ids = np.ascontiguousarray(chunk, dtype=np.int64)
        data = torch.from_numpy(ids)
        non_blocking = self.device.type == "cuda"
        # contiguous, so that callers may .view() them (a shifted slice is not)
        x = data[:, :-1].contiguous().to(self.device, non_blocking=non_blocking)
        y = data[:, 1:].contiguous().to(self.device, non_blocking=non_blocking)
        reset = None
        if flags is not None:
            reset = torch.from_numpy(flags).to(self.device, non_blocking=non_blocking)
        return Batch(x, y, reset, epoch=epoch, index=index, host_labels=ids[:, 1:])

    # -- resume ---------------------------------------------------------------------------

    def _layout(self) -> dict:
        return {
            "kind": self.kind,
            "n_tokens": self.n_tokens,
            "batch_size": self.batch_size,
            "tgt_len": self.tgt_len,
            "varlen": self.varlen,
            "seed": self.seed,
        }

    def state_dict(self) -> dict:
        """JSON-serialisable position; world size and rank may differ when loading it."""
        return {
            "version": STATE_VERSION,
            **self._layout(),
            "doc_mode": self.doc_mode,
            "epoch": self._epoch,
            "batch": self._batch,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(f"unsupported iterator state version {state.get('version')!r}")
        mismatched = [k for k, v in self._layout().items() if state.get(k) != v]
        if mismatched:
            diffs = ", ".join(
                f"{k}: saved {state.get(k)!r}, now {getattr(self, k, None)!r}" for k in mismatched
            )
            raise DataError(f"iterator state does not match this data or setup ({diffs})")
        self._epoch = int(state["epoch"])
        self._batch = int(state["batch"])


def _check_doc_starts(doc_starts: np.ndarray | None, n: int, needed: bool) -> np.ndarray | None:
    if doc_starts is None:
        if needed:
            raise DataError("doc_mode='reset' needs doc_starts (document offsets)")
        return None
    ds = np.asarray(doc_starts, dtype=np.int64)
    if ds.ndim != 1 or (len(ds) and (ds[0] < 0 or ds[-1] >= n)) or np.any(np.diff(ds) <= 0):
        raise DataError("doc_starts must be strictly increasing offsets inside the split")
    return ds


class StreamIterator(_SegmentStream):
    """Ordered streams over one split; see the module docstring for the contract."""

    kind = "stream"

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        tgt_len: int,
        *,
        doc_starts: np.ndarray | None = None,
        doc_mode: str = "continue",
        rank: int = 0,
        world_size: int = 1,
        varlen: bool = False,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        if tokens.ndim != 1:
            raise DataError("tokens must be a flat array of token ids")
        super().__init__(
            len(tokens),
            batch_size,
            tgt_len,
            doc_mode=doc_mode,
            rank=rank,
            world_size=world_size,
            varlen=varlen,
            seed=seed,
            device=device,
        )
        self.tokens = tokens
        self.row_len = (len(tokens) - 1) // batch_size
        if self.row_len < tgt_len:
            raise DataError(
                f"the split has {len(tokens)} tokens, too few for one {tgt_len}-token segment in "
                f"each of {batch_size} rows (needs at least {batch_size * tgt_len + 1})"
            )
        self.doc_starts = _check_doc_starts(doc_starts, len(tokens), doc_mode == "reset")
        self.row_starts = np.arange(batch_size, dtype=np.int64)[self.local_rows] * self.row_len

    def _row_length(self, epoch: int) -> int:
        return self.row_len

    def _make(self, epoch: int, index: int, a: int, b: int) -> Batch:
        n = b - a
        chunk = np.stack([self.tokens[s + a : s + b + 1] for s in self.row_starts.tolist()])
        flags = None
        if self.doc_mode == "reset":
            assert self.doc_starts is not None
            flags = np.zeros((len(self.row_starts), n), dtype=bool)
            lo = self.row_starts + a
            first = np.searchsorted(self.doc_starts, lo, side="left")
            last = np.searchsorted(self.doc_starts, lo + n, side="left")
            for row in range(len(lo)):
                flags[row, self.doc_starts[first[row] : last[row]] - lo[row]] = True
            if a == 0:
                flags[:, 0] = True  # a row's first segment has no true preceding text
        return self._to_batch(chunk, flags, epoch, index)


class SentenceStreamIterator(_SegmentStream):
    """lm1b: every row its own stream of whole sentences, shuffled afresh each epoch.

    Each epoch draws a permutation of all sentences from (seed, epoch) and deals it into B
    equal runs of K = n_sentences // B sentences (the n % B left over sit out this epoch; a
    different set next epoch). Row b reads its run as one continuous stream; an epoch ends
    when the shortest row runs out, so every row and rank has the same number of batches.
    """

    kind = "sentences"

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        tgt_len: int,
        *,
        doc_starts: np.ndarray | None = None,
        doc_mode: str = "continue",
        rank: int = 0,
        world_size: int = 1,
        varlen: bool = False,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        if tokens.ndim != 1:
            raise DataError("tokens must be a flat array of token ids")
        super().__init__(
            len(tokens),
            batch_size,
            tgt_len,
            doc_mode=doc_mode,
            rank=rank,
            world_size=world_size,
            varlen=varlen,
            seed=seed,
            device=device,
        )
        ds = _check_doc_starts(doc_starts, len(tokens), True)
        assert ds is not None
        if len(ds) == 0 or ds[0] != 0:
            raise DataError("sentence starts must begin at offset 0")
        self.tokens = tokens
        self.sent_starts = ds
        self.sent_lens = np.diff(np.append(ds, len(tokens)))
        self.per_row = len(ds) // batch_size
        if self.per_row < 1:
            raise DataError(f"{len(ds)} sentences are too few for {batch_size} rows")
        self._plan_cache: tuple[int, np.ndarray, np.ndarray, int] | None = None
        if self._row_length(0) < tgt_len:
            raise DataError(
                f"rows of {self.per_row} sentences are too short for one {tgt_len}-token segment"
            )

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, int]:
        """This rank's sentence ids [b, K], their cumulative ends [b, K], and S."""
        if self._plan_cache is not None and self._plan_cache[0] == epoch:
            return self._plan_cache[1], self._plan_cache[2], self._plan_cache[3]
        rng = np.random.default_rng([self.seed, epoch, 2])
        k = self.per_row
        order = rng.permutation(len(self.sent_starts))[: k * self.batch_size]
        order = order.reshape(self.batch_size, k)
        lens = self.sent_lens[order]
        s = int(lens.sum(axis=1).min()) - 1  # the last token of the shortest row is a label
        mine = order[self.local_rows]
        ends = np.cumsum(lens[self.local_rows], axis=1)
        self._plan_cache = (epoch, mine, ends, s)
        return mine, ends, s

    def _row_length(self, epoch: int) -> int:
        return self._plan(epoch)[2]

    def _make(self, epoch: int, index: int, a: int, b: int) -> Batch:
        order, ends, _ = self._plan(epoch)
        pos = np.arange(a, b + 1, dtype=np.int64)
        rows = []
        flags = np.zeros((len(order), b - a), dtype=bool) if self.doc_mode == "reset" else None
        for r in range(len(order)):
            j = np.searchsorted(ends[r], pos, side="right")  # sentence holding each position
            offset = pos - (ends[r][j] - self.sent_lens[order[r][j]])
            rows.append(np.asarray(self.tokens[self.sent_starts[order[r][j]] + offset]))
            if flags is not None:
                flags[r] = offset[:-1] == 0
        if flags is not None and a == 0:
            flags[:, 0] = True
        return self._to_batch(np.stack(rows), flags, epoch, index)
