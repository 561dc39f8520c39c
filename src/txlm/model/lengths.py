"""The attention lengths of a forward, as one frozen value passed to every call that needs it.

    lengths = Lengths.of(model.config, mem_len=512)     # the model's, one of them changed
    out = model(ids, mems, lengths=lengths)
    cache = model.new_cache(batch, lengths=lengths)

``tgt_len``: segment length of the loops that cut a stream (evaluation, reading a prompt) and
the longest segment a cache takes; ``mem_len``: earlier states each layer keeps (Tail_M);
``clamp_len`` > 0: relative distances beyond it share one encoding; ``same_length``: every
query attends to at most ``mem_len`` keys ending at itself.

Because positions are relative, any lengths apply to a trained model (a longer memory at
evaluation, Sec. 3.2). They are an argument, not state of the model: ``model.config`` stays
what the model was built with, and nothing a caller forgets to restore changes a later call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from txlm.errors import ConfigError


@dataclass(frozen=True)
class Lengths:
    tgt_len: int
    mem_len: int
    clamp_len: int = -1
    same_length: bool = False

    def __post_init__(self) -> None:
        t, m, c = self.tgt_len, self.mem_len, self.clamp_len
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ConfigError(f"tgt_len must be a positive integer, got {t!r}")
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ConfigError(f"mem_len must be a non-negative integer, got {m!r}")
        if not isinstance(c, int) or isinstance(c, bool):
            raise ConfigError(f"clamp_len must be an integer, got {c!r}")
        if not isinstance(self.same_length, bool):
            raise ConfigError(f"same_length must be true or false, got {self.same_length!r}")
        if self.same_length and m < 1:
            raise ConfigError("same_length needs mem_len >= 1 (the window it keeps constant)")

    @classmethod
    def of(cls, config: Any, **overrides: Any) -> Lengths:
        """The lengths of a ``ModelConfig`` (or anything with the four fields), with the
        ``overrides`` that are not None."""
        base = cls(config.tgt_len, config.mem_len, config.clamp_len, config.same_length)
        return base.replace(**overrides)

    def replace(self, **overrides: Any) -> Lengths:
        """A validated copy with the fields given (not None) changed."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(f"unknown length(s): {', '.join(sorted(unknown))}")
        changes = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **changes) if changes else self
