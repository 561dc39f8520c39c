"""Weight averaging: an average of the weights that training visits, which validation, `best`
and the final evaluation read in place of the last weights (``optim.average``).

The paper's Penn Treebank recipe (Sec. 4.1: "similar to AWD-LSTM, we apply variational
dropout and weight average"). AWD-LSTM (Merity et al. 2017) averages the iterates of SGD over
the last part of training (averaged SGD, Polyak averaging): the average sits nearer the
middle of the valley the last steps bounce around in, which on a small corpus generalises
better than any single iterate. Two kinds, from step ``start`` on:

    uniform   w_avg = mean of the weights after steps start, start + 1, ..., t
    ema       w_avg <- decay * w_avg + (1 - decay) * w_t   (w_avg = w_start at first)

The arithmetic is ``torch.optim.swa_utils``' (``get_swa_multi_avg_fn``,
``get_ema_multi_avg_fn``: the update of ``AveragedModel``), applied to the trainer's own
parameters rather than to a deep copy of the module: what is averaged is the fp32 master
(under bf16 the compute copy is made from it; the average never is), and the count stays a
host integer, so an update reads nothing back from the device. Under DDP every rank holds the
same master weights after every step, so every rank's average is the same, bit for bit,
without a collective. Frozen parameters (``optim.freeze``) never change and are left out.

``state_dict()`` holds the average in the real shapes of the weights (as checkpoints hold
them, ``txlm.model.align``) and the count; ``out/last`` saves it beside the weights, so a
resumed run continues the same average bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_multi_avg_fn, get_swa_multi_avg_fn

from txlm.model import align

Mode = Literal["uniform", "ema"]


class WeightAverage:
    """An average of ``model``'s trainable parameters from step ``start`` on (see the module
    docstring). ``update(step)`` after each optimizer step; ``swapped()`` to evaluate or save
    with the average; ``state_dict()`` / ``load_state_dict()`` to resume it."""

    def __init__(self, model: nn.Module, mode: Mode, start: int = 1, decay: float = 0.999):
        if mode not in ("uniform", "ema"):
            raise ValueError(f"weight averaging is uniform or ema, got {mode!r}")
        self.mode, self.start, self.decay = mode, start, decay
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.averaged = [p.detach().clone() for p in self.params]
        self.count = 0  # weights folded in so far (host-side: no read back)
        self._padding = align.padded_axes(model)
        self._fold = get_swa_multi_avg_fn() if mode == "uniform" else get_ema_multi_avg_fn(decay)

    @classmethod
    def of(cls, model: nn.Module, optim: Any) -> WeightAverage | None:
        """The average ``optim`` (an ``OptimConfig``) asks for; None for ``average: none``."""
        if optim.average == "none":
            return None
        return cls(model, optim.average, optim.average_start, optim.average_decay)

    @property
    def active(self) -> bool:
        """Whether any weights have been folded in (before ``start``: not yet)."""
        return self.count > 0

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights that optimizer step ``step`` (1-based) left, from ``start`` on."""
        if step < self.start:
            return
        current = [p.detach() for p in self.params]
        if self.count == 0:
            torch._foreach_copy_(self.averaged, current)
        else:
            self._fold(self.averaged, current, self.count)
        self.count += 1

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The averaged weights in the model inside the block, its own back after it, bit for
        bit (copied in place: DDP and a compiled forward keep the same tensors). Before the
        first update the model keeps its own."""
        if not self.active:
            yield
            return
        with torch.no_grad():
            own = [p.detach().clone() for p in self.params]
            torch._foreach_copy_([p.detach() for p in self.params], self.averaged)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.detach() for p in self.params], own)

    def state_dict(self) -> dict[str, Tensor]:
        """``count`` and, once active, ``averaged.NAME`` per parameter in its real shape."""
        state = {"count": torch.tensor(self.count, dtype=torch.int64)}
        if not self.active:
            return state
        for name, t in zip(self.names, self.averaged, strict=True):
            if name in self._padding:
                t = align.strip(t, *self._padding[name])
            state[f"averaged.{name}"] = t.detach().cpu().contiguous()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        count = int(state["count"])
        if count == 0:
            self.count = 0
            return
        names = {k.removeprefix("averaged.") for k in state if k.startswith("averaged.")}
        if names != set(self.names):
            missing, extra = sorted(set(self.names) - names), sorted(names - set(self.names))
            raise ValueError(f"the average does not fit the model (missing {missing[:3]}, "
                             f"unexpected {extra[:3]})")  # fmt: skip
        for name, t in zip(self.names, self.averaged, strict=True):
            value = state[f"averaged.{name}"]
            if name in self._padding:
                value = align.pad(value, *self._padding[name])
            if value.shape != t.shape:
                raise ValueError(f"averaged.{name} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(t.shape)}")  # fmt: skip
            t.copy_(value)
        self.count = count


@contextlib.contextmanager
def averaged(average: WeightAverage | None) -> Iterator[None]:
    """``average.swapped()``, or nothing for a run without averaging."""
    if average is None:
        yield
        return
    with average.swapped():
        yield
