"""Multi-GPU correctness without a GPU: every tensor the trainer hands to a collective lives
on the training device (NCCL rejects host tensors), and on GPUs the process group also has
gloo for what stays on the host.

The trainer is built on the CPU, then told its device is ``meta`` (a stand-in for
``cuda:N``); the reduction helpers of ``txlm.training.distributed`` are replaced by recorders that
note each tensor's device and answer as one process would. A scalar built on the host (the
old ``.cpu()`` of the token count and loss, a flag made with ``torch.tensor([...])``) shows
up as a ``cpu`` tensor.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.train import tiny_config
from txlm.training import distributed as dist


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    from txlm.training import Trainer

    config = tiny_config(
        tmp_path,
        "model.dropout=0.1",
        "optim.grad_accum=2",
        "run.tensorboard=false",
        "run.progress=false",
        "run.time_budget_s=1000",
    )
    return Trainer(config, tmp_path / "run", echo=False)


class Recorder:
    """Stands in for the process group: records (collective, tensor device) pairs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.device]] = []

    def reduction(self, name: str):
        def collective(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self.calls.append((name, tensor.device))
            # one process's answer, on the host: a meta tensor holds no values to return
            return torch.zeros(tensor.shape, dtype=tensor.dtype)

        return collective

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_gather_rows", tensor.device))
        return tensor


def test_no_host_tensor_reaches_a_collective(trainer, monkeypatch):
    rec = Recorder()
    for name in ("all_reduce_sum", "all_reduce_max"):
        monkeypatch.setattr(dist, name, rec.reduction(name))
    monkeypatch.setattr(dist, "all_gather_rows", rec.gather)
    monkeypatch.setattr(dist, "all_gather_object", lambda obj: [obj, obj])
    model_device = next(trainer.model.parameters()).device
    trainer.device = torch.device("meta")  # what the trainer believes: not the CPU
    # two processes, as far as the trainer knows (the recorders answer as one)
    trainer.dist = trainer.checkpoints.dist = dist.DistInfo(world_size=2)

    for _ in range(2):  # the second step has memory from the first
        trainer.train_step()
        trainer._stop_flags()
    trainer.save("last")

    scalars = [(n, d) for n, d in rec.calls if n != "all_gather_rows"]
    # per step: the global token count, the global loss; then the stop flags
    assert [n for n, _ in scalars] == ["all_reduce_sum", "all_reduce_sum", "all_reduce_max"] * 2
    assert all(d == torch.device("meta") for _, d in scalars), scalars
    gathered = [d for n, d in rec.calls if n == "all_gather_rows"]
    assert len(gathered) == trainer.model_config.n_layer  # the memory, where the model is
    assert all(d == model_device for d in gathered)


def test_gpu_process_group_has_gloo_for_host_tensors(monkeypatch):
    seen = {}
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.dist, "init_process_group", lambda backend: seen.update(b=backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.update(device=i))
    info = dist.init("cuda")
    assert seen == {"b": "cpu:gloo,cuda:nccl", "device": 1}
    assert (info.rank, info.world_size, info.local_rank) == (1, 2, 1)
    seen.clear()
    dist.init("cpu")
    assert seen == {"b": "gloo"}
    assert "RANK" in os.environ  # (monkeypatch restores the environment)
