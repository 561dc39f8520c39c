"""A checkpoint directory's files, and writing one (atomically: ``txlm.atomic.directory``).

    config.json          the ModelConfig (plus "format": "txlm", a version, and extras)
    model.safetensors    weights (tied tensors stored once)
    vocab.json           the vocabulary, when there is one
    tokenizer.json       a bpe vocabulary's tokenizer (the model's ids mean nothing without it)

Reading one is ``txlm.checkpoints.checkpoint.Checkpoint``; a conversion (``convert``) writes
its result through ``save`` here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model

from txlm import atomic
from txlm.config import ModelConfig
from txlm.errors import CheckpointError

FORMAT = "txlm"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
VOCAB_FILE = "vocab.json"
TOKENIZER_FILE = "tokenizer.json"


def estimate_checkpoint_bytes(model: torch.nn.Module, *, optimizer_moments: int = 2) -> int:
    """Bytes a `last` checkpoint of ``model`` takes: weights plus Adam's two moments."""
    params = {id(p): p for p in model.parameters()}.values()  # tied tensors once
    return sum(p.numel() * p.element_size() for p in params) * (1 + optimizer_moments)


def ensure_writable(directory: str | Path, need_bytes: int = 0) -> Path:
    """Fail early, in one clear line, when checkpoints cannot be written to ``directory``.

    Creates the directory, writes and fsyncs a probe file (a read-only file system, missing
    permissions, a file in the way), and checks that ``need_bytes`` are free. An atomic save
    holds the old and the new checkpoint at once, so pass twice a checkpoint's size. On
    failure a directory this call created is removed again: nothing on disk changes.
    """
    directory = Path(directory)
    created = [p for p in [directory, *directory.parents] if not p.exists()]
    try:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=directory, prefix=".txlm-write-probe.")
            try:
                os.write(fd, b"probe")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            raise CheckpointError(
                f"cannot write checkpoints to {directory}: {exc.strerror or exc}"
            ) from None
        free = shutil.disk_usage(directory).free
        if free < need_bytes:
            raise CheckpointError(
                f"{directory} has {free / 2**20:.1f} MiB free; checkpoints need about "
                f"{need_bytes / 2**20:.1f} MiB (the old one is kept until the new is whole)"
            )
    except CheckpointError:
        for p in created:  # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    return directory


def save(
    model: torch.nn.Module,
    directory: str | Path,
    *,
    vocab_json: str | None = None,
    extra_config: dict[str, Any] | None = None,
    extra_files: Callable[[Path], None] | None = None,
    vocab: Any = None,
) -> Path:
    """Write ``model`` (and optionally its vocabulary and more files) atomically.

    ``vocab`` (a ``txlm.data.Vocab``) writes every file the vocabulary needs, a bpe
    tokenizer.json included; ``vocab_json`` is the bare vocab.json text of a symbol-table
    vocabulary (char, word, byte), e.g. one converted from another format.
    """
    if vocab is not None and vocab_json is not None:
        raise ValueError("pass vocab or vocab_json, not both")
    if vocab_json is not None and json.loads(vocab_json).get("level") == "bpe":
        raise ValueError("a bpe vocabulary has a tokenizer.json too: pass vocab=, not vocab_json=")

    directory = Path(directory)
    with atomic.directory(directory) as tmp:
        config = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": model.config.to_dict(),
            **(extra_config or {}),
        }
        atomic.write_json(tmp / CONFIG_FILE, config)
        save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        if vocab_json is not None:
            (tmp / VOCAB_FILE).write_text(vocab_json)
        if vocab is not None:
            vocab.save(tmp / VOCAB_FILE)
        if extra_files is not None:
            extra_files(tmp)
    return directory


BUILD_DIRECTLY_BELOW = 20_000_000  # parameters; larger models are built on the meta device


def rough_parameter_count(c: ModelConfig) -> int:
    """An upper-end estimate from the config alone (attention, feed-forward, embeddings)."""
    assert c.d_embed is not None
    per_layer = 4 * c.d_model * c.n_head * c.d_head + 2 * c.d_model * c.d_inner
    return c.n_layer * per_layer + 2 * c.vocab_size * max(c.d_embed, c.d_model)
