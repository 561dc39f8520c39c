"""`txlm train` end to end on a tiny real corpus, then `txlm eval` on its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.helpers.env import subprocess_env
from tests.helpers.reliability import Pause
from tests.helpers.train import FAST, REPO, metrics, split_tokens, tiny_text, txlm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    text = tiny_text(root)
    out = root / "run"
    r = txlm(
        [
            "train",
            "--preset",
            "debug",
            "--out",
            str(out),
            "--set",
            *FAST,
            f"data.dataset=text:{text}",
            "optim.max_steps=12",
            "eval.eval_interval=4",
            "eval.sample_tokens=40",
            "eval.sample_prompt=HAMLET.",
            "run.progress=true",  # stderr is a pipe here, as in `make run > log 2>&1`
            "run.progress_interval=4",
        ],
        root,
    )
    assert r.returncode == 0, r.stderr
    return root, text, out, r


def test_run_writes_checkpoints_metrics_and_results(run):
    root, _, out, r = run
    assert "resolved configuration:" in r.stdout and "preset: debug" in r.stdout
    for name in ("config.json", "model.safetensors", "vocab.json"):
        assert (out / "best" / name).is_file()
    for name in ("optimizer.safetensors", "trainer_state.json", "memory.safetensors"):
        assert (out / "last" / name).is_file()
    assert (out / "loss.png").stat().st_size > 1000
    saved = json.loads((out / "last" / "config.json").read_text())
    assert saved["train"]["optim"]["max_steps"] == 12
    assert saved["vocab_fingerprint"] and saved["dataset"]["metric"] == "bpc"
    train = metrics(out)
    valid = metrics(out, "valid")
    assert [m["step"] for m in valid] == [4, 8, 12]
    assert train[-1]["loss"] < train[0]["loss"]
    assert all(m["lr"] > 0 and m["tokens_per_s"] > 0 for m in train)
    results = json.loads((out / "results.json").read_text())
    test = results["test"]
    # The whole test split is scored: every token but the first, exactly once.
    assert test["tokens"] == len(split_tokens(root, "text-tiny", "test")) - 1
    assert test["bpc"] == pytest.approx(test["loss"] / np.log(2))
    assert (test["tgt_len"], test["mem_len"]) == (16, 32)  # the preset's evaluation lengths
    assert results["sample"].startswith("HAMLET.") and len(results["sample"]) > len("HAMLET.")
    assert "sample (top-40" in r.stdout and "test: loss" in r.stdout


def test_progress_in_a_log_file_is_plain_lines(run):
    """Not a terminal: a readable line every run.progress_interval steps, no bar frames."""
    _, _, _, r = run
    assert "\r" not in r.stderr and "\r" not in r.stdout
    lines = [x for x in r.stderr.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in lines] == ["4/12", "8/12", "12/12"]
    for line in lines:
        for field in ("loss ", "bpc ", "lr ", " tok/s", "ETA "):
            assert field in line, line
    assert "step 4: valid loss" in r.stdout


def test_end_of_run_sample_is_what_generate_gives_for_the_same_seed(run, monkeypatch, capsys):
    """The sample printed at the end of training comes from `best` with the run's seed and
    the checkpoint's lengths: `txlm generate` reproduces it token for token (40 tokens with
    memory 16 run well past the point where the memory trims)."""
    root, _, out, _ = run
    results = json.loads((out / "results.json").read_text())
    seed = json.loads((out / "best" / "config.json").read_text())["train"]["run"]["seed"]
    code, stdout, err = _main(
        ["generate", str(out / "best"), "--prompt", "HAMLET.", "--max-new-tokens", "40",
         "--seed", str(seed), "--json"],
        root, monkeypatch, capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "HAMLET." + json.loads(stdout)["samples"][0] == results["sample"]


def _main(args: list[str], root, monkeypatch, capsys) -> tuple[int, str, str]:
    """``txlm ARGS`` in this process (cheaper than a subprocess for the quick cases)."""
    from txlm.cli import main

    monkeypatch.setenv("TXLM_DATA_DIR", str(root))
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_eval_cli_matches_training_and_takes_longer_memory(run, monkeypatch, capsys):
    root, _, out, _ = run
    results = json.loads((out / "results.json").read_text())
    r = txlm(["eval", str(out / "best"), "--json", "--batch-size", "2", "--threads", "1"], root)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["split"] == "test" and got["tokens"] == results["test"]["tokens"]
    assert got["loss"] == pytest.approx(results["test"]["loss"], abs=1e-6)
    code, stdout, err = _main(
        ["eval", str(out / "best"), "--json", "--split", "valid", "--mem-len", "64",
         "--tgt-len", "8", "--clamp-len", "40", "--same-length"],
        root, monkeypatch, capsys,
    )  # fmt: skip
    assert code == 0, err
    long = json.loads(stdout)
    assert (long["mem_len"], long["tgt_len"], long["clamp_len"]) == (64, 8, 40)
    assert long["same_length"] is True and long["split"] == "valid"
    assert long["tokens"] == len(split_tokens(root, "text-tiny", "valid")) - 1
    assert np.isfinite(long["bpc"]) and long["tokens_per_s"] > 0
    # The key/value cache gives the same figure (same products, blocked differently).
    code, stdout, err = _main(
        ["eval", str(out / "best"), "--json", "--split", "valid", "--mem-len", "64",
         "--tgt-len", "8", "--clamp-len", "40", "--same-length", "--kv-cache"],
        root, monkeypatch, capsys,
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(stdout)["loss"] == pytest.approx(long["loss"], abs=1e-5)


def test_eval_refuses_another_vocabulary_and_bad_input(run, tmp_path, monkeypatch, capsys):
    root, _, out, _ = run
    other = tmp_path / "digits.txt"
    other.write_text("".join(f"{i * 7919 % 1000:03d}\n" for i in range(3000)))
    code, _, err = _main(
        ["eval", str(out / "best"), "--dataset", f"text:{other}"], root, monkeypatch, capsys
    )
    assert code == 2
    assert err.startswith("txlm: error:") and "vocabulary" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = _main(["eval", str(tmp_path / "missing")], root, monkeypatch, capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = _main(["eval", str(out / "best"), "--mem-len", "-3"], root, monkeypatch, capsys)
    assert code == 2 and "--mem-len" in err


def test_sigint_saves_last_and_exits_130(run, tmp_path):
    root, text, _, _ = run
    out = tmp_path / "interrupted"
    args = [
        sys.executable, "-m", "txlm", "train", "--preset", "debug", "--out", str(out),
        "--set", *FAST, f"data.dataset=text:{text}", "optim.max_steps=100000",
        "run.log_interval=1", "eval.eval_interval=0",
    ]  # fmt: skip
    pause = Pause(tmp_path / "fault")  # the run waits after step 2 until released
    proc = subprocess.Popen(
        args, cwd=REPO, env=subprocess_env(root, **pause.env("step:2:pause")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pause.wait(proc.pid)
        proc.send_signal(signal.SIGINT)
        pause.release()
        _, err = proc.communicate(timeout=240)
    finally:
        pause.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    state = json.loads((out / "last" / "trainer_state.json").read_text())
    assert state["step"] == 2
    assert "SIGINT received" in err
    # The interrupted run resumes from where it stopped.
    r = txlm(["train", "--resume", str(out / "last"), "--set",
              f"optim.max_steps={state['step'] + 2}", "eval.final_eval=false"], root)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (
        json.loads((out / "last" / "trainer_state.json").read_text())["step"] == state["step"] + 2
    )


def test_non_finite_steps_are_skipped_then_stop(run, tmp_path):
    from txlm.errors import TxlmError
    from txlm.training import Trainer
    from txlm.training.config import resolve

    root, text, _, _ = run
    os.environ["TXLM_DATA_DIR"] = str(root)
    try:
        config = resolve(
            "debug", None, [*FAST, f"data.dataset=text:{text}", "optim.max_bad_steps=2"]
        )
        trainer = Trainer(config, tmp_path / "nan", echo=False)
        with torch.no_grad():
            trainer.model.layers[0].ff.fc1.weight.fill_(float("nan"))
        before = trainer.model.layers[1].ff.fc1.weight.clone()
        with pytest.warns(RuntimeWarning, match="non-finite"):
            trainer.account(trainer.train_step())
        assert torch.equal(trainer.model.layers[1].ff.fc1.weight, before)  # no update
        assert all(not m.any() for m in trainer.memory.mems)  # poisoned memory zeroed
        with pytest.warns(RuntimeWarning), pytest.raises(TxlmError, match="diverged"):
            trainer.account(trainer.train_step())
    finally:
        del os.environ["TXLM_DATA_DIR"]
