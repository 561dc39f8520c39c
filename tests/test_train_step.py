"""One training step's contracts, in process and fast: gradient clipping is applied (the
norm Adam steps with) and the reported norm is the one before clipping; resuming restores
the RNG (dropout on), not only the weights; the sinusoid's [sin | cos] layout."""

from __future__ import annotations

import math

import pytest
import torch

from _train_helpers import tiny_text


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("step")
    return root, tiny_text(root, n_chars=6000)


def _trainer(corpus, out, *sets: str, resume=None):
    from txlm.train import Trainer
    from txlm.train_config import resolve

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
    reported = [trainer.train_step()["grad_norm"] for _ in range(3)]
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
