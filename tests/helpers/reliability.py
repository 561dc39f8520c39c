"""Shared pieces of the reliability tests: hostile payloads, on-disk snapshots, the warm
runner, and the test side of the fault seam (``txlm.atomic``).

Imported as ``tests.helpers.reliability``.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.helpers.env import subprocess_env

HERE = Path(__file__).resolve().parent


class _CreatesFile:
    """Unpickling this object calls ``open(marker, "w")``: the file appearing proves code ran.

    A real attacker would call os.system; creating a file is the same capability (an arbitrary
    callable with arbitrary arguments, resolved by name from the pickle) and leaves evidence
    without side effects outside the test's temp directory.
    """

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def evil_pickle(marker: Path, protocol: int = 2) -> bytes:
    """A pickle that creates ``marker`` when loaded by pickle or torch.load(weights_only=False)."""
    return pickle.dumps({"state": _CreatesFile(marker)}, protocol=protocol)


def evil_os_system_pickle(marker: Path) -> bytes:
    """The classic form: protocol-0 text that calls os.system("touch MARKER") when loaded."""
    cmd = f"touch {marker}"
    return f"cposix\nsystem\n(V{cmd}\ntR.".encode()


def evil_torch_zip(marker: Path) -> bytes:
    """A torch.save-style zip archive whose data.pkl creates ``marker`` when loaded."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", evil_pickle(marker))
        z.writestr("archive/version", "3\n")
        z.writestr("archive/byteorder", "little")
    return buf.getvalue()


def snapshot(*roots: Path) -> dict[str, str]:
    """Path -> sha256 (or "<dir>") for everything under ``roots``: to prove nothing changed."""
    out: dict[str, str] = {}
    for root in roots:
        root = Path(root)
        if not root.exists():
            continue
        if root.is_file():
            out[str(root)] = hashlib.sha256(root.read_bytes()).hexdigest()
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for d in dirnames:
                out[os.path.join(dirpath, d)] = "<dir>"
            for f in filenames:
                p = Path(dirpath, f)
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "?"
    return out


# A small corpus: 40-odd distinct characters, enough lines to split into train/valid/test.
_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "hex",
    "bold",
    "jackals",
]


def corpus_text(lines: int = 400) -> str:
    out = []
    for i in range(lines):
        words = [_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(4 + i % 5)]
        out.append(" ".join(words).capitalize() + ("." if i % 3 else ","))
    return "\n".join(out) + "\n"


class Runner:
    """Client of the fork server in helpers/reliability_cli_runner.py (one child at a time)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "reliability_cli_runner.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )

    def start(
        self, argv: list[str], cwd: Path, io_dir: Path, env: dict[str, str], timeout: float = 120
    ) -> int:
        """Fork ``python -m txlm ARGV`` in ``cwd``; returns the child's pid (for signals)."""
        io_dir.mkdir(parents=True, exist_ok=True)
        self._io = io_dir
        req = {
            "argv": argv,
            "cwd": str(cwd),
            "env": env,
            "stdout": str(io_dir / "stdout"),
            "stderr": str(io_dir / "stderr"),
            "timeout": timeout,
        }
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return int(json.loads(self.proc.stdout.readline())["pid"])

    def wait(self) -> tuple[int, str, str]:
        """The exit code (minus the signal that killed it), stdout and stderr."""
        assert self.proc.stdout is not None
        rc = int(json.loads(self.proc.stdout.readline())["rc"])
        return rc, self._read("stdout"), self._read("stderr")

    def _read(self, name: str) -> str:
        # A child SIGKILLed right after the fork may die before it opens its output files.
        path = self._io / name
        return path.read_text(errors="replace") if path.exists() else ""

    def run(self, argv: list[str], cwd: Path, io_dir: Path, env: dict[str, str]) -> tuple:
        self.start(argv, cwd, io_dir, env)
        return self.wait()

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()  # the server's loop ends at EOF
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


_WARM: Runner | None = None


def warm_runner() -> Runner:
    """This test process's one warm runner, started on first use and closed at its exit."""
    global _WARM
    if _WARM is None:
        _WARM = Runner()
        atexit.register(_WARM.close)
    return _WARM


class Forked:
    """A ``python -m txlm`` child forked by the warm runner: the same code path as a real
    process without an interpreter and torch start-up per run. Popen-like where tests need it."""

    def __init__(
        self, runner: Runner, argv: list[str], cwd: Path, io_dir: Path, env: dict[str, str]
    ) -> None:
        self.runner = runner
        self.pid = runner.start(argv, cwd, io_dir, env, timeout=600)
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self.returncode is None:
            self.returncode, self._out, self._err = self.runner.wait()
        return self._out, self._err


class Pause:
    """The test side of the seam's ``pause`` action (``txlm.atomic``): two FIFOs in
    ``folder``. The child writes a line to ``ready`` when it reaches its fault point and
    then blocks until ``release`` is opened for writing. Waiting needs no timer: ``select``
    wakes when the line arrives or when the child ends (a pidfd), whichever comes first."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        os.mkfifo(folder / "ready")
        os.mkfifo(folder / "release")
        # Open before the child starts, without blocking: its write then never waits.
        self._ready = os.open(folder / "ready", os.O_RDONLY | os.O_NONBLOCK)

    def env(self, spec: str) -> dict[str, str]:
        return {"TXLM_FAULT": spec, "TXLM_FAULT_DIR": str(self.folder)}

    def wait(self, pid: int, timeout: float = 600) -> str:
        """The ``TARGET:STAGE PID`` line of the paused child; fails if it ended first."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: only a line written before counts
            ready, _, _ = select.select([self._ready], [], [], 0)
        else:
            try:
                ready, _, _ = select.select([self._ready, pidfd], [], [], timeout)
            finally:
                os.close(pidfd)
        line = os.read(self._ready, 4096).decode() if self._ready in ready else ""
        if not line:
            raise AssertionError(
                "the process ended before its pause point" if ready else "no pause in time"
            )
        return line.strip()

    def release(self) -> None:
        os.close(os.open(self.folder / "release", os.O_WRONLY))

    def close(self) -> None:
        os.close(self._ready)


def wait_for_text(path: Path, text: str, pid: int, timeout: float = 600) -> None:
    """Until ``text`` is in ``path`` (a child's output: once written it stays), failing if
    the child ends first. Each look waits on the child's pidfd, so its end wakes us."""
    pidfd = os.pidfd_open(pid)
    try:
        for _ in range(int(timeout / 0.05)):
            if path.exists() and text in path.read_text(errors="replace"):
                return
            ended, _, _ = select.select([pidfd], [], [], 0.05)
            if ended and not (path.exists() and text in path.read_text(errors="replace")):
                raise AssertionError(f"the process ended before writing {text!r} to {path}")
    finally:
        os.close(pidfd)
    raise AssertionError(f"{text!r} did not appear in {path}")
