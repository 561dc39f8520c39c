"""Stop strings: where a row's generated text reaches one, and what of it is returned.

API (stable; txlm.inference.generate, ``txlm generate`` and the server build on it)
    ``StopMatcher(stops)``: ``feed(text) -> int | None``, given the row's generated text so
        far (it only grows), the index where the first stop string begins once one has
        appeared, else None; each call looks only at the text that is new since the last
        (and the ``longest - 1`` characters before it). ``safe(text)``: how much of it can be
        shown now (nothing that may turn out to begin a stop string).
    ``Continuation(decode, prompt, stops=(), stop_id=None)``: one row's generated ids and
        their text: ``push(id) -> done``; ``text()``, ``kept_ids()``: what is returned.

What is returned when a stop string appears: the text up to the first occurrence of a stop
string, the stop string excluded; the ids are the longest prefix of the generated ids whose
text ends at or before that point (the token that completes the stop string is never among
them; one that holds the start of the stop string after some text of its own is dropped with
that text, so ``decode(kept_ids())`` is ``text()`` or a prefix of it). Stop strings are
matched in the generated text only, not in the prompt. A row that draws ``stop_id`` ends
with it, as before stop strings (its ids and text include it).

The generated text is the decoding of prompt + new ids minus the prompt's decoding (a
word-level vocabulary joins words with spaces; a byte-level one assembles UTF-8), without a
trailing incomplete UTF-8 sequence while the row is still growing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from txlm.errors import ConfigError

Decode = Callable[[list[int]], str]


class StopMatcher:
    """The first stop string in a text that only grows, found incrementally."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        if not self.stops or not all(isinstance(s, str) and s for s in self.stops):
            raise ConfigError(f"stop strings must be non-empty text, got {list(stops)!r}")
        self.longest = max(len(s) for s in self.stops)
        self.checked = 0  # the text's length at the last call
        self.at: int | None = None

    def feed(self, text: str) -> int | None:
        """Where the first stop string begins in ``text`` (the row's generated text so far),
        or None. An occurrence that was not whole at the last call ends past ``checked``, so
        it begins at ``checked - longest + 1`` or later: only that tail is searched."""
        if self.at is None:
            lo = max(0, self.checked - self.longest + 1)
            hits = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
            self.checked = len(text)
            if hits:
                self.at = min(hits)
        return self.at

    def safe(self, text: str) -> int:
        """How many characters of ``text`` can be shown: up to a stop string found, else all
        but the longest tail that begins some stop string (it may yet complete one)."""
        at = self.feed(text)
        if at is not None:
            return at
        for n in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - n
        return len(text)


class Continuation:
    """One row's generated ids and text, ended by a stop string or by ``stop_id``."""

    def __init__(
        self,
        decode: Decode | None,
        prompt: Sequence[int],
        stops: Sequence[str] = (),
        stop_id: int | None = None,
    ) -> None:
        if stops and decode is None:
            raise ConfigError("stop strings need the vocabulary to decode with (vocab=)")
        self.decode, self.prompt, self.stop_id = decode, list(prompt), stop_id
        self.base = decode(self.prompt) if decode is not None else ""
        self.matcher = StopMatcher(stops) if stops else None
        self.ids: list[int] = []
        self.done = False

    def _text_of(self, ids: list[int]) -> str:
        assert self.decode is not None
        return self.decode(self.prompt + ids)[len(self.base) :]

    def full_text(self) -> str:
        """The decoding of every generated id (past a stop string too)."""
        return self._text_of(self.ids)

    def push(self, tid: int) -> bool:
        """Add the next id unless the row has ended; whether it has ended now."""
        if self.done:
            return True
        self.ids.append(int(tid))
        if self.stop_id is not None and tid == self.stop_id:
            self.done = True
        # an incomplete UTF-8 sequence at the end may still complete: not matched yet
        matcher = self.matcher
        if matcher is not None and matcher.feed(self.full_text().rstrip("\ufffd")) is not None:
            self.done = True
        return self.done

    @property
    def cut(self) -> int | None:
        """Where the first stop string begins in the generated text, or None."""
        return None if self.matcher is None else self.matcher.at

    def text(self) -> str:
        """The generated text, up to (not including) the first stop string."""
        text = self.full_text()
        return text if self.cut is None else text[: self.cut]

    def kept_ids(self) -> list[int]:
        """The generated ids returned: all of them, or with a stop string the longest
        prefix whose text ends at or before it."""
        cut = self.cut
        if cut is None:
            return list(self.ids)
        n = len(self.ids) - 1  # the completing token reaches into the stop string
        while n > 0 and len(self._text_of(self.ids[:n]).rstrip("\ufffd")) > cut:
            n -= 1
        return self.ids[:n]
