"""Faults during training: SIGKILL, SIGINT/SIGTERM, non-finite losses, failing writes.

The contract: a run killed at any moment and resumed from ``last`` ends with weights (and
optimizer state) bit-identical to an uninterrupted run (CPU, fp32); ``last`` and ``best``
always load; no checkpoint directory is ever half-written; SIGINT/SIGTERM save and exit
cleanly, a second SIGINT exits at once; non-finite steps are skipped with a warning and too
many in a row stop the run with a clear message and the last good checkpoint intact.

Real ``python -m txlm train`` runs (forked by the warm runner, or plain subprocesses) on a
tiny corpus with the ``debug`` preset. The moment of every kill or signal is named through
the fault seam (``TXLM_FAULT``, ``txlm.atomic``): a stage of a checkpoint write, or the end
of step k. Nothing waits on a clock.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import txlm
from tests.helpers.env import subprocess_env
from tests.helpers.reliability import Forked, Pause, Runner, corpus_text, wait_for_text
from txlm.checkpoints.checkpoint import resolve
from txlm.errors import CheckpointError

STEPS = 24
EVAL_EVERY = 2  # validations often enough that `best` is rewritten many times
TRAIN = [
    "train",
    "--preset",
    "debug",
    "--set",
    "data.dataset=text:corpus.txt",
    f"optim.max_steps={STEPS}",
    "data.batch_size=4",
    f"eval.eval_interval={EVAL_EVERY}",
    "eval.max_eval_steps=2",
    "eval.final_eval=false",
    "eval.sample_tokens=0",
    "run.tensorboard=false",
    "run.progress=false",
    "run.threads=1",
    "run.deterministic=true",
    "run.save_interval=1",  # `last` is written after every step
    "run.log_interval=1",
    "--out",
    "run",
]
RESUME = ["train", "--resume", "run/last"]
LAST_FILES = {
    "config.json",
    "model.safetensors",
    "vocab.json",
    "optimizer.safetensors",
    "memory.safetensors",
    "trainer_state.json",
}
BEST_FILES = {"config.json", "model.safetensors", "vocab.json"}


def _env(work: Path, **extra: str) -> dict[str, str]:
    return {"TXLM_DATA_DIR": str(work / "data"), "PYTHONWARNINGS": "default", **extra}


def _start(work: Path, argv: list[str], **extra: str) -> subprocess.Popen:
    """A real ``python -m txlm`` process (not forked): its own interpreter and handlers."""
    return subprocess.Popen(
        [sys.executable, "-m", "txlm", *argv],
        cwd=work,
        env=subprocess_env(**_env(work, **extra)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _fork(runner: Runner, work: Path, argv: list[str], io_dir: Path, **extra: str) -> Forked:
    return Forked(runner, argv, work, io_dir, _env(work, **extra))


def _finish(proc, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


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


def _step(directory: Path) -> int:
    return int(json.loads((directory / "config.json").read_text())["checkpoint"]["step"])


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
            assert {p.name for p in d.iterdir()} == LAST_FILES, list(d.iterdir())
            state = json.loads((d / "trainer_state.json").read_text())
            _tensors(d / "optimizer.safetensors")
            _tensors(d / "memory.safetensors")
            step = int(state["step"])
            assert step == _step(d)
    return step


def _temps(run: Path) -> list[Path]:
    return sorted(run.glob(".*.tmp")) if run.exists() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run: the weights every interrupted run must reproduce bit for bit."""
    work = _workdir(tmp_path_factory.mktemp("ref"), "work")
    rc, _, err = _finish(_start(work, TRAIN))
    assert rc == 0, err
    return work / "run"


def _valid_losses(run: Path) -> dict[int, float]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["split"] == "valid"}


# Every stage of a checkpoint write, in the order the writer reaches them (txlm.atomic).
def _stages(files: set[str]) -> list[str]:
    return ["made", *(f"file:{f}" for f in sorted(files)), "swap", "between", "placed"]


def _plan(improving: list[int]) -> list[tuple[str, str, int | None]]:
    """(TXLM_FAULT target, stage, the step `last` must be at after the kill), in order, each
    run resuming the one before.

    A kill inside a `last` write leaves the run where it was, so the next resumed process
    reaches the next stage of the same write (step 2's). `best` is written after `last`, at
    a validation that improves; a kill there leaves `last` at that step, so each stage comes
    at the next improving validation (``improving``, from the reference run). The first
    `best` has no old copy to move aside: `between` comes after `placed` made one.
    """
    best = [s for s in _stages(BEST_FILES) if s != "between"] + ["between"]
    after_placed = [2 if s == "placed" else 1 for s in _stages(LAST_FILES)]
    rest = [s for s in improving if s > 2]
    assert len(rest) > len(best), f"too few improving validations after step 2: {improving}"
    return [
        ("step", "1", None),  # before any checkpoint exists
        ("step", "2", 1),  # `last` of step 1 on disk
        *(("last", s, k) for s, k in zip(_stages(LAST_FILES), after_placed, strict=True)),
        *(("best", s, k) for s, k in zip(best, rest, strict=False)),
        ("step", str(rest[len(best)] + 1), rest[len(best)]),
    ]


