"""A CPU training step flushes denormal floats to zero, and only while it runs
(``training.precision.denormals_flushed``): Adam's second moments of rarely updated rows decay
below 1.2e-38, where x86 arithmetic slows down several times over."""

from __future__ import annotations

import torch

from tests.helpers.train import tiny_config

TINY = 1e-39  # a float32 denormal


def denormal_survives() -> bool:
    return float(torch.tensor([TINY]) * 1.0) > 0.0


def test_a_cpu_step_flushes_denormals_and_the_process_keeps_them_after(tmp_path):
    from txlm.training import Trainer

    quiet = ("eval.eval_interval=0", "eval.final_eval=false", "run.tensorboard=false",
             "run.progress=false")  # fmt: skip
    trainer = Trainer(tiny_config(tmp_path, *quiet), tmp_path / "run", echo=False)
    seen = []
    step = trainer._train_step

    def recording():
        seen.append(denormal_survives())
        return step()

    trainer._train_step = recording
    assert denormal_survives()
    stats = trainer.train_step()
    assert seen == [False]  # flushed inside the step
    assert denormal_survives()  # and not after it
    assert trainer.account(stats)["finite"] == 1.0
