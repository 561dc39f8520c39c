"""Device names as users give them: ``auto`` (CUDA when present), ``cpu``, ``cuda[:N]``.

One resolver for every command and the trainer, so ``--device`` means the same everywhere
and a request for a GPU that is not there fails the same way (one line, exit 2).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from txlm.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEVICE_HELP = "auto (default: CUDA when present, else CPU) | cpu | cuda[:N]"


def resolve_device(name: str, *, local_rank: int = 0) -> torch.device:
    """``name`` as a ``torch.device``; a bare ``cuda`` (or ``auto`` on a GPU machine) picks
    the process's own GPU, ``cuda:<local_rank>``, as torchrun's ranks need."""
    import torch  # here: the CLI's parsers import this module, and --help needs no torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"bad device {name!r} ({DEVICE_HELP}): {exc}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"bad device {name!r}: expected {DEVICE_HELP}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r}: no GPU is available")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def wanted(setting: bool | str, device: torch.device | str) -> bool:
    """A feature's true / false / "auto" setting resolved for ``device``: "auto" turns it on
    for CUDA only (compiling the training step, padding the stored widths: both pay there
    and cost on a CPU)."""
    if setting == "auto":
        import torch

        return torch.device(device).type == "cuda"
    return bool(setting)


def check_precision(precision: str, device: torch.device) -> None:
    """fp16 autocast exists for GPUs only; bf16 runs on both."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("precision fp16 needs a GPU; use bf16 on CPU")


def precision_note(precision: str, device: torch.device) -> str | None:
    """A line for the user where ``precision`` runs slower than fp32 on ``device``: bf16 on
    an x86 CPU without AVX512-BF16, whose bf16 products torch emulates (on such a CPU the
    decoding step measured 2.2x slower than fp32 at batch 1, docs/performance-cpu.md)."""
    import platform

    import torch

    if precision != "bf16" or device.type != "cpu":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if torch.cpu._is_avx512_bf16_supported():
        return None
    return ("note: this CPU has no AVX512-BF16 instructions, so bf16 products are emulated "
            "and run slower than fp32 here")  # fmt: skip


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision: bf16 autocast on CPU and GPU, fp16 on GPU; fp32 runs plain, and so
    does int8 (weight-only int8 layers: txlm.inference.precision)."""
    import torch

    if precision in ("fp32", "int8"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
