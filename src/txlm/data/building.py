"""The folder a prepared dataset is built in: ``txlm.atomic.directory`` beside its place.

A dataset is built in a temporary folder next to its final place and swapped into place only
when complete, so an error, an interrupt or a SIGKILL never damages an earlier prepared copy
(a crash between the two renames of the swap leaves ``NAME.old``, whole). The temporary folder
(``DATA_DIR/.NAME.PID.XXXX.tmp``) of a killed build is removed by the next write in the same
data directory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from txlm import atomic


@contextlib.contextmanager
def building(data_dir: Path, out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out`` to build a dataset in. When the block ends cleanly
    it replaces ``out``; when it raises, it is removed and ``out`` stays as it was."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with atomic.directory(out) as tmp:
        yield tmp
