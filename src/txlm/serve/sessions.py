"""Sessions: a document's memory kept between requests (the per-layer keys and values of its
newest ``mem_len`` positions), so that each request reads only its new piece.

A session's text is read in segments on one grid, ``tgt_len`` tokens from its start, as
``txlm eval --file`` reads a whole text: a piece that ends inside a segment leaves that
segment's tokens (its ``tail``) to be read again, whole, with the next piece, and the memory
kept is always the one the whole text's evaluation has at the same place. So a text sent in
pieces is scored as one request over the concatenation would be. What a request generates is
part of the session's text (up to a stop string), read with the next piece.

The store evicts the least recently used idle session past ``max_sessions`` or
``max_session_bytes``; a request for an evicted or unknown session is refused (404), never
started afresh, and a session in use by one request is refused to another (409).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from txlm.model.cache import KVCache
from txlm.serve.errors import APIError

if TYPE_CHECKING:
    from txlm.inference.decode import Decoder

_FORGOTTEN = 4096  # evicted ids remembered, to say "evicted" rather than "unknown"


@dataclass
class Session:
    id: str
    cache: KVCache | None = None  # the memory after the last whole segment
    last_hidden: Tensor | None = None  # [D] the output at the last position in that memory
    tail: list[int] = field(default_factory=list)  # tokens after it, read with the next piece
    tokens: int = 0  # tokens of the session's text so far
    busy: bool = False
    created: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        kv = 0 if self.cache is None else self.cache.kv.numel() * self.cache.kv.element_size()
        hidden = 0 if self.last_hidden is None else self.last_hidden.numel() * 4
        return kv + hidden + 8 * len(self.tail)

    def describe(self) -> dict:
        return {
            "id": self.id,
            "object": "session",
            "tokens": self.tokens,
            "bytes": self.nbytes,
            "busy": self.busy,
            "created": int(self.created),
        }


class SessionStore:
    """The sessions of one server, least recently used first. Thread-safe: requests take and
    create sessions on the server's event loop, the engine gives them back from its thread."""

    def __init__(self, max_sessions: int, max_bytes: int) -> None:
        self.max_sessions, self.max_bytes = max_sessions, max_bytes
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.RLock()  # (eviction reads the total under it)
        self.on_change = lambda store: None  # metrics

    def create(self, sid: str | None = None) -> Session:
        with self._lock:
            sid = sid or uuid.uuid4().hex
            if sid in self._sessions:
                raise APIError(409, f"session '{sid}' exists already", "id")
            session = Session(sid)
            self._sessions[sid] = session
            self._evicted.pop(sid, None)
            self._evict()
        self.on_change(self)
        return session

    def _find(self, sid: str) -> Session:
        session = self._sessions.get(sid)
        if session is None:
            if sid in self._evicted:
                raise APIError(
                    404,
                    f"session '{sid}' was evicted (least recently used past --max-sessions or "
                    "--max-session-bytes): create a new one and send its text again",
                    "session",
                )
            raise APIError(404, f"no session '{sid}': create one with POST /v1/sessions",
                           "session")  # fmt: skip
        return session

    def acquire(self, sid: str) -> Session:
        """The session for one request, marked busy (409 if another request has it)."""
        with self._lock:
            session = self._find(sid)
            if session.busy:
                raise APIError(409, f"session '{sid}' is in use by another request", "session")
            session.busy = True
            self._sessions.move_to_end(sid)
            return session

    def release(self, session: Session) -> None:
        with self._lock:
            session.busy = False
            self._evict()
        self.on_change(self)

    def delete(self, sid: str) -> None:
        with self._lock:
            session = self._find(sid)
            if session.busy:
                raise APIError(409, f"session '{sid}' is in use by a request", "session")
            del self._sessions[sid]
        self.on_change(self)

    def get(self, sid: str) -> Session:
        with self._lock:
            return self._find(sid)

    def list(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._sessions.values())

    def _evict(self) -> None:
        """Drop idle sessions, oldest use first, until both caps hold (a busy one stays)."""
        while len(self._sessions) > self.max_sessions or self.total_bytes > self.max_bytes:
            idle = next((s for s in self._sessions.values() if not s.busy), None)
            if idle is None:
                return
            del self._sessions[idle.id]
            self._evicted[idle.id] = None
            while len(self._evicted) > _FORGOTTEN:
                self._evicted.popitem(last=False)


