"""Memory checks before allocation: refuse, in one line, a size that cannot fit.

Legend: B rows (batch), L segment length, M memory length, D model dim, Di feed-forward dim,
H heads, Dh head dim, V vocabulary, N layers, P parameters.

Every figure here is a LOWER bound on what the run will allocate, computed from the
configuration alone (nothing is built): the parameters of the attention and feed-forward
matrices and the input embedding (biases, norms and an untied output layer left out), Adam's
two moments and the gradients, the activations that one step must keep for its backward
pass, the memory or KV cache at the full length asked for (a memory is a capacity: a text
shorter than it does not fill it, but the KV cache is allocated whole, and a length the
device cannot hold is a mistake to name, not an hour of quadratic attention to start). The
commands check after loading a checkpoint, whose weights the loader sizes from their file
and checks against config.json before allocating. A run is refused only when this lower bound
already exceeds the memory the device can still give, so nothing that fits is refused; a
run that passes may still run out later, and the CLI turns that into one line too
(``cli.main``).

The refusal names the size, what takes most of it and the option that lowers it.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from txlm.config import ModelConfig
from txlm.errors import TxlmError


class ResourceError(TxlmError):
    """A size that cannot fit in the device's memory."""


@dataclass(frozen=True)
class Need:
    """One thing a run must hold at once: ``nbytes`` (a lower bound), and the option(s)
    that make it smaller."""

    what: str
    nbytes: int
    lower: str


def human(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: '1.5 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- what the device can give ----------------------------------------------------------------


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where there is none)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_room() -> int | None:
    """What a cgroup v2 memory limit still allows this process group (None: no limit)."""
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((base / "memory.current").read_text().strip()), 0)
    except (OSError, ValueError):
        return None


