"""Exact resume: N steps straight == k steps, stop, --resume, N - k more (bit for bit)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from _train_helpers import FAST, metrics, tiny_text, txlm, weights

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
    assert la == lb and [s for s, _ in la] == list(range(1, 9))
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
