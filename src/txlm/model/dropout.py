"""Dropout with a cheaper random mask on the CPU.

On the CPU, ``F.dropout`` fills a float tensor with ``bernoulli_``: one call of the serial
Mersenne-Twister generator per element, converted to float and compared. In a training step of
the benchmark's small config that was ~15% of the time (benchmarks/profile_step.py), more than
any matmul but the largest. Here each 64-bit draw of the same generator gives three independent
21-bit uniforms (bits 0-20, 21-41, 42-62 of a value uniform on [0, 2**63)), so a mask of N
elements costs N/3 draws and a few vectorised integer passes.

The drop probability is rounded to a multiple of 2**-21 (at most 2.4e-7 away from the one
asked for) and the kept values are scaled by the exact inverse of the rounded keep
probability, so every output's expectation equals its input, as with ``F.dropout`` (in
half precision up to the rounding of that scale, as there too).

The mask comes from torch's global CPU generator, so ``torch.manual_seed`` and saved RNG states
(exact resume) govern it as they govern ``F.dropout``. On other devices ``F.dropout`` already
runs one fused kernel and is used as it is; so it is under torch.compile.

Variational (locked) dropout (Gal & Ghahramani 2016; AWD-LSTM, Merity et al. 2017, whose
recipe the paper's Penn Treebank model follows, Sec. 4.1): ``dropout(x, p, True,
locked=True)`` on hidden states [B, L, F] draws one mask [B, 1, F], per row and feature, and
shares it across the L positions of the segment, so a feature dropped for a sequence is
dropped at every time step of it instead of at a random subset. The mask is the element-wise
dropout of a tensor of ones of that shape (the same generator, the same scaling), drawn anew
for every forward, i.e. every segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_BITS = 21
_FIELD = (1 << _BITS) - 1  # one 21-bit uniform
_LEVELS = 1 << _BITS


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device) -> Tensor:
    """Bool mask of ``shape``: each element True (kept) with probability 1 - round(p, 2**-21)."""
    n = 1
    for size in shape:
        n *= size
    draws = torch.empty((n + 2) // 3, 1, dtype=torch.int64, device=device).random_()
    shifts = torch.tensor([0, _BITS, 2 * _BITS], device=device)
    fields = (draws >> shifts) & _FIELD  # [N/3, 3]: element 3t + f is field f of draw t
    return (fields >= round(p * _LEVELS)).view(-1)[:n].view(shape)


def dropout(x: Tensor, p: float, training: bool, locked: bool = False) -> Tensor:
    """``F.dropout(x, p, training)`` with the mask of ``keep_mask`` on the CPU.

    ``locked``: ``x`` is [B, L, F] and one mask [B, 1, F] is shared across its L positions
    (variational dropout, see the module docstring)."""
    if not training or p == 0.0:
        return x
    if locked:
        if x.dim() != 3:
            raise ValueError(f"locked dropout takes [B, L, F], got shape {tuple(x.shape)}")
        return x * dropout(x.new_ones(x.size(0), 1, x.size(2)), p, True)
    # Elsewhere F.dropout is one fused kernel already: on GPUs, and under torch.compile, whose
    # generated code draws its own random numbers (there ``random_`` would break the graph).
    if x.device.type != "cpu" or torch.compiler.is_compiling() or not 0.0 < p < 1.0:
        return F.dropout(x, p, training)
    threshold = round(p * _LEVELS)
    if threshold == 0:
        return x
    scale = _LEVELS / (_LEVELS - threshold) if threshold < _LEVELS else 0.0
    # One float mask, scaled: autograd keeps it for the backward (one multiply), the same
    # memory F.dropout's CPU path keeps. The bool -> float product is float32; cast it for
    # bf16 activations under autocast.
    mask = keep_mask(x.shape, p, x.device) * scale
    return x * mask.to(x.dtype)


class Dropout(nn.Module):
    """``nn.Dropout`` with the CPU mask of ``keep_mask``; no parameters, no state."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
