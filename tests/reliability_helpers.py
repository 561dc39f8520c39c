"""Shared pieces of the reliability tests: hostile payloads and on-disk snapshots.

Not a test module (no ``test_`` prefix); the reliability tests import it by name, which works
because pytest puts each test file's directory on sys.path.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

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
    """Client of the fork server in reliability_cli_runner.py (one child at a time)."""

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


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TXLM_DATA_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"  # `convert --from hf NAME` must never reach the real Hub
    return env
