"""Which positions of a training segment the loss counts (``optim.loss``).

Legend: b rows, L segment length.

The trainer's loss is the mean NLL over the labelled positions of the global batch; an
objective chooses those positions by setting the others' labels to -100 (ignored). It acts on
the labels only, before the step counts its tokens, so the normalisation, DDP and gradient
accumulation stay exact for every objective.

- ``full``: every position (the paper's training).
- ``half``: only the last L/2 positions of each segment, the "half loss" of the paper's
  Table 6 ablation: every counted prediction has at least L/2 tokens of in-segment context,
  which isolates what the memory adds from what a longer segment would.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

IGNORE = -100

Objective = Callable[[Tensor], Tensor]  # labels [b, L] -> labels [b, L]


def full_loss(labels: Tensor) -> Tensor:
    return labels


def half_loss(labels: Tensor) -> Tensor:
    labels = labels.clone()
    labels[:, : labels.size(1) // 2] = IGNORE
    return labels


OBJECTIVES: dict[str, Objective] = {"full": full_loss, "half": half_loss}
