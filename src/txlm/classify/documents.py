"""Batches of whole documents for a classifier, bucketed by length, resumable exactly.

Legend: B global batch rows (documents), W ranks, b = B / W rows of this rank, L segment
length, T = S * L the batch's padded length (S segments).

A batch holds B documents. Each row is one document, right-aligned: its padding (id 0) comes
first and ``start[i]`` is the position of its first real token, which the classifier marks
as a document start (``reset``) so no real token attends to the padding. Every row's text
therefore ends at the batch's last position, where the ``last`` pooling reads it, and the
rows are read segment by segment together.

Length buckets keep the padding small without sorting the whole epoch (which would make
every batch's lengths, and so the order of the documents, predictable): each epoch the
documents are shuffled with ``seed``; every run of ``pool`` batches' worth of them is sorted
by length and cut into batches; the batches are shuffled. A batch is padded to its own
longest document rounded up to a segment, not to the dataset's longest. An epoch whose
document count is not a multiple of B repeats the first documents of its order to fill the
last batch (every row is a real document: nothing to mask in the loss).

``state_dict()`` records (epoch, next batch) and the layout; a resumed iterator yields
exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from txlm.classify.classes import Documents
from txlm.errors import DataError

STATE_VERSION = 1
PAD_ID = 0  # any id: padded positions are masked out of attention and pooling


@dataclass
class DocumentBatch:
    input_ids: torch.Tensor  # [b, T] int64, each row's document right-aligned
    start: torch.Tensor  # [b] int64 on the host: first real position of each row
    labels: torch.Tensor  # [b] int64 label ids
    epoch: int = 0
    index: int = 0  # position of this batch in its epoch


def pad_documents(
    docs: list[np.ndarray], segment: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align ``docs`` in rows of a whole number of segments: ([b, T] ids, [b] start)."""
    longest = max(len(d) for d in docs)
    width = -(-longest // segment) * segment
    ids = np.full((len(docs), width), PAD_ID, dtype=np.int64)
    start = np.empty(len(docs), dtype=np.int64)
    for i, d in enumerate(docs):
        start[i] = width - len(d)
        ids[i, start[i] :] = d
    non_blocking = torch.device(device).type == "cuda"
    return torch.from_numpy(ids).to(device, non_blocking=non_blocking), torch.from_numpy(start)


class DocumentBatches:
    """This rank's rows of each global batch of ``documents``; iterate once per epoch."""

    def __init__(
        self,
        documents: Documents,
        batch_size: int,
        tgt_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        pool: int = 8,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch_size % world_size:
            raise DataError(f"batch_size {batch_size} is not divisible by {world_size} ranks")
        if not len(documents):
            raise DataError("no documents to batch")
        self.documents = documents
        self.batch_size, self.tgt_len, self.seed, self.pool = batch_size, tgt_len, seed, pool
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self._lengths = documents.lengths()
        self._epoch, self._batch = 0, 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        """[batches, B] document indices of ``epoch``."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        n, size = len(self.documents), self.batch_size
        order = rng.permutation(n)
        filled = -(-n // size) * size
        order = np.resize(order, filled)  # repeats the first documents to fill the last batch
        span = self.pool * size
        for a in range(0, filled, span):
            part = order[a : a + span]
            order[a : a + span] = part[np.argsort(self._lengths[part], kind="stable")]
        batches = order.reshape(-1, size)[rng.permutation(filled // size)]
        self._order_cache = (epoch, batches)
        return batches

    def __len__(self) -> int:
        return len(self._order(self._epoch))

    @property
    def epoch(self) -> int:
        return self._epoch

    def __iter__(self) -> Iterator[DocumentBatch]:
        if self._batch >= len(self):  # the previous pass finished: the next epoch
            self._epoch += 1
            self._batch = 0
        epoch = self._epoch
        batches = self._order(epoch)
        rows = slice(self.rank * self.batch_size // self.world_size,
                     (self.rank + 1) * self.batch_size // self.world_size)  # fmt: skip
        while self._batch < len(batches) and self._epoch == epoch:
            i = self._batch
            picked = batches[i, rows]
            ids, start = pad_documents(
                [self.documents.docs[j] for j in picked], self.tgt_len, self.device
            )
            labels = torch.from_numpy(self.documents.labels[picked].copy()).to(self.device)
            self._batch = i + 1  # advanced before yielding: state_dict() counts it as consumed
            yield DocumentBatch(ids, start, labels, epoch=epoch, index=i)

    # -- resume ---------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {
            "kind": "documents",
            "documents": len(self.documents),
            "tokens": int(self._lengths.sum()),
            "batch_size": self.batch_size,
            "tgt_len": self.tgt_len,
            "seed": self.seed,
            "pool": self.pool,
        }

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, **self._layout(), "epoch": self._epoch,
                "batch": self._batch}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(f"unsupported document batch state version {state.get('version')!r}")
        mismatched = [k for k, v in self._layout().items() if state.get(k) != v]
        if mismatched:
            diffs = ", ".join(f"{k}: saved {state.get(k)!r}" for k in mismatched)
            raise DataError(f"document batch state does not match this data or setup ({diffs})")
        self._epoch, self._batch = int(state["epoch"]), int(state["batch"])
