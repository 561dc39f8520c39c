"""The folder a prepared dataset is built in: locked while it is built, renamed into place.

A dataset is built in a temporary folder next to its final place and renamed into place only
when complete, so an error or an interrupt never damages an earlier prepared copy. A build
holds a lock on its temporary folder (``DATA_DIR/.NAME.tmp-XXXX/.lock``) while it runs; the
next build of the same dataset removes such folders whose lock is free, i.e. those of a killed
build.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def building(data_dir: Path, out: Path) -> Iterator[Path]:
    """A locked temporary folder beside ``out`` to build a dataset in. When the block ends
    cleanly it replaces ``out`` in one rename; when it raises, it is removed and ``out`` stays
    as it was (a dead process's folder is removed by the next build: see TEMP_LOCK)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_folders(data_dir, out.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=data_dir))
    os.chmod(tmp, 0o755)  # mkdtemp creates 0700
    lock: int | None = None
    try:
        lock = _hold(tmp)
        yield tmp
        (tmp / TEMP_LOCK).unlink()  # not part of the dataset; the fd keeps the lock until done
        _swap_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if lock is not None:
            os.close(lock)


# A build in progress holds an flock on TMP/.lock; the kernel drops it when the process dies,
# however it dies (SIGKILL, power loss). So a temp folder of this dataset whose lock can be
# taken, or that has no lock file, belongs to a dead prepare: the next prepare removes it.
TEMP_LOCK = ".lock"


def _hold(tmp: Path) -> int:
    fd = os.open(tmp / TEMP_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    # Without flock (some network file systems) the folder simply looks in use to others.
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _remove_stale_temp_folders(data_dir: Path, name: str) -> None:
    """Remove DATA_DIR/.NAME.tmp-* left by a prepare of the same dataset that was killed."""
    for folder in data_dir.glob(f".{name}.tmp-*"):
        if not folder.is_dir():
            continue
        try:
            fd = os.open(folder / TEMP_LOCK, os.O_RDWR)
        # No lock file: killed before it made one. (A live build in the microseconds between
        # mkdtemp and its lock would lose its folder and fail with an error; nothing in place
        # is touched.)
        except FileNotFoundError:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live prepare holds it (or flock is unsupported): leave it alone
        else:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Two renames; the old copy is deleted only once the new one is in place."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
