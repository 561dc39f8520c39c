"""bf16 training without per-use weight casts: forward and backward run on bf16 copies of
the fp32 master weights, refreshed once after each Adam step, with bf16 activations
(txlm.training.precision).

Casts are counted with a dispatch mode: every ``aten._to_copy`` whose input shares storage
with a weight (master or copy). Plain autocast on fp32 weights casts at every weight use;
the trainer's bf16 step casts none, and refreshes the copies with one fused copy.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.train import tiny_config, tiny_text
from txlm.training.precision import ComputeCopy


class WeightCasts(TorchDispatchMode):
    def __init__(self, *weights: torch.nn.Module | torch.Tensor) -> None:
        super().__init__()
        tensors = [t for w in weights for t in ([w] if isinstance(w, torch.Tensor)
                                                else w.parameters())]  # fmt: skip
        self.ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        self.casts = 0
        self.refreshes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and self._is_weight(args[0]):
            self.casts += 1
        if func is torch.ops.aten._foreach_copy_.default:
            self.refreshes += 1
        return func(*args, **kwargs)

    def _is_weight(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.ptrs


@pytest.fixture
def trainer(tmp_path):
    from txlm.training import Trainer

    config = tiny_config(
        tmp_path,
        "model.dropout=0.0",
        "run.precision=bf16",
        "run.tensorboard=false",
        "run.progress=false",
    )
    return Trainer(config, tmp_path / "run", echo=False)


def test_bf16_step_casts_no_weight_and_matches_autocast(trainer):
    initial = copy.deepcopy(trainer.model)  # fp32, as the run starts
    batches = []
    real_next = trainer._next_batch
    trainer._next_batch = lambda: batches.append(real_next()) or batches[-1]
    loss = trainer.train_step().loss.item()

    # Without bf16 activations the copy's forward is autocast's on the same fp32 weights, to
    # the bit: autocast rounds each weight to the same bf16 value the copy holds. With them
    # (the trainer's) the loss is that one up to the bf16 rounding of the residual stream.
    b = batches[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = initial(b.input_ids, labels=b.labels).losses.float().sum().detach()
        fp32_stream = ComputeCopy(initial, torch.bfloat16, activations=False).model
        same = fp32_stream(b.input_ids, labels=b.labels).losses.float().sum().detach()
    assert torch.equal(same, ref)
    n = int((b.labels != -100).sum())
    assert loss == pytest.approx(ref.double().item() / n, rel=5e-3)
    assert trainer.compute.model.activation_dtype == torch.bfloat16
    assert trainer.model.activation_dtype is None  # the master's record is its own

    # the old way: autocast over fp32 weights
    with WeightCasts(initial) as plain, torch.autocast("cpu", dtype=torch.bfloat16):
        initial(b.input_ids, labels=b.labels).losses.float().sum().backward()
    assert plain.casts >= trainer.model_config.n_layer * 4  # every weight use casts

    with WeightCasts(*trainer.compute.params, *trainer.compute.master_params) as step:
        trainer.train_step()
    assert step.casts == 0  # the decoder's matrices: not one cast
    assert step.refreshes == 1  # the copies, refreshed once after Adam
    with WeightCasts(trainer.model) as everything:
        trainer.train_step()
    # what is left: the fp32 embedding (tied to the output layer) and its bias, cast by
    # autocast for the output matmul in the forward
    assert 0 < everything.casts <= 4 < plain.casts

    # fp32 master and Adam state; the copies equal the master rounded to bf16
    # per layer: qkv, out and r_net weights, fc1 and fc2 weights and biases; u and v
    assert len(trainer.compute.params) == trainer.model_config.n_layer * 7 + 2
    for p, m in zip(trainer.compute.params, trainer.compute.master_params, strict=True):
        assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
        assert torch.equal(p, m.to(torch.bfloat16))
    assert trainer.compute.model.embed.layers[0].weight is trainer.model.embed.layers[0].weight
    state = trainer.optimizer.state[trainer.optimizer.param_groups[0]["params"][0]]
    assert state["exp_avg"].dtype == torch.float32
    assert all(p.grad is None for p in trainer.compute.params)


def test_bf16_run_resumes_exactly(tmp_path):
    """The copies are a function of the master: `last` needs nothing more, and a bf16 run
    stopped and resumed equals one that ran straight through."""
    from txlm.training import Trainer
    from txlm.training.config import resolve

    text = tiny_text(tmp_path, n_chars=6000)

    def run(out, *sets, resume=None):
        config = resolve(
            "debug",
            None,
            [
                f"data.dataset=text:{text}",
                f"data.data_dir={tmp_path / 'data'}",
                "model.dropout=0.2",
                "optim.max_steps=4",
                "eval.eval_interval=0",
                "eval.final_eval=false",
                "eval.max_eval_steps=1",
                "run.precision=bf16",
                "run.tensorboard=false",
                "run.progress=false",
                *sets,
            ],
        )
        trainer = Trainer(config, tmp_path / out, resume=resume, echo=False)
        trainer.fit()
        return trainer

    straight = run("straight")
    run("paused", "run.stop_at=2")
    resumed = run("resumed", resume=tmp_path / "paused" / "last")
    want = straight.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_bf16_activations_follow_the_float32_stream_run(tmp_path, monkeypatch):
    """Same seed, same data, 40 Adam steps of a 3-layer model: the loss curve with bf16
    activations stays as close to the float32-stream bf16 run as that run is to fp32 (the
    noise of bf16 itself), and on average no farther from fp32 than it."""
    import txlm.training.loop as loop
    from txlm.training import Trainer

    def curve(precision: str, activations: bool) -> list[float]:
        monkeypatch.setattr(loop, "ComputeCopy",
                            functools.partial(ComputeCopy, activations=activations))  # fmt: skip
        config = tiny_config(
            tmp_path, "model.dropout=0.0", f"run.precision={precision}", "optim.max_steps=40",
            "optim.lr=3e-3", "model.d_model=64", "model.n_layer=3", "model.d_inner=128",
            "model.mem_len=32", "eval.eval_interval=0", "eval.final_eval=false",
            "run.tensorboard=false", "run.progress=false", "run.threads=1",
        )  # fmt: skip
        trainer = Trainer(config, tmp_path / f"{precision}-{activations}", echo=False)
        return [trainer.train_step().loss.item() for _ in range(40)]

    fp32, stream32, stream16 = curve("fp32", False), curve("bf16", False), curve("bf16", True)
    assert stream16[-1] < stream16[0] - 0.5  # it learns
    noise = [abs(a - b) for a, b in zip(stream32, fp32, strict=True)]
    apart = [abs(a - b) for a, b in zip(stream16, stream32, strict=True)]
    off = [abs(a - b) for a, b in zip(stream16, fp32, strict=True)]
    assert max(apart) <= 2 * max(noise) + 1e-3
    assert sum(off) <= 2 * sum(noise) + 1e-3 * len(off)
