"""A step that is not finite is skipped however it comes about, and hands nothing on.

- The loss finite but one gradient entry infinite (fp32, and bf16 with its compute copies):
  the weights, both of Adam's moments and its step count stay as they were, and the step is
  reported as not finite.
- In doc_mode=reset a skipped step leaves no memory position marked valid: the next step
  equals the same step taken with no memory at all.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.train import FAST, tiny_config

QUIET = ("eval.eval_interval=0", "eval.final_eval=false", "run.log_interval=1",
         "model.dropout=0.0", "model.dropatt=0.0", *FAST)  # fmt: skip


def _trainer(directory, *sets):
    from txlm.training import Trainer

    directory.mkdir()
    return Trainer(tiny_config(directory, *QUIET, *sets), directory / "run", echo=False)


def _snapshot(trainer) -> dict[str, torch.Tensor]:
    """The weights (the fp32 master), every optimizer state tensor (moments and step
    count), and the bf16 compute copies where there are."""
    state = {f"model.{k}": v.clone() for k, v in trainer.model.state_dict().items()}
    for i, st in enumerate(trainer.optimizer.state.values()):
        state |= {f"adam.{i}.{k}": torch.as_tensor(v).clone() for k, v in st.items()}
    if trainer.compute is not None:
        state |= {f"copy.{i}": p.detach().clone() for i, p in enumerate(trainer.compute.params)}
    return state


def _infinite_gradient(trainer):
    """A hook that makes one entry of the first layer's fc1 weight gradient infinite (of the
    weight the forward uses: the bf16 copy where there is one); the handle to remove it."""
    model = trainer.model if trainer.compute is None else trainer.compute.model
    weight = model.layers[0].ff.fc1.weight

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad

    return weight.register_hook(poison)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_finite_loss_with_an_infinite_gradient_is_skipped(tmp_path, precision):
    trainer = _trainer(tmp_path / "run", f"run.precision={precision}", "optim.max_bad_steps=3")
    trainer.account(trainer.train_step())  # Adam's state exists (step 1)
    before = _snapshot(trainer)
    assert any(k.endswith(".exp_avg_sq") for k in before) and any(
        k.endswith(".step") for k in before
    )
    handle = _infinite_gradient(trainer)
    stats = trainer.train_step()
    handle.remove()
    with pytest.warns(RuntimeWarning, match="non-finite"):
        values = trainer.account(stats)
    assert math.isfinite(values["loss"]) and math.isinf(values["grad_norm"])
    assert values["finite"] == 0.0 and trainer.bad_steps == 1
    after = _snapshot(trainer)
    assert after.keys() == before.keys()
    for name, value in before.items():  # skipped: the same tensors, not a changed one
        assert torch.equal(after[name], value), f"{name} changed by a skipped step"
    values = trainer.account(trainer.train_step())  # and the next finite step runs
    assert values["finite"] == 1.0 and trainer.bad_steps == 0
    assert not torch.equal(
        trainer.model.layers[0].ff.fc1.weight, before["model.layers.0.ff.fc1.weight"]
    )


def test_a_skipped_step_in_reset_mode_leaves_no_memory_valid(tmp_path):
    """Two runs, identical to step 2, which the first skips (an infinite gradient) and the
    second takes as well and then forgets its memory: their third steps are the same step
    (within float32 rounding: the first attends over M masked keys, the second over none)."""
    runs = [_trainer(tmp_path / name, "data.doc_mode=reset") for name in ("skipped", "none")]
    for trainer in runs:
        trainer.account(trainer.train_step())
        assert trainer.memory.mask is not None and trainer.memory.mask.all()
        handle = _infinite_gradient(trainer)
        with pytest.warns(RuntimeWarning, match="non-finite"):
            trainer.account(trainer.train_step())
        handle.remove()
    skipped, none = runs
    assert not skipped.memory.mask.any()  # nothing the skipped step computed is valid
    none.memory.clear()
    got, want = (trainer.account(trainer.train_step()) for trainer in runs)
    assert got["finite"] == want["finite"] == 1.0
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    for a, b in zip(skipped.memory.mems, none.memory.mems, strict=True):  # what it hands on
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
