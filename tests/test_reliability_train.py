"""Faults during training: SIGKILL, SIGINT/SIGTERM, non-finite losses, failing writes.

The contract (issue 8): a run killed at any moment and resumed from ``last`` ends with
weights (and optimizer state) bit-identical to an uninterrupted run (CPU, fp32); ``last`` and
``best`` always load; no checkpoint directory is ever half-written; SIGINT/SIGTERM save and
exit cleanly, a second SIGINT exits at once; non-finite steps are skipped with a warning and
too many in a row stop the run with a clear message and the last good checkpoint intact.

Real ``python -m txlm train`` subprocesses on a tiny corpus with the ``debug`` preset.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import txlm
from reliability_helpers import Runner, corpus_text
from txlm.checkpoint import resolve
from txlm.errors import CheckpointError

HERE = Path(__file__).resolve().parent
STEPS = 24
TRAIN = [
    "train",
    "--preset",
    "debug",
    "--set",
    "data.dataset=text:corpus.txt",
    f"optim.max_steps={STEPS}",
    "data.batch_size=4",
    "eval.eval_interval=8",
    "eval.max_eval_steps=2",
    "eval.final_eval=false",
    "eval.sample_tokens=0",
    "run.tensorboard=false",
    "run.progress=false",
    "run.threads=1",
    "run.deterministic=true",
    "run.save_interval=1",  # `last` is rewritten every step: kills often land inside a write
    "run.log_interval=1",
    "--out",
    "run",
]
RESUME_FILES = {
    "config.json",
    "model.safetensors",
    "vocab.json",
    "optimizer.safetensors",
    "memory.safetensors",
    "trainer_state.json",
}


def _env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TXLM_DATA_DIR"] = str(work / "data")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "default"
    return env


def _start(work: Path, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "txlm", *argv],
        cwd=work,
        env=_env(work),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


class _Forked:
    """A ``python -m txlm`` child forked by the warm runner (see reliability_cli_runner):
    the same code path without 1.5 s of interpreter and torch start-up per resume."""

    def __init__(self, runner: Runner, work: Path, argv: list[str], io_dir: Path) -> None:
        env = {"TXLM_DATA_DIR": str(work / "data"), "PYTHONWARNINGS": "default"}
        self.runner = runner
        self.pid = runner.start(argv, work, io_dir, env, timeout=300)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode, self._out, self._err = self.runner.wait()
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self.returncode is None:
            self.returncode, self._out, self._err = self.runner.wait()
        return self._out, self._err


@pytest.fixture(scope="module")
def runner():
    r = Runner()
    yield r
    r.close()


def _workdir(tmp_path: Path, name: str) -> Path:
    from txlm.data import prepare_dataset

    work = tmp_path / name
    work.mkdir()
    (work / "corpus.txt").write_text(corpus_text())
    cwd = os.getcwd()
    try:  # the dataset name is relative to the run's working directory, as the CLI sees it
        os.chdir(work)
        prepare_dataset("text:corpus.txt", work / "data", progress=False)
    finally:
        os.chdir(cwd)
    return work


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _assert_identical(a: Path, b: Path) -> None:
    for name in ("model.safetensors", "optimizer.safetensors"):
        ta, tb = _tensors(a / name), _tensors(b / name)
        assert ta.keys() == tb.keys(), name
        for k in ta:
            assert torch.equal(ta[k], tb[k]), f"{name}:{k} differs after kill/resume"
    sa = json.loads((a / "trainer_state.json").read_text())
    sb = json.loads((b / "trainer_state.json").read_text())
    assert sa["step"] == sb["step"] == STEPS
    assert sa["data"] == sb["data"]


def _check_checkpoints(run: Path) -> int | None:
    """``last`` and ``best`` load whenever they exist; ``last`` is whole. Returns last's step."""
    step = None
    for kind in ("last", "best"):
        try:
            d = resolve(run / kind)
        except CheckpointError:
            continue  # never written yet
        model = txlm.load(d)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        if kind == "last":
            assert {p.name for p in d.iterdir()} >= RESUME_FILES, list(d.iterdir())
            state = json.loads((d / "trainer_state.json").read_text())
            _tensors(d / "optimizer.safetensors")
            _tensors(d / "memory.safetensors")
            step = int(state["step"])
    for p in run.iterdir() if run.exists() else []:
        # Only whole checkpoints carry the names last/best(.old); anything else is a temp dir.
        assert p.name in {"last", "best", "last.old", "best.old", "metrics.jsonl"} or (
            p.name.startswith(".") and p.name.endswith(".tmp")
        ), p
    return step


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run: the weights every interrupted run must reproduce bit for bit."""
    work = _workdir(tmp_path_factory.mktemp("ref"), "work")
    rc, _, err = _finish(_start(work, TRAIN))
    assert rc == 0, err
    return work / "run" / "last"


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """Poll every 2 ms; False when the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    raise TimeoutError("the training process made no progress")


