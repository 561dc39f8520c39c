"""DDP on CPU (gloo): 2 processes x 2 rows follow the same loss curve as 1 process x 4 rows,
and so does 1 process accumulating gradients over 2 chunks of 2 rows; a 2-process run stopped
and resumed equals one that ran straight through, bit for bit; a stop that only rank 0 sees
(its time budget) stops both ranks at the same step. Every torchrun run here prints no
warning (a warning attributed to txlm fails it: tests/helpers/strict_txlm.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.env import subprocess_env
from tests.helpers.train import (
    FAST,
    REPO,
    assert_same_run,
    check_quiet,
    metrics,
    tiny_text,
    txlm,
    weights,
)

pytestmark = pytest.mark.slow


def _args(text, out, dropout: float = 0.0) -> list[str]:
    return [
        "train",
        "--preset",
        "debug",
        "--out",
        str(out),
        "--set",
        *FAST,
        f"data.dataset=text:{text}",
        "data.batch_size=4",  # global
        f"model.dropout={dropout}",
        "optim.max_steps=6",
        "eval.eval_interval=0",
        "eval.final_eval=false",
        "run.log_interval=1",
    ]


def _torchrun(args: list[str], data_dir) -> subprocess.CompletedProcess:
    """``txlm ARGS`` under torchrun with 2 processes on this machine, a warning attributed to
    txlm an error (tests/helpers/strict_txlm.py); a run that ends well printed no warning."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "tests" / "helpers" / "strict_txlm.py"), *args],
        cwd=REPO, env=subprocess_env(data_dir), capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    if proc.returncode == 0:
        check_quiet(proc)
    return proc


def test_two_processes_match_one(tmp_path):
    text = tiny_text(tmp_path)
    one, two, accum = tmp_path / "one", tmp_path / "two", tmp_path / "accum"
    r = txlm(_args(text, one), tmp_path)
    assert r.returncode == 0, r.stderr
    r = _torchrun(_args(text, two), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 process(es)" in r.stdout
    r = txlm([*_args(text, accum), "optim.grad_accum=2"], tmp_path)
    assert r.returncode == 0, r.stderr

    ref = metrics(one)
    assert [m["step"] for m in ref] == list(range(1, 7))
    assert ref[-1]["loss"] < ref[0]["loss"]  # it learns
    for other in (two, accum):
        got = metrics(other)
        assert [m["tokens_seen"] for m in got] == [m["tokens_seen"] for m in ref]
        for a, b in zip(ref, got, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        wa, wb = weights(one / "last"), weights(other / "last")
        for name in wa:
            torch.testing.assert_close(wb[name], wa[name], atol=1e-5, rtol=1e-4)


def test_two_process_run_resumes_bit_for_bit(tmp_path):
    """Stopped at step 3 and resumed with --resume under torchrun, a 2-process run with
    dropout ends with the weights, Adam moments and losses of a straight 6-step run: each
    rank gets back its RNG state, its rows' memory and its place in the stream."""
    text = tiny_text(tmp_path)
    straight, paused = tmp_path / "straight", tmp_path / "paused"
    r = _torchrun(_args(text, straight, dropout=0.2), tmp_path)  # dropout: RNG state matters
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun([*_args(text, paused, dropout=0.2), "run.stop_at=3"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun(["train", "--resume", str(paused / "last"), "--set", "run.stop_at=null"],
                  tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed at step 3" in r.stdout

    assert_same_run(straight, paused, steps=6)


def test_both_ranks_stop_at_the_same_step_when_rank_0_runs_out_of_time(tmp_path):
    """Only rank 0 measures the time budget. The ranks' stop votes are maxed on the device
    and read one step later (no host sync inside a step): rank 0 spends the budget in step
    1, both ranks read that after queueing step 2 and stop there, together (a rank that
    went on alone would hang in its next collective)."""
    text = tiny_text(tmp_path)
    out = tmp_path / "budget"
    r = _torchrun([*_args(text, out), "run.time_budget_s=1e-6"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "time budget of 0s spent at step 2" in r.stdout
    assert json.loads((out / "results.json").read_text())["step"] == 2
    assert json.loads((out / "last" / "trainer_state.json").read_text())["step"] == 2
    assert [m["step"] for m in metrics(out)] == [1, 2]


@pytest.mark.parametrize("has_new_name", [True, False])
def test_buffers_are_not_broadcast_under_either_name(monkeypatch, has_new_name):
    """DDP is told not to broadcast buffers by the argument the installed torch has:
    ``forward_sync_buffers`` (2.13) or ``broadcast_buffers`` (before: torch 2.11, as on the
    device machines, has no other). Checked against stand-ins of both signatures."""
    import torch.nn.parallel

    from txlm.training import distributed

    seen: dict = {}

    class New:
        def __init__(self, module, device_ids=None, forward_sync_buffers=True):
            seen.update(forward_sync_buffers=forward_sync_buffers, device_ids=device_ids)

    class Old:
        def __init__(self, module, device_ids=None, broadcast_buffers=True):
            seen.update(broadcast_buffers=broadcast_buffers, device_ids=device_ids)

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", New if has_new_name else Old)
    distributed.data_parallel(torch.nn.Linear(2, 2), torch.device("cpu"))
    name = "forward_sync_buffers" if has_new_name else "broadcast_buffers"
    assert seen == {name: False, "device_ids": None}
