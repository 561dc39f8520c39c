"""The compiled decoding step: how inductor compiles it, the batch sizes it is made for, when
``compile="auto"`` compiles, and where its compiled code is kept.

Dimension legend
    B  real rows     K  the bucket's rows (K >= B)

``StepCompile`` says how a ``Decoder`` step is compiled: a dynamo backend and, for inductor,
its C++ wrapper (the whole step one C++ function, no Python between its kernels) and
freezing (the weights folded in as constants). ``compile=True`` is ``CPU_DEFAULT`` on a CPU.

Buckets. A compiled step is made for a batch of K rows, K one of ``BUCKETS``: a batch of B
rows runs the smallest bucket that holds it, its cache carrying K - B padding rows
(``KVCache.pad_rows``: copies of row 0) and its ids and random numbers padded alike, the
padding rows' outputs dropped. Rows never mix in a step, so padding changes no real row's
result, and rows that join or leave a batch within its bucket change no shape: nothing
compiles again.

On disk. Inductor keeps what it compiles in its own caches (the FX graph cache and
AOTAutograd's, on by default), keyed by everything the compiled code depends on; a later
process that traces the same step loads it from there instead of compiling (``artifacts_in``
puts them under txlm's folder). What that process still pays is importing the compiler and
dynamo's trace of the step, which no cache of torch 2.13's keeps.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

BUCKETS = (1, 2, 4, 8, 16, 32)


def bucket(rows: int) -> int:
    """The batch a compiled step over ``rows`` rows runs: the smallest bucket that holds
    them; past the largest, the next multiple of it."""
    for k in BUCKETS:
        if rows <= k:
            return k
    top = BUCKETS[-1]
    return -(-rows // top) * top


@dataclass(frozen=True)
class StepCompile:
    """How a decoding step is compiled (``Decoder(compile=...)``). ``backend``: dynamo's
    (inductor, or e.g. "aot_eager" for tests of the graph alone); ``cpp_wrapper`` and
    ``freezing``: inductor's options of those names."""

    backend: str | Callable = "inductor"
    cpp_wrapper: bool = False
    freezing: bool = False

    def __call__(self, fn: Callable) -> Callable:
        kw = {}
        if self.cpp_wrapper or self.freezing:  # (inductor's options; its defaults else)
            kw["options"] = {"cpp_wrapper": self.cpp_wrapper, "freezing": self.freezing}
        return torch.compile(fn, fullgraph=True, dynamic=False, backend=self.backend, **kw)


# ``compile="package"``: the step exported and compiled ahead of time by AOTInductor, its
# package kept on disk and opened by torch's C++ loader (txlm.inference.packaged), not
# torch.compile.
PACKAGE = StepCompile(backend="package")

# What ``compile=True`` runs on a CPU: the whole step one C++ function. Freezing measured no
# faster here (docs/performance-cpu.md), and without it the weights stay the step's inputs.
# On CUDA inductor's defaults (then captured in a CUDA graph by the decoder).
CPU_DEFAULT = StepCompile(cpp_wrapper=True)


def step_compile(
    compile: bool | str | Callable | StepCompile | None, device: torch.device
) -> StepCompile | None:
    """``Decoder(compile=...)`` as a ``StepCompile``: True is inductor as it measured best
    on ``device``'s kind, a string or a callable names a backend, False or None compiles
    nothing."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return CPU_DEFAULT if device.type == "cpu" else StepCompile()
    if isinstance(compile, StepCompile):
        return compile
    return StepCompile(backend=compile)


def pad(x: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``x`` [B, ...] as [batch, ...], the rows past B copies of row 0 (what a padding row of
    the cache is, ``KVCache.pad_rows``)."""
    if x is None or x.size(0) == batch:
        return x
    return torch.cat([x, x[:1].expand(batch - x.size(0), *x.shape[1:])])


@contextlib.contextmanager
def artifacts_in(folder: Path) -> Iterator[None]:
    """Inside, inductor's on-disk caches (the FX graph cache, AOTAutograd's, the compiled C++
    modules) are under ``folder``, unless TORCHINDUCTOR_CACHE_DIR names a place; the
    variable as it was afterwards. For a command's run (the CLI's generate). The caches are
    keyed by what a compiled step depends on (the traced graph, its inputs' shapes and
    dtypes: the bucket, inductor's options, torch's version, the C++ compiler and the CPU's
    vector ISA); the weights are the step's inputs, not part of it, so one entry serves
    every checkpoint of a shape."""
    name = "TORCHINDUCTOR_CACHE_DIR"
    if name in os.environ:
        yield
        return
    os.environ[name] = str(folder)
    try:
        yield
    finally:
        os.environ.pop(name, None)
