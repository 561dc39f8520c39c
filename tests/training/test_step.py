"""One training step's contracts, in process and fast: gradient clipping is applied (the
norm Adam steps with) and the reported norm is the one before clipping; resuming restores
the RNG (dropout on), not only the weights; a step reads nothing back to the host, and one
that is not finite leaves the weights and Adam's state as they were; the memory's state in
real shapes; run.deterministic and run.threads hold inside the trainer's work only; the
sinusoid's [sin | cos] layout."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.train import tiny_text


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("step")
    return root, tiny_text(root, n_chars=6000)


def _trainer(corpus, out, *sets: str, resume=None):
    from txlm.training import Trainer
    from txlm.training.config import resolve

    root, text = corpus
    config = resolve(
        "debug",
        None,
        [
            f"data.dataset=text:{text}",
            f"data.data_dir={root / 'data'}",
            "eval.eval_interval=0",
            "eval.final_eval=false",
            "eval.max_eval_steps=1",
            "run.tensorboard=false",
            "run.progress=false",
            "run.log_interval=1",
            *sets,
        ],
    )
    return Trainer(config, out, resume=resume, echo=False)


def _norm(params) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))


def _watch_norms(trainer) -> tuple[list[float], list[float]]:
    """Record the gradient norm after backward (before clipping) and when Adam steps."""
    params = list(trainer.model.parameters())
    before, stepped = [], []
    unscale, step = trainer.scaler.unscale_, trainer.optimizer.step

    def unscale_(optimizer):
        unscale(optimizer)
        before.append(_norm(params))

    def optimizer_step(*args, **kwargs):
        stepped.append(_norm(params))
        return step(*args, **kwargs)

    trainer.scaler.unscale_ = unscale_
    trainer.optimizer.step = optimizer_step
    return before, stepped


@pytest.mark.parametrize("clip", [0.01, 0.0])
def test_clipping_is_applied_and_the_reported_norm_is_before_it(corpus, tmp_path, clip):
    trainer = _trainer(corpus, tmp_path, f"optim.clip={clip}")
    before, stepped = _watch_norms(trainer)
    reported = [float(trainer.train_step().grad_norm) for _ in range(3)]
    assert len(before) == len(stepped) == 3
    assert min(before) > 0.05  # the raw gradients are well above clip=0.01
    assert reported == pytest.approx(before, rel=1e-5)
    if clip > 0:
        assert stepped == pytest.approx([clip] * 3, rel=1e-4)  # Adam sees clipped gradients
    else:  # clip <= 0: off
        assert stepped == pytest.approx(before, rel=1e-6)


def test_resume_restores_the_dropout_rng(corpus, tmp_path):
    """Dropout on: 2 steps, save `last`, resume in a new trainer, 2 more == 4 straight.
    Drawing from another RNG state after resuming changes the result, so the comparison
    depends on the RNG being restored, not only on weights, Adam and memory."""
    drop = ("model.dropout=0.3", "optim.max_steps=4")
    straight = _trainer(corpus, tmp_path / "straight", *drop)
    straight.fit()
    paused = _trainer(corpus, tmp_path / "paused", *drop, "run.stop_at=2")
    paused.fit()
    last = tmp_path / "paused" / "last"
    resumed = _trainer(corpus, tmp_path / "resumed", *drop, resume=last)
    assert resumed.step == 2
    resumed.fit()
    want = straight.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, want[name]), name

    other = _trainer(corpus, tmp_path / "other", *drop, resume=last)
    torch.manual_seed(12345)  # the weights, Adam and memory as saved; the dropout RNG not
    for _ in range(2):
        other.train_step()
    assert any(not torch.equal(v, want[k]) for k, v in other.model.state_dict().items())


class HostReads(TorchDispatchMode):
    """Counts what makes the host wait for the device: the ops behind ``item()``,
    ``float(t)``, ``bool(t)`` and data-dependent shapes, and the ``tolist`` / ``numpy``
    conversions (they read a tensor's memory directly, beside the dispatcher)."""

    OPS = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal")

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()
        for name in ("tolist", "numpy"):
            real = getattr(torch.Tensor, name)

            def counted(t, *args, _real=real, _name=name, **kwargs):
                self.calls[_name] += 1
                return _real(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.OPS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("optim.grad_accum=2", "model.dropout=0.1", "optim.clip=0"),
        ("run.precision=bf16",),
        ("data.doc_mode=reset", "run.deterministic=true"),
    ],
    ids=["fp32", "accum-dropout-noclip", "bf16", "reset-deterministic"],
)
def test_a_step_reads_nothing_back_from_the_device(corpus, tmp_path, monkeypatch, sets):
    """Forward, backward, clipping, the finiteness check and Adam: all queued, no value read
    back; the loop reads the numbers (one transfer) when the next step is queued."""
    trainer = _trainer(corpus, tmp_path, "optim.max_steps=4", *sets)
    first = trainer.train_step()  # the second step has memory
    reads = HostReads(monkeypatch)
    with reads:
        second = trainer.train_step()
    assert dict(reads.calls) == {}
    monkeypatch.undo()
    assert first.step == 1 and second.step == 2 and trainer.step == 2
    values = trainer.account(second)  # the read, outside the step
    assert values["finite"] == 1.0 and math.isfinite(values["loss"]) and values["tokens"] > 0
    assert trainer.tokens_seen == int(values["tokens"])  # first not yet accounted


