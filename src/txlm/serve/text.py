"""Token ids -> the text a client sees: incremental decoding, stop strings, log-prob entries."""

from __future__ import annotations

from typing import Any

from txlm.inference.stops import Continuation

# prompt tokens decoded before a row's ids, so a vocabulary whose decode joins with spaces
# (word level) or assembles bytes gives the same text as decoding the whole
_CONTEXT = 8


class RowText:
    """One row's generated text, handed out as it grows: nothing that may still become a
    stop string (a held-back suffix) or an incomplete UTF-8 sequence is emitted; at the
    first stop string the text ends before it. The row itself (its ids, the stop strings
    and the ids kept) is ``txlm.inference.stops.Continuation``, as ``txlm.generate`` has it."""

    def __init__(self, vocab: Any, prompt: list[int], stop: tuple[str, ...]) -> None:
        self.row = Continuation(vocab.decode, prompt[-_CONTEXT:], stop)
        self.emitted = 0

    @property
    def stopped(self) -> bool:
        return self.row.cut is not None

    @property
    def text(self) -> str:
        """The text so far (up to a stop string)."""
        return self.row.text()

    def push(self, tid: int, *, final: bool = False) -> str:
        """Add a token; the text it makes safe to emit (maybe empty). A stopped row takes
        no more tokens."""
        if self.stopped:
            return ""
        self.row.push(tid)
        if self.stopped or final:
            return self.flush()
        shown = self.row.full_text().rstrip("\ufffd")  # an incomplete UTF-8 sequence may complete
        matcher = self.row.matcher
        return self.flush(len(shown) if matcher is None else matcher.safe(shown))

    def kept_ids(self) -> list[int]:
        """The ids whose text is the row's text: all of them, or those before a stop
        string."""
        return self.row.kept_ids()

    def flush(self, upto: int | None = None) -> str:
        text = self.text
        upto = len(text) if upto is None else upto
        delta = text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return delta


def token_text(vocab: Any, tid: int) -> str:
    return vocab.decode([tid])


def logprob_entries(
    vocab: Any, ids: list[int], chosen: list[float | None], tops: list[dict[int, float] | None]
) -> dict[str, Any]:
    """The OpenAI completions ``logprobs`` object of tokens ``ids``: their strings, their
    log-probs (None: the first token of a text has none), the top alternatives of each, and
    each token's character offset."""
    tokens = [token_text(vocab, t) for t in ids]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": chosen,
        "top_logprobs": [
            None if top is None else {token_text(vocab, k): v for k, v in top.items()}
            for top in tops
        ],
        "text_offset": offsets,
    }
