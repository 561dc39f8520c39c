"""SIGINT/SIGTERM during training: the first asks for `last` and a clean exit, a second is
abrupt (KeyboardInterrupt)."""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StopSignals:
    received: int = 0  # signal number, 0: none
    old: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received:
            self.restore()
            raise KeyboardInterrupt
        self.received = signum
        sys.stderr.write(
            f"\ntxlm: {signal.Signals(signum).name} received: saving `last` after this step "
            "(again to stop at once)\n"
        )

    def restore(self) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)
        self.old.clear()