def _expect_on_disk(run: Path, target: str, stage: str, pid: int, existed: bool) -> None:
    """What a kill at ``target:stage`` must leave: the old copy (if ``existed``), the new
    one, or both, and the killed writer's temp folder holding what that stage has written."""
    names = {p.name for p in run.iterdir()} - {"metrics.jsonl"}
    temps = _temps(run)
    if target == "step":
        # Between two writes: whole checkpoints only (earlier kills' leftovers were removed
        # by this run's first write), `last` from the step before.
        assert not temps and not any(n.endswith(".old") for n in names), names
        return
    files = LAST_FILES if target == "last" else BEST_FILES
    if stage == "placed":
        assert not temps, temps
    else:
        assert [t.name for t in temps] == [t.name for t in run.glob(f".{target}.{pid}.*.tmp")]
        assert len(temps) == 1, temps
        inside = {p.name for p in temps[0].iterdir()}
        assert inside == (set() if stage == "made" else files), (stage, inside)
    new, old = run / target, run / f"{target}.old"
    if stage == "between":
        assert not new.exists() and old.is_dir()
    elif stage == "placed":
        assert new.is_dir() and old.is_dir() == existed
        assert not existed or _step(new) > _step(old)
    else:
        assert not old.exists() and new.is_dir() == existed


@pytest.mark.slow
def test_sigkill_at_every_stage_then_resume_is_bit_identical(
    reference: Path, runner: Runner, tmp_path: Path
) -> None:
    """SIGKILL at every stage of a `last` and a `best` write and after given steps; each
    time exactly that stage's state is on disk, checkpoints load, and the run resumes; the
    resumed run ends bit for bit where the uninterrupted one did."""
    valid = _valid_losses(reference)
    improving = [k for k in sorted(valid) if all(valid[k] < valid[j] for j in valid if j < k)]
    work = _workdir(tmp_path, "work")
    run = work / "run"
    log = []
    for n, (target, stage, step) in enumerate(_plan(improving)):
        argv = RESUME if run.exists() and _check_checkpoints(run) is not None else TRAIN
        existed = (run / target).exists() or (run / f"{target}.old").exists()
        proc = _fork(runner, work, argv, tmp_path / f"io{n}", TXLM_FAULT=f"{target}:{stage}:kill")
        rc, _, err = _finish(proc)
        assert rc == -signal.SIGKILL, f"{target}:{stage}: the run did not die there ({rc}) {err}"
        _expect_on_disk(run, target, stage, proc.pid, existed)
        assert _check_checkpoints(run) == step, f"{target}:{stage}"
        log.append((f"{target}:{stage}", step))
    rc, _, err = _finish(_fork(runner, work, RESUME, tmp_path / "io"))
    assert rc == 0, err
    _assert_identical(reference / "last", resolve(run / "last"))
    assert _step(run / "best") == _step(reference / "best")
    ref_best, best = (
        _tensors(reference / "best" / "model.safetensors"),
        _tensors(run / "best" / "model.safetensors"),
    )
    assert all(torch.equal(ref_best[k], best[k]) for k in ref_best)
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in reference.iterdir())
    print("kill log (fault, last step on disk after the kill):", log)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_and_resume_is_bit_identical(
    reference: Path, runner: Runner, tmp_path: Path, sig
) -> None:
    """The signal arrives while the run is paused after step 5 (of 24): the run saves `last`
    at exactly that step, exits 128 + signal, says how to resume, and resumes exactly."""
    work = _workdir(tmp_path, "work")
    run = work / "run"
    pause = Pause(tmp_path / "fault")
    env = pause.env("step:5:pause")
    # SIGTERM goes to a real `python -m txlm` process; SIGINT to a forked one, which then
    # also resumes (cheaper; both paths run the same code).
    if sig == signal.SIGTERM:
        proc = _start(work, TRAIN, **env)
    else:
        proc = _fork(runner, work, TRAIN, tmp_path / "io1", **env)
    assert pause.wait(proc.pid) == f"step:5 {proc.pid}"
    proc.send_signal(sig)
    pause.release()
    rc, out, err = _finish(proc)
    pause.close()
    assert rc == 128 + sig, err
    assert "Traceback" not in err
    assert signal.Signals(sig).name in err
    assert _check_checkpoints(run) == 5
    assert "--resume" in out  # it says how to continue
    if sig == signal.SIGINT:  # one full resume is enough to prove the saved state is exact
        rc, out, err = _finish(_fork(runner, work, RESUME, tmp_path / "io2"))
        assert rc == 0, err
        _assert_identical(reference / "last", resolve(run / "last"))


