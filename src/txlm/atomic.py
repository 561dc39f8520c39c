"""Atomic writes: a file or a directory appears under its name whole, or not at all.

Every file txlm leaves for later (checkpoints, prepared corpora, vocabularies, records,
results) is written here.

A file NAME is written to a temp file beside it, synced, and renamed over NAME (a rename
within one folder is atomic on POSIX). A directory cannot be renamed over a non-empty one, so
a directory NAME is filled in a temp directory beside it, every file synced, and swapped in
with two renames: NAME -> NAME.old, temp -> NAME; NAME.old is removed last. A crash between
the renames leaves NAME.old, the only whole copy; ``resolve`` reads it, and the next write
keeps it until the new copy is in place. At every instant NAME or NAME.old is whole.

Temp names are ``.NAME.PID.RANDOM.tmp``: the next write into the same folder removes those
whose writer is dead (SIGKILL, power loss), every name's, not only its own (a run killed
while writing ``best`` may never write ``best`` again).

Fault seam, for tests: ``TXLM_FAULT=TARGET:STAGE:ACTION`` makes the process stop at one
named moment, deterministically instead of by a timer:

    TARGET   the name being written (``last``, ``best``, ``text-big``, ``meta.json``), or
             ``step`` for the trainer's step hook
    STAGE    made           the temp directory exists, empty
             file:NAME      NAME is written and synced in the temp directory (files are
                            synced in name order once the directory is filled)
             swap           everything is synced, before the first rename (a file: before
                            its one rename)
             between        the old copy is NAME.old, the new one not yet in place
             placed         the new copy is in place, NAME.old not yet removed
             K              (TARGET ``step``) step K has updated the weights, before that
                            step's checkpoint
    ACTION   kill           SIGKILL itself: no handler, no cleanup
             pause          write ``$TXLM_FAULT_DIR/ready``, then block until something
                            opens the FIFO ``$TXLM_FAULT_DIR/release`` for writing

It fires at most once per process. Unset, a fault point costs one environment lookup.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from txlm.errors import ConfigError

FAULT_ENV = "TXLM_FAULT"
FAULT_DIR_ENV = "TXLM_FAULT_DIR"
STAGES = ("made", "swap", "between", "placed")  # and file:NAME; K for the step hook
ACTIONS = ("kill", "pause")

_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[^.]+\.tmp$")


# -- writing -------------------------------------------------------------------------------


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to a temp file beside ``path``, sync it, rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, shared_mode())  # mkstemp makes 0600: give the mode open() would
        fault(path.name, "swap")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, data: Any) -> Path:
    """Indented, keys sorted, one trailing newline."""
    return write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def directory(target: str | Path) -> Iterator[Path]:
    """``with directory(target) as tmp:`` fill ``tmp``; when the block ends cleanly, ``tmp``
    replaces ``target`` (see the module docstring). When it raises, ``tmp`` is removed and
    ``target`` is as it was."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target.parent)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=_temp_prefix(target), suffix=".tmp"))
    old = previous(target)
    swapping = False  # target existed when the swap began
    try:
        fault(target.name, "made")
        yield tmp
        _share_tree(tmp)
        _sync_tree(tmp, target.name)
        fault(target.name, "swap")
        swapping = target.exists()
        if swapping:
            # target is whole (it only ever appears by rename), so a NAME.old beside it is a
            # leftover and can go before target is moved aside.
            if old.exists():
                shutil.rmtree(old)
            os.rename(target, old)
            fault(target.name, "between")
        # else: a crash between the renames of an earlier write left NAME.old as the only
        # whole copy; it must survive until the new one is in place.
        os.rename(tmp, target)
        _fsync_dir(target.parent)
        fault(target.name, "placed")
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if swapping and not target.exists() and old.is_dir():
            with contextlib.suppress(OSError):  # interrupted between the renames: undo
                os.rename(old, target)
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux), else
    by setting it and putting it back at once."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shared_mode(directory: bool = False) -> int:
    """The mode ``open``/``mkdir`` give a new file/folder under the umask (0644/0755 under the
    usual 022): what a user's own files get, so others (a container running as another user)
    can read a checkpoint or a corpus as far as the user allows."""
    return (0o777 if directory else 0o666) & ~umask()