def available_bytes(device: torch.device) -> int:
    """Memory the device can still give: free plus reclaimable on a GPU (what the caching
    allocator holds unused included); on the CPU the kernel's MemAvailable plus free swap,
    within the container's cgroup v2 limit if one is set. An address-space limit (ulimit -v)
    is not counted: it bounds mappings, not memory, and a failure there still ends as one
    line (``out_of_memory_message``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + held)
    info = _meminfo()
    if "MemAvailable" in info:
        room = info["MemAvailable"] + info.get("SwapFree", 0)
    else:  # no /proc: the free physical pages
        room = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = _cgroup_room()
    return room if cgroup is None else min(room, cgroup)


def check(needs: list[Need], device: torch.device, *, doing: str) -> None:
    """Raise ``ResourceError`` when the needs together exceed what ``device`` can give."""
    total = sum(n.nbytes for n in needs)
    if total == 0:
        return
    room = available_bytes(device)
    if total <= room:
        return
    top = max(needs, key=lambda n: n.nbytes)
    raise ResourceError(
        f"{doing} needs at least {human(total)} of memory ({top.what}: {human(top.nbytes)}) "
        f"but {human(room)} is available on {device}: lower {top.lower}"
    )


_ALLOCATION = re.compile(r"(?:you tried to allocate|Tried to allocate) ([0-9.]+) ?([A-Za-z]*)")
_UNITS = {"": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def out_of_memory_message(exc: BaseException) -> str | None:
    """One line for an allocation that failed (``MemoryError``, ``torch.OutOfMemoryError``,
    the CPU allocator's ``RuntimeError``), or None when ``exc`` is something else."""
    text = str(exc)
    is_oom = (
        isinstance(exc, MemoryError | torch.OutOfMemoryError)
        or "DefaultCPUAllocator: can't allocate" in text
        or "CUDA out of memory" in text
    )
    if not is_oom:
        return None
    size = ""
    match = _ALLOCATION.search(text)
    if match:
        value, unit = float(match.group(1)), match.group(2)
        size = f" allocating {human(value * _UNITS.get(unit, 1))}"
    return (
        f"out of memory{size}: lower the batch size, the lengths (--mem-len, --tgt-len), "
        "the number of samples or the model size (files written before are intact)"
    )


STDIN = "-"  # the file name that means standard input (classify, --prompt-file, eval --file)


def read_bounded(path: str | Path, limit: int) -> bytes:
    """A file's bytes, at most ``limit`` of them: ``ResourceError`` past that, so a source
    that never ends (a device, a pipe) is refused after ``limit`` bytes, not read forever.
    ``-`` is standard input."""
    if str(path) == STDIN:
        data = sys.stdin.buffer.read(limit + 1)
    else:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    if len(data) > limit:
        raise ResourceError(f"{path} is longer than {human(limit)}: not read")
    return data


# -- sizes from a configuration ----------------------------------------------------------------


def element_bytes(precision: str) -> int:
    """Bytes per activation element: 2 under bf16/fp16 autocast (a lower bound: some stay
    float32), else 4 (int8 quantises weights only)."""
    return 4 if precision in ("fp32", "int8") else 2


def parameter_count(c: ModelConfig) -> int:
    """A lower bound on P: per layer the q/k/v/output projections (4 D H Dh) and the two
    feed-forward matrices (2 D Di); the input embedding (each cluster at its width)."""
    assert c.d_embed is not None
    per_layer = 4 * c.d_model * c.n_head * c.d_head + 2 * c.d_model * c.d_inner
    ends = [0, *c.cutoffs, c.vocab_size]
    if c.div_val == 1:
        embedding = c.vocab_size * c.d_embed
    else:
        embedding = sum(
            (hi - lo) * max(c.d_embed // c.div_val**i, 1)
            for i, (lo, hi) in enumerate(itertools.pairwise(ends))
        )
    return c.n_layer * per_layer + embedding


def _head_size(c: ModelConfig) -> int:
    """Logits per position of the head softmax: the shortlist plus one per tail cluster."""
    return c.cutoffs[0] + len(c.cutoffs) if c.cutoffs else c.vocab_size


def activation_bytes(c: ModelConfig, rows: int, seg: int, precision: str, *, train: bool) -> int:
    """One forward over [rows, seg]: training keeps each layer's input [B, L, D] and
    feed-forward hidden [B, L, Di] for backward, plus the head's logits [B, L, V_head]
    (float32); inference holds one layer's at a time."""
    e = element_bytes(precision)
    layers = c.n_layer if train else 1
    return rows * seg * (layers * (c.d_model + c.d_inner) * e + _head_size(c) * 4)


def memory_bytes(c: ModelConfig, rows: int, mem_len: int, precision: str) -> int:
    """The hidden-state memory: N tensors [B, M, D]."""
    return c.n_layer * rows * mem_len * c.d_model * element_bytes(precision)


def kv_cache_bytes(c: ModelConfig, rows: int, slots: int, precision: str) -> int:
    """A KV cache (txlm.model.cache): keys and values [N, 2, B, H, S, Dh]."""
    return c.n_layer * 2 * rows * c.n_head * slots * c.d_head * element_bytes(precision)


def _options(*pairs: tuple[str, int]) -> str:
    """The options behind a size, the largest value first: '--mem-len (100000) or
    --batch-size (4)' (an option at 1 cannot go lower and is left out)."""
    named = sorted((p for p in pairs if p[1] > 1), key=lambda p: -p[1]) or list(pairs[:1])
    return " or ".join(f"{name} ({value})" for name, value in named)


# -- the three commands ------------------------------------------------------------------------


def training_needs(
    c: ModelConfig,
    *,
    rows: int,
    chunks: int,
    precision: str,
    optimizer_moments: int = 2,
    frozen: int = 0,
) -> list[Need]:
    """One rank's training step: ``rows`` its rows per step (b), ``chunks`` the gradient
    accumulation chunks they are split into; ``frozen`` parameters (``optim.freeze``) have
    neither gradients nor Adam's moments."""
    p = parameter_count(c)
    trained = max(p - frozen, 0)
    chunk = max(rows // max(chunks, 1), 1)
    return [
        Need("the model's weights", 4 * p, "model.d_model, model.n_layer or model.d_inner"),
        Need(
            "gradients and Adam's moments",
            4 * trained * (1 + optimizer_moments),
            "model.d_model, model.n_layer or model.d_inner (or optim.freeze)",
        ),
        Need(
            "the activations of one step",
            activation_bytes(c, chunk, c.tgt_len, precision, train=True),
            "data.batch_size or data.tgt_len (or raise optim.grad_accum)",
        ),
        Need(
            "the memory",
            memory_bytes(c, rows, c.mem_len, precision),
            "model.mem_len or data.batch_size",
        ),
    ]


def check_training(
    c: ModelConfig, device: torch.device, train: Any, world_size: int, *, frozen: int = 0
) -> None:
    """Refuse a training configuration (``TrainConfig`` ``train``, model ``c``) whose step
    cannot fit on ``device``, each of ``world_size`` ranks holding its share of the rows;
    ``frozen``: how many of the parameters ``optim.freeze`` keeps (no gradients or moments).
    A run started from a checkpoint (``train.init``) holds its weights a second time while
    they are copied in, and cannot shrink the model: its weights fix the sizes."""
    needs = training_needs(
        c,
        rows=max(train.data.batch_size // world_size, 1),
        chunks=train.optim.grad_accum,
        precision=train.run.precision,
        frozen=frozen,
    )
    if getattr(train, "init", None) is not None:
        fixed = (
            "the model's size (the --init checkpoint's weights fix it: start from a smaller one)"
        )
        needs = [
            replace(
                n,
                lower=fixed
                + (", or freeze parts of it (optim.freeze)" if "optim.freeze" in n.lower else ""),
            )
            if n.lower.startswith("model.d_model")
            else n
            for n in needs
        ]
        needs.append(
            Need("the --init checkpoint's weights, copied in", 4 * parameter_count(c), fixed)
        )
    check(needs, device, doing="training")


def check_evaluation(
    c: ModelConfig,
    device: torch.device,
    *,
    weights: int,
    rows: int,
    tgt_len: int,
    mem_len: int,
    precision: str,
    kv_cache: bool,
    text_bytes: int = 0,
) -> None:
    """Refuse an evaluation (``txlm eval``, ``txlm eval --file``) whose memory or cache
    cannot fit: rows x mem_len states per layer, or with the KV cache mem_len + tgt_len
    slots of keys and values. ``text_bytes``: a text file read whole (``--file``)."""
    lower = _options(("--mem-len", mem_len), ("--batch-size", rows))
    if kv_cache:
        held = Need("the KV cache", kv_cache_bytes(c, rows, mem_len + tgt_len, precision), lower)
    else:
        held = Need("the memory", memory_bytes(c, rows, mem_len, precision), lower)
    needs = [
        Need("the model's weights", weights, "the model size"),
        held,
        Need(
            "one segment's activations",
            activation_bytes(c, rows, tgt_len, precision, train=False),
            _options(("--tgt-len", tgt_len), ("--batch-size", rows)),
        ),
        Need("the text", text_bytes, "the size of the text file (score it in parts)"),
    ]
    check(needs, device, doing="evaluation")


def check_generation(
    c: ModelConfig,
    device: torch.device,
    *,
    weights: int,
    rows: int,
    samples: int,
    mem_len: int,
    precision: str,
    cache: bool,
) -> None:
    """Refuse a generation whose cache cannot fit: ``rows`` = prompts x samples, each with
    mem_len + 1 slots of keys and values per layer for the one-token steps (the memory of
    hidden states without the cache)."""
    lower = _options(("--mem-len", mem_len), ("--num-samples", samples))
    if cache:
        held = Need("the KV cache", kv_cache_bytes(c, rows, mem_len + 1, precision), lower)
    else:
        held = Need("the memory", memory_bytes(c, rows, mem_len, precision), lower)
    needs = [
        Need("the model's weights", weights, "the model size"),
        held,
        Need("the next-token scores", rows * c.vocab_size * 4, lower),
    ]
    check(needs, device, doing="generation")
