"""Progress of a long step, on stderr: a tqdm bar on a terminal; into a log (stderr
redirected), a plain line at every tenth of the work or every ``every_s`` seconds, whichever
comes first. A step that ends within ``quiet_s`` prints no progress line at all: its result
line says all there is (ten lines for a split read in 0.1 s are noise).

    with Progress("valid", total=n_segments, unit="seg") as bar:
        for ...:
            bar.update()

``clock`` (default: ``_now``) is the hook a test drives, never the wall clock.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


class Progress:
    def __init__(
        self,
        desc: str,
        total: int | None,
        *,
        unit: str = "it",
        initial: int = 0,
        enabled: bool = True,
        stream: TextIO | None = None,
        clock: Callable[[], float] | None = None,
        quiet_s: float = 1.0,
        every_s: float = 30.0,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.clock = clock if clock is not None else (lambda: _now())  # looked up per call
        self.quiet_s, self.every_s = quiet_s, every_s
        self.done = initial  # a resumed download's bytes already there
        self.bar: Any = None
        self._start = self._last = self.clock()
        self._tenth = initial * 10 // total if total else 0
        if enabled and _is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc=desc, unit=unit, leave=False,
                dynamic_ncols=True, file=self.stream,
            )  # fmt: skip

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            return
        now = self.clock()
        if now - self._start < self.quiet_s:
            return
        tenth = self.done * 10 // self.total if self.total else 0
        if tenth > self._tenth or now - self._last >= self.every_s:
            self._tenth, self._last = tenth, now
            of = f"/{self.total}" if self.total else ""
            self.stream.write(
                f"{self.desc}: {self.done}{of} {self.unit}, {now - self._start:.0f}s\n"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _now() -> float:
    """The default clock (a test replaces it with one it advances per step)."""
    return time.monotonic()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
