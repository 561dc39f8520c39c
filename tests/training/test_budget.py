"""run.time_budget_s is per invocation: a --resume of a run that stopped on its budget gets
the whole budget again, and the schedule goes on from where it stood (on a fake clock: no
test here depends on how fast the machine is)."""

from __future__ import annotations

import json

from tests.helpers.train import metrics, tiny_config
from txlm.training.state import Counters


class FakeClock:
    """The trainer's clock (``time.perf_counter`` in training.loop): 0.01 s per reading, so
    every step (two readings) takes 0.01 s of training time."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.01
        return self.now


def _config(tmp_path):
    return tiny_config(
        tmp_path,
        "optim.max_steps=20",
        "optim.warmup_steps=0",
        "eval.eval_interval=0",
        "eval.final_eval=false",
        "run.time_budget_s=0.035",  # 4 steps of 0.01 s
        "run.log_interval=1",
        "run.tensorboard=false",
        "run.progress=false",
    )


def test_a_resumed_run_gets_its_budget_again(tmp_path, monkeypatch):
    from txlm.training import Trainer, loop

    monkeypatch.setattr(loop, "time", FakeClock())
    out = tmp_path / "run"
    first = Trainer(_config(tmp_path), out, echo=False).fit()
    assert first["step"] == 4
    # the schedule ran on the budget: step 4 began with 0.03 s of the 0.035 s spent, so it
    # was scheduled at step 20 * 0.03 / 0.035 of 20 (float sums of the clock: ~1e-12)
    counters = Counters()
    counters.load_state_dict(json.loads((out / "last" / "trainer_state.json").read_text()))
    assert abs(counters.schedule_step - 20 * 0.03 / 0.035) < 1e-9

    monkeypatch.setattr(loop, "time", FakeClock())
    second = Trainer(_config(tmp_path), out, resume=out / "last", echo=False).fit()
    # carried over, the spent 0.04 s would stop it after one step (step 5)
    assert second["step"] == 8
    lrs = [row["lr"] for row in metrics(out)]
    assert len(lrs) == 8
    # resumed where the schedule stood: step 5 at step 4's place (the same number), then
    # on down the cosine's tail over the new budget, not back up to step 5 of 20
    assert lrs[4] == lrs[3]
    assert lrs[3] > lrs[5] > lrs[6] > lrs[7] > 0.0


def test_train_help_says_the_budget_is_per_invocation():
    from txlm.cli import build_parser

    parser = build_parser()
    train = next(
        choice
        for action in parser._subparsers._group_actions  # argparse keeps subcommands here
        for name, choice in action.choices.items()
        if name == "train"
    )
    text = " ".join(train.format_help().split())
    assert "run.time_budget_s caps the training seconds of each invocation" in text
    assert "a --resume gets the whole budget again" in text