@dataclass
class Reading:
    """What reading a piece gave: the log-probs of its tokens (None where a token has no
    context), each one's top alternatives, the next token's log-probs [V], and a one-token
    cache of the memory after the piece, to decode from."""

    chosen: list[float | None]
    tops: list[dict[int, float] | None]
    next_log_probs: Tensor  # [1, V]
    cache: KVCache


def read_piece(decoder: Decoder, session: Session, piece: list[int], top: int,
               start_id: int | None) -> Reading:  # fmt: skip
    """Read ``piece`` after the session's text (see the module's docstring), updating the
    session's memory, its last output and its tail: through the decoder's model (its layers
    in the decoder's precision) and its output layer, as the decoder's own steps are read.
    ``top``: alternatives per token (0: none). Run in inference mode by the engine."""
    model, lengths, cache_dtype = decoder.net, decoder.lengths, decoder.cache_dtype
    tgt = lengths.tgt_len
    ids = session.tail + piece
    if not ids and session.last_hidden is None:  # an empty first piece: the start token
        if start_id is None:
            raise APIError(400, "empty prompt, and the vocabulary has no symbol to start from",
                           "prompt")  # fmt: skip
        piece = ids = [start_id]
    device = decoder.device
    cache = session.cache
    if cache is None:
        # (static for a compiled decoder's step, as its own prefill's: the batch is one kind)
        cache = model.new_cache(1, lengths=lengths, dtype=cache_dtype, static=decoder.static)
    whole = len(ids) // tgt * tgt
    hidden: list[Tensor] = []
    tensor = torch.tensor(ids, dtype=torch.long, device=device)[None]
    for lo in range(0, whole, tgt):
        out, _, _ = model.transform(tensor[:, lo : lo + tgt], cache=cache)
        hidden.append(out[0])
    last_whole = hidden[-1][-1] if hidden else session.last_hidden
    work = cache
    if whole < len(ids):  # a copy: the open segment is read again, whole, with the next piece
        work = cache.resized(tgt)
        out, _, _ = model.transform(tensor[:, whole:], cache=work)
        hidden.append(out[0])
    # the output that predicts each token: the one before it (a first token has none)
    before = [] if session.last_hidden is None else [session.last_hidden[None]]
    outputs = torch.cat(before + hidden) if before or hidden else None
    assert outputs is not None
    first = len(ids) - len(piece)  # the piece's first token in ``ids``
    # rows of ``outputs`` predicting ids[first:]: those at ids positions first-1 .. len-2
    shift = 1 if session.last_hidden is None else 0
    chosen: list[float | None] = []
    tops: list[dict[int, float] | None] = []
    lo = first - shift
    if lo < 0:
        chosen.append(None)
        tops.append(None)
        lo = 0
    predicting = outputs[lo : len(ids) - shift]
    targets = ids[len(ids) - len(predicting) :]
    for a in range(0, len(predicting), tgt):  # a segment's log-probs at a time: [tgt, V]
        log_probs = decoder.log_probs(predicting[a : a + tgt]).float()
        picked = torch.tensor(targets[a : a + tgt], device=device)
        chosen += log_probs.gather(1, picked[:, None])[:, 0].tolist()
        if top:
            vals, idx = log_probs.topk(min(top, log_probs.size(-1)), dim=-1)
            tops += [dict(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(),
                                                                   strict=True)]  # fmt: skip
        else:
            tops += [None] * len(picked)
    next_log_probs = decoder.log_probs(outputs[-1:]).float()
    session.cache, session.last_hidden = cache, last_whole
    session.tail = ids[whole:]
    session.tokens += len(piece)
    return Reading(chosen, tops, next_log_probs, work.resized(1))
