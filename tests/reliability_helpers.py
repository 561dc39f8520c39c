"""Shared pieces of the reliability tests: hostile payloads and on-disk snapshots.

Not a test module (no ``test_`` prefix); the reliability tests import it by name, which works
because pytest puts each test file's directory on sys.path.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import zipfile
from pathlib import Path


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
