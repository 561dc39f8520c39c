"""A normal training run prints no library warnings, in one process and under torchrun.

The runs go through a launcher that turns every warning attributed to txlm's own code into
an error (``warnings.filterwarnings("error", module="txlm...")``): a deprecated argument
txlm passes to torch (torch warns with ``stacklevel=2``, i.e. at txlm's call) then fails the
run with a traceback instead of printing a line on every rank. stderr must hold no warning
at all, txlm's or another library's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import subprocess_env
from tests.helpers.train import FAST, REPO, tiny_text

pytestmark = pytest.mark.slow

LAUNCHER = """\
import runpy, sys, warnings
warnings.filterwarnings("error", module=r"txlm(\\.|$)")
sys.argv = ["txlm", *sys.argv[1:]]
runpy.run_module("txlm", run_name="__main__", alter_sys=True)
"""


def _args(text: Path, out: Path) -> list[str]:
    return ["train", "--preset", "debug", "--out", str(out), "--set", *FAST,
            f"data.dataset=text:{text}", "data.batch_size=4", "optim.max_steps=3",
            "eval.eval_interval=0", "eval.final_eval=false", "eval.sample_tokens=0"]  # fmt: skip


def _check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("warnings")
    (root / "launch.py").write_text(LAUNCHER)
    return root, tiny_text(root, n_chars=6000)


def test_one_process_run_prints_no_warning(launcher) -> None:
    root, text = launcher
    proc = subprocess.run(
        [sys.executable, str(root / "launch.py"), *_args(text, root / "one")],
        cwd=REPO, env=subprocess_env(root), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    _check(proc)


def test_two_process_run_prints_no_warning(launcher) -> None:
    root, text = launcher
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(root / "launch.py"), *_args(text, root / "two")],
        cwd=REPO, env=subprocess_env(root), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    _check(proc)
    assert "2 process(es)" in proc.stdout
