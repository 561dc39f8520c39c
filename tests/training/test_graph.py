"""A training step has no host sync and, compiled, is a fixed number of graphs (C37).

- compiled (AOT autograd, so the backward is traced too), a model with an adaptive softmax
  builds three graphs and never breaks one: its forward and backward without memory (the
  first step) and with memory (every later step), and the update's clipping and finiteness
  check; twenty steps through the warm-up into the cosine schedule compile nothing more;
- one whole ``Trainer.train_step`` of a narrow wt103-shaped model as the trainer builds it
  for CUDA (padded widths, bf16 compute copy, static softmax buckets), run eagerly under a
  dispatch mode so that every operation is seen, reads nothing back to the host;
- the learning rate as a 0-d tensor steps fused Adam bit for bit as the Python float did.
"""

from __future__ import annotations

import functools

import torch
from torch._dynamo.utils import counters

from tests.helpers.train import tiny_config
from tests.training.test_step import HostReads
from txlm.training.config import OptimConfig
from txlm.training.schedule import learning_rate
from txlm.training.step import Update

QUIET = ("eval.eval_interval=0", "eval.final_eval=false", "run.tensorboard=false",
         "run.progress=false")  # fmt: skip


def test_a_compiled_adaptive_softmax_step_is_three_graphs_without_breaks(tmp_path, monkeypatch):
    from txlm.training import Trainer

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    config = tiny_config(
        tmp_path, "model.cutoffs=[20,40]", "optim.max_steps=20", "optim.warmup_steps=5",
        "optim.schedule=cosine", "run.compile=true", "run.threads=2", *QUIET,
    )  # fmt: skip
    trainer = Trainer(config, tmp_path / "run", echo=False)
    assert trainer.task.buckets is not None  # sized on the host: no read back, no break
    rates = []
    for step in range(20):
        stats = trainer.train_step()
        rates.append(stats.lr)
        if step == 1:
            after_two = counters["stats"]["unique_graphs"]
    try:
        assert dict(counters["graph_break"]) == {}
        assert after_two == counters["stats"]["unique_graphs"] == 3
        assert dict(counters["recompiles"]) == {}
    finally:
        torch._dynamo.reset()
    assert rates[0] < rates[4] == max(rates) and rates[-1] < rates[6] < rates[4]  # warm-up, cosine
    assert torch.isfinite(stats.loss) and stats.finite


def test_a_cuda_built_trainer_step_reads_nothing_back(tmp_path, monkeypatch):
    """The trainer as ``run.compile`` builds it (as on CUDA: host-sized buckets), with padded
    widths (``run.align_heads``, CUDA's default) and the bf16 compute copy; its compiled
    pieces swapped for their eager selves so the dispatch mode sees every operation of
    the step: forward, backward, clipping, Adam, the memory hand-over, the stats."""
    from txlm.training import Trainer

    # wt103-base narrowed as in test_model_cuda_shapes: d_model 82, d_inner 210, 2 heads
    # of 41; a word-level vocabulary with three tail clusters (buckets sized on the host)
    config = tiny_config(
        tmp_path, "data.level=word", "model.cutoffs=[100,300,600]", "model.div_val=1",
        "model.d_model=82", "model.n_head=2", "model.d_head=41", "model.d_inner=210",
        "model.n_layer=2", "model.tgt_len=32", "model.mem_len=32", "model.dropout=0.1",
        "data.batch_size=4", "run.precision=bf16", "run.align_heads=true",
        "run.compile=true", "run.threads=2", *QUIET, n_chars=24000,
    )  # fmt: skip
    trainer = Trainer(config, tmp_path / "run", echo=False)
    assert len(trainer.vocab) > 600
    assert trainer.model.stored.d_model == 88 == trainer.model.layers[0].attn.qkv.weight.size(1)
    assert trainer.task.buckets is not None  # sized from the labels on the host
    trainer.forward_model = trainer.forward_model._orig_mod  # eager: every op dispatched
    trainer.update._clip_and_check = trainer.update.clip_and_check
    trainer.train_step()  # the second step has memory
    reads = HostReads(monkeypatch)
    with reads:
        stats = trainer.train_step()
    assert dict(reads.calls) == {}
    monkeypatch.undo()
    values = trainer.account(stats)
    assert values["finite"] == 1.0 and values["tokens"] == 4 * 32


def test_a_tensor_learning_rate_steps_adam_as_the_float_did():
    """200 fused Adam steps through warm-up and cosine, clipped: the lr as the trainer's 0-d
    tensor and as a Python float give the same weights and moments, bit for bit."""
    optim = OptimConfig(lr=3e-3, warmup_steps=20, max_steps=200, schedule="cosine")

    def run(tensor_lr: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(37, 11)), torch.nn.Parameter(torch.randn(5))]
        opt = torch.optim.Adam(params, lr=optim.lr, fused=True)
        update = Update(opt, torch.amp.GradScaler("cuda", enabled=False), 0.5,
                        device=torch.device("cpu"), compiled=False)  # fmt: skip
        g = torch.Generator().manual_seed(1)
        for step in range(optim.max_steps):
            lr = learning_rate(step, optim)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if tensor_lr:
                update(lr, torch.tensor(True))
            else:
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
                opt.zero_grad(set_to_none=True)
        moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
        return [p.detach() for p in params] + moments

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)