def _last_step(run: Path) -> int:
    try:
        return int(json.loads((run / "last" / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def _writing(run: Path, kind: str) -> bool:
    return any(run.glob(f".{kind}.*.tmp")) if run.exists() else False


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_bit_identical(
    reference: Path, runner: Runner, tmp_path: Path
) -> None:
    work = _workdir(tmp_path, "work")
    run = work / "run"
    rng = random.Random(8)
    # Kill points: before any checkpoint exists, inside a `last` write, at random moments
    # after given steps, inside a `best` write. Each resumes from whatever is on disk.
    plan = [
        ("startup", None),
        ("in-last-write", 3),
        ("random", rng.randint(6, 9)),
        ("in-best-write", 15),
        ("random", rng.randint(18, 21)),
    ]
    kills = 0
    log = []
    for kind, after in plan:
        last = _check_checkpoints(run)
        argv = ["train", "--resume", "run/last"] if last is not None else TRAIN
        proc = _Forked(runner, work, argv, tmp_path / f"io{kills}")
        if kind == "startup":
            time.sleep(rng.uniform(0.05, 0.3))  # data loading, model construction
            ok = True
        elif kind == "in-last-write":
            ok = _wait_for(lambda a=after: _last_step(run) >= a and _writing(run, "last"), proc)
        elif kind == "in-best-write":
            ok = _wait_for(lambda a=after: _last_step(run) >= a and _writing(run, "best"), proc)
        else:
            ok = _wait_for(lambda a=after: _last_step(run) >= a, proc)
            time.sleep(rng.uniform(0.0, 0.05))  # somewhere inside the next step or write
        assert ok and proc.poll() is None, f"{kind}: the run ended before the kill point"
        proc.kill()  # SIGKILL: no handler, no cleanup
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        kills += 1
        log.append((kind, _check_checkpoints(run)))
    assert _check_checkpoints(run) is not None
    rc, _, err = _finish(_Forked(runner, work, ["train", "--resume", "run/last"], tmp_path / "io"))
    assert rc == 0, err
    assert kills == len(plan)
    _assert_identical(reference, resolve(run / "last"))
    txlm.load(resolve(run / "best"))
    assert not list(run.glob(".*.tmp")), "a finished run left temp dirs behind"
    print("kill log (kind, last step on disk after the kill):", log)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_and_resume_is_bit_identical(
    reference: Path, runner: Runner, tmp_path: Path, sig
) -> None:
    work = _workdir(tmp_path, "work")
    run = work / "run"
    # SIGTERM goes to a real `python -m txlm` process; SIGINT to a forked one, which then
    # also resumes (cheaper; both paths run the same code).
    if sig == signal.SIGTERM:
        proc = _start(work, TRAIN)
    else:
        proc = _Forked(runner, work, TRAIN, tmp_path / "io1")
    assert _wait_for(lambda: _last_step(run) >= 5, proc)
    if sig == signal.SIGTERM:
        proc.send_signal(sig)
    else:
        os.kill(proc.pid, sig)
    rc, out, err = _finish(proc)
    assert rc == 128 + sig, err
    assert "Traceback" not in err
    assert signal.Signals(sig).name in err
    step = _check_checkpoints(run)
    assert step is not None and 5 <= step < STEPS
    assert "--resume" in out  # it says how to continue
    if sig == signal.SIGINT:  # one full resume is enough to prove the saved state is exact
        proc = _Forked(runner, work, ["train", "--resume", "run/last"], tmp_path / "io2")
        rc, out, err = _finish(proc)
        assert rc == 0, err
        _assert_identical(reference, resolve(run / "last"))


@pytest.mark.slow
def test_second_sigint_exits_at_once_without_damage(runner: Runner, tmp_path: Path) -> None:
    work = _workdir(tmp_path, "work")
    run = work / "run"
    proc = _Forked(runner, work, TRAIN, tmp_path / "io")
    # Both signals land while `last` is being written, the worst moment.
    assert _wait_for(lambda: _last_step(run) >= 3 and _writing(run, "last"), proc)
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGINT)
    rc, _, err = _finish(proc, timeout=60)
    assert rc == 130, err
    assert "Traceback" not in err
    step = _check_checkpoints(run)
    assert step is not None and step >= 3
    assert not list(run.glob(".*.tmp")), "an interrupted write left its temp dir"


# -- non-finite losses, in process (a poisoned forward) ---------------------------------------


def _trainer(work: Path, *sets: str):
    from txlm.training import Trainer
    from txlm.training.config import resolve as resolve_config

    base = TRAIN[TRAIN.index("--set") + 1 : TRAIN.index("--out")]
    # Absolute paths (no chdir in process), and no global deterministic mode (it would leak
    # into the other tests of this process).
    base = [s for s in base if not s.startswith(("run.deterministic", "optim.max_steps"))]
    base += [f"data.dataset=text:{work / 'corpus.txt'}", f"data.data_dir={work / 'data'}"]
    config = resolve_config("debug", [], [*base, *sets])
    return Trainer(config, work / "run", echo=False)


def _poison(trainer, bad_steps: set[int]) -> None:
    """Make the loss NaN on the given (1-based) steps, as an fp overflow would."""
    real = trainer.forward_model

    def forward(*args, **kwargs):
        out = real(*args, **kwargs)
        if trainer.step + 1 in bad_steps and out.losses is not None:
            out.losses = out.losses * float("nan")
        return out

    trainer.forward_model = forward


def test_nonfinite_steps_are_skipped_with_warning(tmp_path: Path) -> None:
    work = _workdir(tmp_path, "work")
    trainer = _trainer(work, "optim.max_steps=6", "optim.max_bad_steps=3", "eval.eval_interval=0")
    _poison(trainer, {3, 4})
    snapshots = {}
    real_step = trainer.train_step

    def step_and_record():
        stats = real_step()
        snapshots[trainer.step] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        return stats

    trainer.train_step = step_and_record
    with pytest.warns(RuntimeWarning, match="non-finite") as caught:
        trainer.fit()
    assert sum("non-finite" in str(w.message) for w in caught) == 2
    for k in snapshots[2]:  # skipped steps leave the weights exactly as they were
        assert torch.equal(snapshots[2][k], snapshots[4][k])
    assert any(not torch.equal(snapshots[4][k], snapshots[5][k]) for k in snapshots[4])
    assert trainer.bad_steps == 0  # a good step resets the count
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_too_many_nonfinite_steps_stop_with_last_good_checkpoint(tmp_path: Path) -> None:
    from txlm.errors import TxlmError

    work = _workdir(tmp_path, "work")
    trainer = _trainer(work, "optim.max_steps=20", "optim.max_bad_steps=3", "eval.eval_interval=0")
    _poison(trainer, set(range(5, 100)))
    good = {}
    real_step = trainer.train_step

    def step_and_record():
        stats = real_step()
        if trainer.step == 4:  # the last good step
            good.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
        return stats

    trainer.train_step = step_and_record
    with pytest.warns(RuntimeWarning), pytest.raises(TxlmError, match="diverged") as info:
        trainer.fit()
    assert "\n" not in str(info.value)
    assert "3 consecutive" in str(info.value)
    last = resolve(work / "run" / "last")
    state = json.loads((last / "trainer_state.json").read_text())
    # `last` may be written after skipped steps (their batches were consumed), but its
    # weights are the last good step's: a skipped step never changes them.
    assert 4 <= state["step"] < 7
    weights = _tensors(last / "model.safetensors")
    for k, v in weights.items():
        assert torch.equal(v, good[k]), k
    model = txlm.load(last)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    import errno

    import txlm.checkpoint as ck

    work = _workdir(tmp_path, "work")
    trainer = _trainer(work, "optim.max_steps=10", "eval.eval_interval=0")
    real = ck.save_model
    calls = [0]

    def save_model(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:  # the fourth checkpoint write hits a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, "save_model", save_model)
    with pytest.raises(OSError) as info:
        trainer.fit()
    assert info.value.errno == errno.ENOSPC
    assert _check_checkpoints(work / "run") == 3
    assert not list((work / "run").glob(".*.tmp"))


def test_divergence_through_the_cli(runner: Runner, tmp_path: Path) -> None:
    """A real blow-up (lr 1e30 makes the loss NaN from step 2): warnings, then exit 2."""
    work = _workdir(tmp_path, "work")
    argv = [*TRAIN[:-2], "optim.lr=1e30", "optim.max_bad_steps=3", "--out", "run"]
    proc = _Forked(runner, work, argv, tmp_path / "io")
    rc, _, err = _finish(proc)
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert "Traceback" not in err
    assert lines[-1].startswith("txlm: error: training diverged"), lines[-1]
    assert sum("RuntimeWarning" in line for line in lines) == 3  # one per skipped step
    # `last` (finite weights: checked) is from step 1, the last one that changed the weights,
    # or from a later skipped step that left them as they were.
    assert _check_checkpoints(work / "run") in (1, 2, 3)


# -- SIGKILL while preparing a dataset ---------------------------------------------------------


def _prepare_killed(runner: Runner, tmp_path: Path) -> Path:
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    rng = random.Random(0)
    lines = ("".join(rng.choice("abcdefgh ") for _ in range(80)) for _ in range(25_000))
    (work / "big.txt").write_text("\n".join(lines))
    argv = ["prepare", "text:big.txt", "--no-progress"]
    proc = _Forked(runner, work, argv, tmp_path / "io1")
    data = work / "data"
    assert _wait_for(lambda: any(p.name.startswith(".") for p in data.iterdir()), proc)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not (data / "text-big").exists()  # never a half-built dataset under its name
    rc, _, err = _finish(_Forked(runner, work, argv, tmp_path / "io2"))
    assert rc == 0, err
    from txlm.data import load_prepared

    corpus = load_prepared(data / "text-big")
    assert sum(len(corpus.split(s)) for s in ("train", "valid", "test")) == 25_000 * 81 - 1
    return data


def test_sigkill_during_prepare_then_prepare_again(runner: Runner, tmp_path: Path) -> None:
    _prepare_killed(runner, tmp_path)


def test_sigkill_during_prepare_leaves_no_temp_folder(runner: Runner, tmp_path: Path) -> None:
    data = _prepare_killed(runner, tmp_path)
    assert sorted(p.name for p in data.iterdir()) == ["text-big"]
