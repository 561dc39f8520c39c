"""Gradient accumulation is the same step as one chunk: with ``optim.grad_accum = k`` the
gradient Adam receives (before clipping) and the reported gradient norm equal those of the
same global batch run as one chunk, step after step with the memory carried.

Adam and clipping hide a constant scale of the gradient (Adam divides it out; a clipped norm
is the clip), so the loss curve alone cannot tell a chunk gradient multiplied by k from the
right one: this test compares the gradients themselves, before clipping.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.train import tiny_text


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("accum")
    return root, tiny_text(root, n_chars=6000)


def _run(corpus, out, accum: int, steps: int) -> tuple[list[dict], list[float]]:
    """Per step: every parameter's gradient as Adam gets it before clipping, and the
    reported norm."""
    from txlm.training import Trainer
    from txlm.training.config import resolve

    root, text = corpus
    config = resolve(
        "debug",
        None,
        [
            f"data.dataset=text:{text}",
            f"data.data_dir={root / 'data'}",
            "data.batch_size=4",
            f"optim.grad_accum={accum}",
            "optim.clip=0.05",  # active: the raw norms are well above it
            "eval.eval_interval=0",
            "eval.final_eval=false",
            "run.tensorboard=false",
            "run.progress=false",
            "run.deterministic=true",
        ],
    )
    trainer = Trainer(config, out, echo=False)
    grads: list[dict] = []
    unscale = trainer.scaler.unscale_

    def unscale_(optimizer):  # the last thing before clipping
        unscale(optimizer)
        grads.append(
            {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
             if p.grad is not None}
        )  # fmt: skip

    trainer.scaler.unscale_ = unscale_
    norms = [float(trainer.train_step().grad_norm) for _ in range(steps)]
    return grads, norms


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulated_gradient_equals_the_one_chunk_gradient(corpus, tmp_path, accum):
    steps = 3  # the later steps read each chunk's rows' memory
    one_grads, one_norms = _run(corpus, tmp_path / "one", 1, steps)
    acc_grads, acc_norms = _run(corpus, tmp_path / f"acc{accum}", accum, steps)
    assert min(one_norms) > 0.5  # clipping to 0.05 acts on every step
    assert acc_norms == pytest.approx(one_norms, rel=1e-5)
    for step, (one, acc) in enumerate(zip(one_grads, acc_grads, strict=True)):
        assert one.keys() == acc.keys()
        for name in one:
            where = f"step {step + 1}, {name}"
            torch.testing.assert_close(acc[name], one[name], rtol=1e-4, atol=1e-7, msg=where)
