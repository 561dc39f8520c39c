"""run.compile: auto is on for CUDA only; steps that compile count against neither the time
budget nor tokens/s, and the compile time is reported (on a fake clock: no test here
depends on how fast the machine is)."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from tests.helpers.train import tiny_config
from txlm.devices import wanted


def test_auto_compiles_on_cuda_only():
    assert wanted("auto", torch.device("cuda", 0))
    assert not wanted("auto", torch.device("cpu"))
    assert wanted(True, torch.device("cpu")) and not wanted(False, torch.device("cuda"))


class FakeClock:
    """The trainer's clock (``time.perf_counter`` in training.loop): 0.01 s per reading,
    plus whatever a "compile" adds. Steps take no real time to count against the budget."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.01
        return self.now


def test_compiling_is_not_charged_to_the_time_budget(tmp_path, monkeypatch):
    """A backend that "takes" 100 s per graph on the trainer's clock, a budget of 1 s:
    charged to the budget, the first compiling step would spend it and the run would
    "finish" after 1 step; the compiling steps are not charged, so all 6 steps run."""
    from txlm.training import Trainer, loop

    clock = FakeClock()

    def slow_backend(gm, example_inputs):
        clock.now += 100.0  # stands in for inductor's minutes
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=slow_backend))
    monkeypatch.setattr(loop, "time", clock)
    config = tiny_config(
        tmp_path,
        "optim.max_steps=6",
        "eval.eval_interval=0",
        "eval.final_eval=false",
        "run.compile=true",
        "run.time_budget_s=1.0",
        "run.tensorboard=false",
        "run.progress=false",
    )
    out = tmp_path / "run"
    summary = Trainer(config, out, echo=False).fit()
    torch._dynamo.reset()
    assert summary["step"] == 6
    # step 1 builds two graphs (its forward without memory, the update's clipping), step 2
    # one (the forward with memory), each step in one reading of the clock
    assert summary["compile_seconds"] == pytest.approx(300.02)
    assert summary["train_seconds"] == pytest.approx(4 * 0.01)
    results = json.loads((out / "results.json").read_text())
    assert results["compile_seconds"] == summary["compile_seconds"]
    assert results["train_seconds"] == summary["train_seconds"]


def test_a_compiled_run_builds_three_graphs(tmp_path, monkeypatch):
    """The forward: one graph for the first step (no memory yet) and one for every later
    step: the memory a step hands on has the same shape and strides every time (a view of
    the concatenated [memory; segment] had other strides than the first step's and compiled
    another graph, minutes of inductor on a GPU); and the update's clipping (C37)."""
    from txlm.training import Trainer

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setattr(
        torch, "compile", functools.partial(torch.compile, backend=counting_backend)
    )
    config = tiny_config(tmp_path, "optim.max_steps=5", "eval.eval_interval=0",
                         "eval.final_eval=false", "run.compile=true", "run.tensorboard=false",
                         "run.progress=false")  # fmt: skip
    Trainer(config, tmp_path / "run", echo=False).fit()
    torch._dynamo.reset()
    assert len(graphs) == 3
