"""``run.deterministic`` and ``run.threads``: deterministic kernels and the intra-op thread
count for as long as the run is working, then the process's own settings again.

torch's switches are process-wide; a ``Trainer`` built inside someone else's process (a test,
a notebook, the ablation) must not leave every later computation there in deterministic mode
or on another number of threads. The trainer enters these blocks around each step and around
``fit``; nesting is harmless.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """Inside the block: ``torch.use_deterministic_algorithms(True)`` and no cuDNN autotuning
    (it picks kernels by timing). Off: the block changes nothing."""
    if not enabled:
        yield
        return
    # cuBLAS reads this once, when it creates its handle (the first GPU matmul), so it is
    # set for the process, and only when the user has not set it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.backends.cudnn.benchmark = was[2]


@contextlib.contextmanager
def threads(count: int | None) -> Iterator[None]:
    """Inside the block: ``torch.set_num_threads(count)``; None: the block changes nothing."""
    if count is None:
        yield
        return
    was = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(was)
