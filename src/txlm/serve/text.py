"""Token ids -> the text a client sees: incremental decoding, stop strings, log-prob entries."""

from __future__ import annotations

from typing import Any

# prompt tokens decoded before a row's ids, so a vocabulary whose decode joins with spaces
# (word level) or assembles bytes gives the same text as decoding the whole
_CONTEXT = 8


class RowText:
    """One row's generated text, handed out as it grows: nothing that may still become a
    stop string (a held-back suffix) or an incomplete UTF-8 sequence is emitted; at the
    first stop string the text ends before it."""

    def __init__(self, vocab: Any, prompt: list[int], stop: tuple[str, ...]) -> None:
        self.vocab, self.context, self.stop = vocab, prompt[-_CONTEXT:], stop
        self.base = vocab.decode(self.context)
        self.ids: list[int] = []
        self.text = ""  # the text so far (up to a stop string)
        self.emitted = 0
        self.stopped = False

    def push(self, tid: int, *, final: bool = False) -> str:
        """Add a token; the text it makes safe to emit (maybe empty). A stopped row takes
        no more tokens."""
        if self.stopped:
            return ""
        self.ids.append(tid)
        text = self.vocab.decode(self.context + self.ids)[len(self.base) :]
        hits = [at for s in self.stop if (at := text.find(s)) >= 0]
        hold = 0
        if hits:
            text, self.stopped = text[: min(hits)], True
        elif not final:
            stripped = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence may complete
            tail = 0
            for s in self.stop:  # the longest end of the text that may become a stop string
                tail = max([tail] + [k for k in range(1, len(s)) if stripped.endswith(s[:k])])
            hold = len(text) - len(stripped) + tail
        self.text = text
        return self.flush(len(text) - hold)

    def kept_ids(self) -> list[int]:
        """The ids whose text is the row's text: all of them, or those before a stop
        string."""
        if not self.stopped:
            return list(self.ids)
        k = len(self.ids)
        while k and len(self.vocab.decode(self.context + self.ids[:k])) - len(self.base) > len(
            self.text
        ):
            k -= 1
        return self.ids[:k]

    def flush(self, upto: int | None = None) -> str:
        upto = len(self.text) if upto is None else upto
        delta = self.text[self.emitted : upto] if upto > self.emitted else ""
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