@pytest.mark.slow
def test_second_sigint_exits_at_once_without_damage(runner: Runner, tmp_path: Path) -> None:
    """Both signals land between the two renames of a `last` write, the worst moment: the
    second stops the run at once, and the write is undone (the old `last` back in place)."""
    work = _workdir(tmp_path, "work")
    run = work / "run"
    rc, _, err = _finish(_fork(runner, work, [*TRAIN, "--set", "run.stop_at=3"], tmp_path / "a"))
    assert rc == 0, err
    assert _check_checkpoints(run) == 3
    names = sorted(p.name for p in run.iterdir())
    pause = Pause(tmp_path / "fault")
    argv = [*RESUME, "--set", "run.stop_at=null"]
    proc = _fork(runner, work, argv, tmp_path / "io", **pause.env("last:between:pause"))
    assert pause.wait(proc.pid) == f"last:between {proc.pid}"
    assert not (run / "last").exists() and _step(run / "last.old") == 3
    proc.send_signal(signal.SIGINT)
    # The first SIGINT's handler says so on stderr: then the second is surely a second one
    # (two signals sent at once can merge into one).
    stderr = tmp_path / "io" / "stderr"
    wait_for_text(stderr, "SIGINT received", proc.pid)
    proc.send_signal(signal.SIGINT)
    rc, _, err = _finish(proc)
    pause.close()
    assert rc == 130, err
    assert "Traceback" not in err
    assert _check_checkpoints(run) == 3
    assert sorted(p.name for p in run.iterdir()) == names, "the write left something"


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

    import txlm.checkpoints.files as ck

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
    rc, _, err = _finish(_fork(runner, work, argv, tmp_path / "io"))
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert "Traceback" not in err
    assert lines[-1].startswith("txlm: error: training diverged"), lines[-1]
    assert sum("RuntimeWarning" in line for line in lines) == 3  # one per skipped step
    # `last` (finite weights: checked) is from step 1, the last one that changed the weights,
    # or from a later skipped step that left them as they were.
    assert _check_checkpoints(work / "run") in (1, 2, 3)


# -- SIGKILL while preparing a dataset ---------------------------------------------------------


def test_sigkill_at_every_stage_of_prepare(runner: Runner, tmp_path: Path) -> None:
    """A prepare killed at each stage of its write never leaves a half-built dataset under
    its name; a killed rebuild (--force) leaves the old copy or the new one; the next
    prepare succeeds and removes what the killed ones left."""
    from txlm.data import load_prepared

    work, data = tmp_path / "work", tmp_path / "work" / "data"
    data.mkdir(parents=True)
    (work / "c.txt").write_text(corpus_text())
    argv = ["prepare", "text:c.txt", "--no-progress"]
    out, old = data / "text-c", data / "text-c.old"
    rc, _, err = _finish(_fork(runner, work, argv, tmp_path / "first"))
    assert rc == 0, err
    files = {p.name for p in out.iterdir()}
    assert {"train.bin", "valid.bin", "test.bin", "vocab.json", "meta.json"} <= files
    want = np.array(load_prepared(out).split("train"))
    shutil.rmtree(out)

    def killed(stage: str, *extra: str) -> list[str]:
        proc = _fork(runner, work, [*argv, *extra], tmp_path / stage.replace(":", "-"),
                     TXLM_FAULT=f"text-c:{stage}:kill")  # fmt: skip
        rc, _, err = _finish(proc)
        assert rc == -signal.SIGKILL, f"{stage}: {rc} {err}"
        temps = sorted(p.name for p in data.glob(".text-c.*.tmp"))
        assert len(temps) == 1 and re.match(rf"\.text-c\.{proc.pid}\.", temps[0]), temps
        inside = {p.name for p in (data / temps[0]).iterdir()}
        return sorted(inside)

    # The first build: nothing under the name at any stage.
    for stage in ["made", *(f"file:{f}" for f in sorted(files)), "swap"]:
        inside = killed(stage)
        assert inside == ([] if stage == "made" else sorted(files)), (stage, inside)
        assert not out.exists() and not old.exists()
    rc, _, err = _finish(_fork(runner, work, argv, tmp_path / "again"))
    assert rc == 0, err
    assert sorted(p.name for p in data.iterdir()) == ["text-c"]
    # A rebuild over it: between the renames only the old copy, then both.
    killed("between", "--force")
    assert not out.exists() and old.is_dir()
    rc, _, err = _finish(_fork(runner, work, argv, tmp_path / "after-between"))
    assert rc == 0, err
    assert sorted(p.name for p in data.iterdir()) == ["text-c"]
    proc = _fork(runner, work, [*argv, "--force"], tmp_path / "placed",
                 TXLM_FAULT="text-c:placed:kill")  # fmt: skip
    assert _finish(proc)[0] == -signal.SIGKILL
    assert sorted(p.name for p in data.iterdir()) == ["text-c", "text-c.old"]
    assert np.array_equal(load_prepared(out).split("train"), want)
