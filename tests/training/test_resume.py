"""Exact resume: N steps straight == k steps, stop, --resume, N - k more (bit for bit)."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file

from tests.helpers.train import FAST, assert_same_run, tiny_text, txlm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return root, tiny_text(root)


def _common(text) -> list[str]:
    return [
        "--preset",
        "debug",
        "--set",
        *FAST,
        f"data.dataset=text:{text}",
        "model.dropout=0.2",  # dropout makes the RNG state matter
        "optim.max_steps=8",
        "optim.warmup_steps=2",
        "eval.eval_interval=3",
        "eval.final_eval=false",
        "run.log_interval=1",
    ]


def test_resume_is_bitwise_exact(data, capsys):
    root, text = data
    straight, paused = root / "straight", root / "paused"
    r = txlm(["train", *_common(text), "--out", str(straight)], root)
    assert r.returncode == 0, r.stderr
    r = txlm(["train", *_common(text), "run.stop_at=5", "--out", str(paused)], root)
    assert r.returncode == 0, r.stderr
    state = json.loads((paused / "last" / "trainer_state.json").read_text())
    assert state["step"] == 5 and state["data"]["batch"] == 5
    assert state["has_memory"]
    mem = load_file(str(paused / "last" / "memory.safetensors"))
    assert mem["mems.0"].shape == (4, 16, 32)  # global rows x mem_len x d_model

    r = txlm(["train", "--resume", str(paused / "last"), "--set", "run.stop_at=null"], root)
    assert r.returncode == 0, r.stderr
    assert "resumed at step 5" in r.stdout

    assert_same_run(straight, paused, steps=8)
    # Changing the model on resume is refused with one line.
    from txlm.cli import main

    os.environ["TXLM_DATA_DIR"] = str(root)
    try:
        code = main(["train", "--resume", str(paused / "last"), "--set", "model.n_layer=3"])
    finally:
        del os.environ["TXLM_DATA_DIR"]
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("txlm: error:") and "model" in err
    assert len(err.strip().splitlines()) == 1


def test_a_killed_run_with_variational_dropout_and_averaging_resumes_bit_for_bit(data):
    """The ptb recipe's two settings on: killed (SIGKILL, the fault seam) after step 5 with
    `last` written after every step, then resumed mid-average, the run ends as one that ran
    straight through: weights, Adam, losses, the average and the `best` made from it."""
    import subprocess
    import sys

    import torch

    from tests.helpers.env import REPO, subprocess_env

    root, text = data
    both = [
        "model.variational_dropout=true",
        "optim.average=uniform",
        "optim.average_start=3",
        "run.save_interval=1",
    ]
    straight, killed = root / "both-straight", root / "both-killed"
    r = txlm(["train", *_common(text), *both, "--out", str(straight)], root)
    assert r.returncode == 0, r.stderr
    argv = ["-m", "txlm", "train", *_common(text), *both, "--out", str(killed)]
    env = subprocess_env(root, TXLM_FAULT="step:5:kill")
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    state = json.loads((killed / "last" / "trainer_state.json").read_text())
    assert state["step"] == 4  # step 5's weights were never saved
    mid = load_file(str(killed / "last" / "average.safetensors"))
    assert int(mid["count"]) == 2  # steps 3 and 4
    r = txlm(["train", "--resume", str(killed / "last")], root)
    assert r.returncode == 0, r.stderr

    assert_same_run(straight, killed, steps=8)
    for kind, name in (("last", "average.safetensors"), ("best", "model.safetensors")):
        a, b = load_file(str(straight / kind / name)), load_file(str(killed / kind / name))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), (kind, name)