def _share_tree(tmp: Path) -> None:
    """Every file and folder of ``tmp`` with the umask's mode: temp directories are made 0700,
    and writers (safetensors, ``mkstemp``) may make their files 0600."""
    files, folders = shared_mode(), shared_mode(directory=True)
    os.chmod(tmp, folders)
    for dirpath, dirnames, filenames in os.walk(tmp):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), folders)
        for f in filenames:
            path = os.path.join(dirpath, f)
            if not os.path.islink(path):
                os.chmod(path, files)


def previous(target: str | Path) -> Path:
    """NAME.old: where the old copy of a directory waits while the new one moves in."""
    target = Path(target)
    return target.with_name(target.name + ".old")


def resolve(target: str | Path) -> Path:
    """The whole copy of a directory written here: ``target``, or ``target.old`` after a
    crash between the renames (``target`` itself when neither exists)."""
    target = Path(target)
    old = previous(target)
    if not target.exists() and old.is_dir():
        return old
    return target


def remove_stale_temps(folder: Path) -> None:
    """Delete temp files and directories in ``folder`` whose writer is dead.

    A live pid (ours, or another process writing there) is left alone; so is a pid that
    exists but is not ours to signal (EPERM).
    """
    for tmp in folder.glob(".*.tmp"):
        match = _TEMP.match(tmp.name)
        if match is None:
            continue
        try:
            os.kill(int(match["pid"]), 0)
        except ProcessLookupError:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.{os.getpid()}."


def _sync_tree(tmp: Path, name: str) -> None:
    """Data on disk before a rename makes it visible: every file, in name order, then the
    folders that list them."""
    for dirpath, dirnames, filenames in os.walk(tmp):
        dirnames.sort()
        for f in sorted(filenames):
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
            rel = os.path.relpath(os.path.join(dirpath, f), tmp)
            fault(name, f"file:{rel}")
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a directory
        pass
    finally:
        os.close(fd)


# -- the fault seam ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    target: str
    stage: str
    action: str


_fired = False


def fault(target: str, stage: str) -> None:
    """Stop here if ``TXLM_FAULT`` names this target and stage (see the module docstring)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    wanted = parse_fault(spec)
    global _fired
    if _fired or wanted.target != target or wanted.stage != stage:
        return
    _fired = True
    if wanted.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    _pause(wanted)


def step_done(step: int) -> None:
    """The trainer's step hook: ``TXLM_FAULT=step:K:ACTION`` stops after step K."""
    if os.environ.get(FAULT_ENV):
        fault("step", str(step))


@functools.lru_cache(maxsize=8)
def parse_fault(spec: str) -> Fault:
    """``TARGET:STAGE:ACTION``, strictly: anything else is a ConfigError naming the value."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{FAULT_ENV}={spec!r}: {why} (expected TARGET:STAGE:ACTION)")

    target, sep1, rest = spec.partition(":")
    stage, sep2, action = rest.rpartition(":")
    if not (sep1 and sep2) or not target or not stage:
        raise bad("three fields are needed")
    if "/" in target:
        raise bad("the target is a name, not a path")
    if action not in ACTIONS:
        raise bad(f"unknown action {action!r}; one of {', '.join(ACTIONS)}")
    if target == "step":
        if not stage.isdigit() or int(stage) < 1:
            raise bad(f"the step hook's stage is a step number >= 1, not {stage!r}")
        stage = str(int(stage))
    elif stage.startswith("file:"):
        if stage == "file:":
            raise bad("file: needs a file name")
    elif stage not in STAGES:
        raise bad(f"unknown stage {stage!r}; one of {', '.join(STAGES)}, file:NAME")
    if action == "pause":
        folder = os.environ.get(FAULT_DIR_ENV)
        if not folder or not Path(folder).is_dir():
            raise bad(f"pause needs {FAULT_DIR_ENV}, an existing directory")
    return Fault(target, stage, action)


def _pause(wanted: Fault) -> None:
    """Say where we are on ``ready``, then block on the FIFO ``release``: opening a FIFO for
    reading waits until a writer opens it, so the release is an event, not a polled file.
    ``ready`` may be a FIFO the test reads (it then needs no timer either) or a plain file."""
    folder = Path(os.environ[FAULT_DIR_ENV])
    release = folder / "release"
    with contextlib.suppress(FileExistsError):
        os.mkfifo(release)
    with open(folder / "ready", "w") as f:  # after the FIFO exists: ready means releasable
        f.write(f"{wanted.target}:{wanted.stage} {os.getpid()}\n")
    with open(release, "rb"):
        pass
