"""Process-group plumbing for ``torchrun`` (DDP). The model knows nothing of it.

``torchrun --nproc_per_node N -m txlm train ...`` (N GPUs of one machine, or N processes on
a CPU) sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous variables; ``init()`` reads them
and starts a process group. Without them everything here degrades to a single process: rank
0 of 1, and the collectives return their input, so the training loop has one code path.

On GPUs the group is ``cpu:gloo,cuda:nccl``: NCCL reduces CUDA tensors, gloo whatever is on
the host (the object collectives that gather RNG states). The tensor collectives here take
their tensor where it is: callers keep the per-step scalars on the training device, so a
step sends nothing through the host.
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device_type: str) -> DistInfo:
    """Join the torchrun process group if there is one; a single process otherwise."""
    if not launched_by_torchrun():
        return DistInfo()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if world > 1 and not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend_for(device_type))
    return DistInfo(rank=rank, world_size=world, local_rank=local)


def data_parallel(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` under DDP: gradients averaged over ranks in backward.

    The model has no buffers to keep in step (every tensor is a parameter), so none are
    broadcast before each forward: ``forward_sync_buffers=False`` where DDP takes it (torch
    2.13 deprecates ``broadcast_buffers`` for it), ``broadcast_buffers=False`` where DDP has
    only that (torch 2.11).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    new = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    return DDP(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        **{"forward_sync_buffers" if new else "broadcast_buffers": False},
    )


def backend_for(device_type: str) -> str:
    """The process group's backends: NCCL for CUDA tensors plus gloo for host tensors."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def shutdown() -> None:
    """Leave the process group together, once every rank is done with its writes."""
    if active():
        dist.barrier()
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank whose work is written and closed and whose group is left, skipping
    the interpreter's teardown: under gloo (torch 2.13) a rank can abort in C++ teardown
    ("terminate called without an active exception", no Python frame), and torchrun then
    reports the whole run failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier() -> None:
    if active():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place and returned (the identity in one process)."""
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (JSON-able values)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (small JSON-able values such as RNG states)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped [b, ...] tensors of all ranks along dim 0, rank order."""
    if not active():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)
