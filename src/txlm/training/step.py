"""One optimisation step: forward and backward over the gradient-accumulation chunks (each
chunk's loss the task's, ``txlm.training.tasks``), then the update (clipping, the finiteness
check, Adam), all queued on the device (contract C37).

Legend: b rows of this rank, A gradient-accumulation chunks of c = b / A rows, W ranks,
N counted tokens of the global batch.

Nothing inside a step reads a device value back to the host, so a GPU never waits for the
host between steps:

- the token count N, the loss, the gradient norm and whether both are finite stay 0-d
  tensors (``StepStats``); the loop reads them, one transfer, after the next step is queued;
- the learning rate is one 0-d tensor that every parameter group holds (``Update.lr``),
  filled with the schedule's value each step: every input of the update is then a device
  tensor, which a captured or compiled optimizer step reads anew each time (a Python float
  is baked into such a graph as a constant: a recompile per value);
- a step that is not finite is skipped by the fused Adam kernel itself (``found_inf``, the
  mechanism of the grad scaler, fed with this step's finiteness) and its memory is zeroed
  on the device;
- the adaptive softmax's tail clusters take buckets sized on the host from the batch's
  labels where the step is compiled or runs on CUDA (``TailBuckets``): its one read back
  (the clusters' token counts) goes away, and its shapes are static.

Compiled (``run.compile``), a step is a fixed number of graphs with no graph break: the
model's forward and, through AOT autograd, its backward is one graph (two are built: the
first step has no memory yet), and the clipping with the finiteness check is one more
(``Update``); Adam is its one fused kernel. The token count, the loss sum and the memory
hand-over between them are a handful of eager element-wise ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from txlm.devices import autocast
from txlm.training import distributed as dist
from txlm.training.state import Carry, Memory, MemoryChunk


def graphs_compiled() -> int:
    """How many graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class TailBuckets:
    """Sizes of the adaptive softmax's tail buckets for each forward of a step
    (``AdaptiveLogSoftmax.nll``), counted on the host from the labels as the data stream
    read them (``Batch.host_labels``): static shapes with nothing read back from the device,
    and a bucket no bigger than its cluster's tokens need plus a margin, where "all" would
    run every token through every tail cluster.

    A size only grows: it starts from the training split's cluster frequencies (a quarter
    more than a call's expected count, rounded up to ``quantum`` tokens) and, when a call
    has more tokens of a cluster than its bucket holds, becomes a quarter more than that
    count. A compiled step so meets a handful of sizes over a run (a graph each), usually
    only the first. Every size holds its call's tokens: the loss is exact.
    """

    def __init__(
        self, cutoffs: Sequence[int], frequencies: Sequence[float], tokens: int, quantum: int = 64
    ) -> None:
        self.cutoffs = np.asarray(cutoffs, dtype=np.int64)
        self.quantum = quantum
        # ``tokens``: of one forward (rows x segment length), for the starting sizes
        self.sizes = [self._round(f * tokens) for f in frequencies]

    @classmethod
    def for_corpus(
        cls, ids: np.ndarray, cutoffs: Sequence[int], tokens: int, sample: int = 1 << 20
    ) -> TailBuckets:
        """From a token stream (the training split): each tail cluster's share of an evenly
        strided sample of at most ``sample`` of its tokens. Quanta of 64 tokens (aligned
        shapes), fewer for a small call."""
        picked = np.asarray(ids[:: max(1, len(ids) // sample)])
        counts = cls._counts(picked, np.asarray(cutoffs, dtype=np.int64))
        quantum = min(64, max(1, tokens // 16))
        return cls(cutoffs, (counts / max(1, picked.size)).tolist(), tokens, quantum)

    @staticmethod
    def _counts(labels: np.ndarray, cutoffs: np.ndarray) -> np.ndarray:
        """Tokens per tail cluster [C] (ignored labels, -100, count as shortlist tokens)."""
        cluster = np.searchsorted(cutoffs, np.ravel(labels), side="right")
        return np.bincount(cluster, minlength=len(cutoffs) + 1)[1:]

    def _round(self, count: float) -> int:
        """A quarter more than ``count``, in whole quanta (the softmax caps a size at its
        call's token count)."""
        q = self.quantum
        return max(q, -(-int(1.25 * count) // q) * q)

    def __call__(self, host_labels: np.ndarray) -> tuple[int, ...]:
        """The sizes for one forward's labels [c, L], on the host."""
        counts = self._counts(host_labels, self.cutoffs).tolist()
        grown = zip(self.sizes, counts, strict=True)
        self.sizes = [s if n <= s else self._round(n) for s, n in grown]
        return tuple(self.sizes)


def tail_buckets(
    model: Any, ids: np.ndarray, device: torch.device, compiled: bool, tokens: int
) -> TailBuckets | None:
    """How a step sizes the tail buckets: None (the softmax's "counted": its clusters'
    token counts read back once a step, a graph break when compiled; the least work, and on
    the CPU's eager path a read costs nothing) or, on CUDA or compiled, from the labels on
    the host (``TailBuckets``). None too for a softmax without tail clusters."""
    cutoffs = model.softmax.cutoffs
    if not cutoffs or not (compiled or device.type == "cuda"):
        return None
    return TailBuckets.for_corpus(ids, cutoffs, tokens)


@dataclass
class StepStats:
    """One step's numbers as ``Trainer.train_step`` leaves them: tensors on the device, 0-d,
    until ``read``."""

    step: int  # the step's number (1-based)
    lr: float
    loss: Tensor  # mean token loss of the global batch
    grad_norm: Tensor  # before clipping
    tokens: Tensor  # labelled tokens of the global batch
    finite: Tensor  # bool: the loss (and, but under fp16, the gradient norm) finite; stepped

    def read(self) -> dict[str, float]:
        """The numbers on the host, in one transfer."""
        numbers = [self.loss, self.grad_norm, self.tokens, self.finite]
        loss, grad_norm, tokens, finite = torch.stack([x.double() for x in numbers]).tolist()
        return {"loss": loss, "grad_norm": grad_norm, "tokens": tokens, "finite": finite,
                "lr": self.lr}  # fmt: skip


def token_scale(labels: Tensor, device: torch.device, world_size: int) -> tuple[Tensor, Tensor]:
    """(N, W / max(N, 1)): the global batch's counted tokens (a collective over ranks) and
    the factor that turns a rank's summed token losses into its share of the mean, so that
    DDP's gradient average is exactly the mean token loss of the global batch."""
    local_tokens = (labels != -100).sum().to(device, torch.float64)
    n_global = dist.all_reduce_sum(local_tokens.reshape(1))[0]
    return n_global, (world_size / n_global.clamp(min=1.0)).float()


# (model, batch, labels, rows, the rows' memory) -> (summed loss, the chunk's new memory)
ChunkLoss = Callable[[Any, Any, Tensor, slice, MemoryChunk], tuple[Tensor, Carry | None]]


def forward_backward(
    model: Any,
    loss_of: ChunkLoss,
    batch: Any,
    labels: Tensor,
    memory: Memory,
    *,
    scale: Tensor,
    scaler: torch.amp.GradScaler,
    grad_accum: int,
    precision: str,
    device: torch.device,
) -> tuple[Tensor, list[Carry | None]]:
    """Forward and backward of each of the A chunks of the batch's rows (``loss_of``: the
    task's loss of the chunk, with its rows' memory) on loss * ``scale``; gradients add up
    in ``.grad``. Returns this rank's summed loss (float64, detached) and what each chunk
    carries to the next step (its new memory and mask; None: nothing)."""
    per = labels.size(0) // grad_accum
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    parts: list[Carry | None] = []
    for i in range(grad_accum):
        rows = slice(i * per, (i + 1) * per)
        # DDP: only the last chunk's backward reduces the gradients across ranks
        sync = (
            model.no_sync()
            if i < grad_accum - 1 and hasattr(model, "no_sync")
            else contextlib.nullcontext()
        )
        with sync:
            with autocast(device, precision):
                loss, carry = loss_of(model, batch, labels, rows, memory.chunk(rows))
            scaler.scale(loss * scale).backward()
        loss_sum += loss.detach().to(device, torch.float64)
        parts.append(carry)
    return loss_sum, parts


class Update:
    """The optimizer's half of a step: clip the gradients to norm ``clip`` (0: no clipping),
    check finiteness, step Adam where finite; returns (the norm before clipping, finite).

    ``compiled``: clipping and the finiteness check run as one compiled graph; Adam stays
    the fused kernel it is (one kernel over all tensors already, and torch keeps dynamo out
    of fused optimizers: tracing its step would break the graph). The learning rate is a
    0-d tensor on the device: float64 on the CPU, where fused Adam reads it as the double a
    Python float would be (the schedule's values bit for bit), float32 on CUDA, whose fused
    kernels read a float.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        clip: float,
        *,
        device: torch.device,
        compiled: bool,
    ) -> None:
        self.optimizer, self.scaler, self.clip = optimizer, scaler, clip
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        self.lr = torch.zeros((), dtype=dtype, device=device)
        self._clip_and_check = self.clip_and_check
        if compiled:
            self._clip_and_check = torch.compile(self.clip_and_check)

    def __call__(self, lr: float, loss_finite: Tensor) -> tuple[Tensor, Tensor]:
        self.lr.fill_(lr)
        # Installed every step: loading a checkpoint's optimizer state puts floats back.
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.scaler.unscale_(self.optimizer)
        grad_norm, finite, found_inf = self._clip_and_check(loss_finite)
        if self.scaler.is_enabled():  # fp16: the grad scaler skips its own inf steps
            self.scaler.step(self.optimizer)  # it hands fused Adam its own found_inf
            self.scaler.update()
            finite = loss_finite
        else:
            # fused Adam skips the whole update (moments and step count too) where
            # found_inf is 1: the grad scaler's mechanism, fed with this step's finiteness
            self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite

    def clip_and_check(self, loss_finite: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Scale the gradients to norm ``clip`` at most; returns the norm before, whether
        the step is finite (loss and norm), and Adam's ``found_inf`` (1.0: skip)."""
        params = [
            p for group in self.optimizer.param_groups for p in group["params"]
            if p.grad is not None
        ]  # fmt: skip
        if self.clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        finite = loss_finite & torch.isfinite(grad_norm)
        return grad_norm, finite, (~finite).float()
