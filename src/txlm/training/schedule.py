"""The learning-rate schedule: linear warm-up, then cosine, inverse square root or constant.

A pure function of the (possibly fractional) step, so a resumed run needs nothing but the
step to be back on its curve.
"""

from __future__ import annotations

import math

from txlm.training.config import OptimConfig


def learning_rate(step: float, optim: OptimConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    ``step`` may be fractional: with a time budget the schedule runs on the step that the
    elapsed fraction of the budget corresponds to (``Trainer.schedule_step``).
    """
    o = optim
    if o.warmup_steps > 0 and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "inv_sqrt":
        # Continuous with the warm-up: lr at the last warm-up step, then ~ 1/sqrt(step).
        return o.lr * math.sqrt(max(o.warmup_steps, 1) / (step + 1))
    span = max(o.max_steps - o.warmup_steps, 1)
    progress = min(max(step - o.warmup_steps, 0) / span, 1.0)
    return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