def test_an_adaptive_softmax_step_reads_no_scalar(corpus, tmp_path, monkeypatch):
    """With tail clusters the trainer still reads no scalar; what remains is the adaptive
    softmax's own read of its clusters' token counts (the model's, not the trainer's), and
    with buckets sized on the host (here: every token each) not even that."""
    trainer = _trainer(corpus, tmp_path, "model.cutoffs=[20]", "model.div_val=2")
    trainer.train_step()
    reads = HostReads(monkeypatch)
    with reads:
        trainer.train_step()
    assert dict(reads.calls) == {"tolist": 1}
    trainer.task.buckets = lambda host_labels: (host_labels.size,)  # the host-side seam
    static = HostReads(monkeypatch)
    with static:
        trainer.train_step()
    assert dict(static.calls) == {}


def test_a_non_finite_step_leaves_weights_and_adam_as_they_were(corpus, tmp_path):
    """The skip is decided on the device (fused Adam's found_inf): weights, both moments and
    the step count unchanged; the memory it hands on is zeros; the next finite step runs."""
    trainer = _trainer(corpus, tmp_path, "optim.max_bad_steps=3")
    trainer.account(trainer.train_step())

    def snapshot():
        opt = {
            f"{i}.{k}": v.clone()
            for i, st in enumerate(trainer.optimizer.state.values())
            for k, v in st.items()
        }
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}, opt

    before = snapshot()
    real = trainer.forward_model

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        out.losses = out.losses * float("nan")
        return out

    trainer.forward_model = poisoned
    stats = trainer.train_step()
    with pytest.warns(RuntimeWarning, match="non-finite"):
        values = trainer.account(stats)
    assert values["finite"] == 0.0 and trainer.bad_steps == 1
    after = snapshot()
    for a, b in zip(before, after, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), "a skipped step changed the state"
    assert all(not m.any() for m in trainer.memory.mems)

    trainer.forward_model = real
    values = trainer.account(trainer.train_step())
    assert values["finite"] == 1.0 and trainer.bad_steps == 0
    assert any(not torch.equal(v, before[0][k]) for k, v in trainer.model.state_dict().items())


def test_memory_state_holds_the_real_width_and_rows():
    """Memory's state: each layer's rows at the real d_model (a padded model stores zeros
    past it), the mask only when carried; loading pads back and checks the shapes."""
    from txlm.training.state import Memory

    memory = Memory(rows=2, n_layer=2, d_model=3, width=8)
    assert memory.state_dict() == {}
    mems = [torch.cat([torch.randn(2, 4, 3), torch.zeros(2, 4, 5)], dim=-1) for _ in range(2)]
    memory.update([(mems, None)])
    state = memory.state_dict()
    assert sorted(state) == ["mems.0", "mems.1"] and state["mems.0"].shape == (2, 4, 3)
    other = Memory(rows=2, n_layer=2, d_model=3, width=8)
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.mems, mems, strict=True))
    assert other.mask is None
    with pytest.raises(ValueError, match="expected"):
        Memory(rows=3, n_layer=2, d_model=3).load_state_dict(state)


def _seen_in_forward(trainer, probe):
    """A list that receives ``probe()`` at each of the trainer's forward calls."""
    seen = []
    real = trainer.forward_model

    def forward(*args, **kwargs):
        seen.append(probe())
        return real(*args, **kwargs)

    trainer.forward_model = forward
    return seen


def test_deterministic_mode_is_on_inside_the_trainer_only(corpus, tmp_path):
    assert not torch.are_deterministic_algorithms_enabled()
    trainer = _trainer(corpus, tmp_path, "run.deterministic=true", "optim.max_steps=2")
    assert not torch.are_deterministic_algorithms_enabled()
    seen = _seen_in_forward(trainer, torch.are_deterministic_algorithms_enabled)
    trainer.train_step()
    assert not torch.are_deterministic_algorithms_enabled()
    trainer.fit()
    assert seen == [True, True] and not torch.are_deterministic_algorithms_enabled()


def test_run_threads_hold_inside_the_trainer_only(corpus, tmp_path):
    """run.threads is torch's process-wide thread count while the trainer steps and fits,
    and the caller's again after each (a trainer built in a test or a notebook)."""
    threads = torch.get_num_threads()
    other = 2 if threads == 1 else 1
    trainer = _trainer(corpus, tmp_path, f"run.threads={other}", "optim.max_steps=2")
    assert torch.get_num_threads() == threads
    seen = _seen_in_forward(trainer, torch.get_num_threads)
    trainer.train_step()
    assert torch.get_num_threads() == threads
    trainer.fit()
    assert seen == [other, other] and torch.get_num_threads() == threads


def test_sinusoid_is_sines_then_cosines():
    from txlm.model.positional import sinusoid

    d = 6
    positions = torch.tensor([0.0, 1.0, 5.0])
    got = sinusoid(positions, d)
    inv = [1.0, 10000 ** (-2 / 6), 10000 ** (-4 / 6)]  # 1 / 10000^(2k/D)
    want = [
        [math.sin(p * f) for f in inv] + [math.cos(p * f) for f in inv] for p in positions.tolist()
    ]
    assert got.shape == (3, d)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=0)
    assert got[0].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # not interleaved
