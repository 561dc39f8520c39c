"""A normal training run prints no library warnings (its torchrun runs: tests/training/test_ddp.py).

The run goes through a launcher that turns every warning attributed to txlm's own code into
an error (tests/helpers/strict_txlm.py); stderr must hold no warning at all, txlm's or
another library's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import subprocess_env
from tests.helpers.train import FAST, REPO, check_quiet, tiny_text

pytestmark = pytest.mark.slow

STRICT = REPO / "tests" / "helpers" / "strict_txlm.py"


def _args(text: Path, out: Path) -> list[str]:
    return ["train", "--preset", "debug", "--out", str(out), "--set", *FAST,
            f"data.dataset=text:{text}", "data.batch_size=4", "optim.max_steps=3",
            "eval.eval_interval=0", "eval.final_eval=false", "eval.sample_tokens=0"]  # fmt: skip


def test_one_process_run_prints_no_warning(tmp_path) -> None:
    text = tiny_text(tmp_path, n_chars=6000)
    proc = subprocess.run(
        [sys.executable, str(STRICT), *_args(text, tmp_path / "one")],
        cwd=REPO, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    check_quiet(proc)
