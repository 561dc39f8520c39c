"""A module in eval mode for the length of a block, back in its own mode after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[nn.Module]:
    """``module.eval()`` inside the block (dropout off), and the module's mode as it was
    after it, also when the block raises: a caller that hands a training model to an
    analysis or an evaluation gets it back training."""
    if not module.training:  # nothing to switch (a decoder's step is called per token)
        yield module
        return
    module.eval()
    try:
        yield module
    finally:
        module.train()
