"""The run's checkpoints: ``out/last`` (everything to resume exactly) and ``out/best``.

``last`` holds the weights (``txlm.checkpoint``) plus three resume-only files:
``optimizer.safetensors`` (Adam's moments), ``memory.safetensors`` (every rank's rows'
memory, gathered in rank order) and ``trainer_state.json`` (counters, data position, every
rank's RNG states, the grad scaler). Saving is collective: every rank calls it, rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from txlm import checkpoint
from txlm import distributed as dist
from txlm.config import ModelConfig
from txlm.errors import CheckpointError, TxlmError
from txlm.training.state import (
    Counters,
    Memory,
    load_optimizer,
    rng_state,
    save_optimizer,
    set_rng_state,
)

if TYPE_CHECKING:
    from txlm.training.loop import Trainer

OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
MEMORY_FILE = "memory.safetensors"


class TrainingError(TxlmError):
    """The run cannot go on (diverged, or a resume that does not fit)."""


def extra_config(t: Trainer, kind: str) -> dict[str, Any]:
    """What a checkpoint's config.json records about the run besides the model."""
    return {
        "train": t.config.to_dict(),
        "vocab_fingerprint": t.vocab.fingerprint,
        "dataset": {
            "name": t.config.data.dataset,
            "prepared": t.corpus.meta.get("name"),
            "level": t.corpus.level,
            "metric": t.metric,
        },
        "checkpoint": {"kind": kind, "step": t.counters.step, "best_valid_loss": t.best_valid},
    }


def save_run(t: Trainer, kind: str) -> None:
    """Write ``out/last`` (resumable) or ``out/best`` (the model). Collective."""
    resume_state = _gather_resume_state(t) if kind == "last" else None
    if not t.dist.is_main:
        return

    def fill(tmp: Path) -> None:
        if resume_state is None:
            return
        state, memory = resume_state
        save_optimizer(t.optimizer, tmp / OPTIMIZER_FILE, t.model)
        save_file(memory, str(tmp / MEMORY_FILE))
        checkpoint.write_json(tmp / STATE_FILE, state)

    checkpoint.save(
        t.model,
        t.out / kind,
        vocab=t.vocab,  # every file the vocabulary needs (a bpe tokenizer.json too)
        extra_config=extra_config(t, kind),
        extra_files=fill,
    )


def _gather_resume_state(t: Trainer) -> tuple[dict[str, Any], dict[str, Tensor]]:
    rngs = dist.all_gather_object(rng_state())
    memory: dict[str, Tensor] = {}
    has_memory = t.memory.mems is not None
    if dist.all_gather_object(has_memory) != [has_memory] * t.dist.world_size:
        raise TrainingError("ranks disagree on whether memory exists (a bug)")
    any_mask = any(dist.all_gather_object(t.memory.mask is not None))
    if t.memory.mems is not None:
        for n, m in enumerate(t.memory.mems):
            memory[f"mems.{n}"] = dist.all_gather_rows(m).cpu().contiguous()
        if any_mask:
            mask = t.memory.mask
            if mask is None:
                mask = torch.ones(t.memory.mems[0].shape[:2], dtype=torch.bool, device=t.device)
            memory["mem_mask"] = dist.all_gather_rows(mask).cpu().contiguous()
    state = {
        **t.counters.to_dict(),
        "scheduler": {"schedule": t.config.optim.schedule, "step": t.counters.step},
        "data": t.stream.state_dict(),
        "rng": rngs,
        "world_size": t.dist.world_size,
        "grad_scaler": t.scaler.state_dict(),
        "has_memory": has_memory,
    }
    return state, memory


@contextlib.contextmanager
def _reading(path: Path) -> Any:
    """Turn any failure to read or apply ``path`` into one CheckpointError naming it."""
    try:
        yield
    except TxlmError:
        raise
    except Exception as exc:  # SafetensorError, JSONDecodeError, UnicodeDecodeError, KeyError...
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"cannot resume from {path}: damaged or not a txlm file ({detail})"
        ) from None


def load_run(t: Trainer, directory: Path) -> None:
    """Put the trainer exactly where ``directory`` (a ``last`` checkpoint) left the run."""
    directory = checkpoint.resolve(directory)
    for name in (STATE_FILE, OPTIMIZER_FILE, MEMORY_FILE, checkpoint.WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise CheckpointError(
                f"{directory} has no {name}: only a `last` checkpoint can be resumed"
            )
    saved = checkpoint.read_config(directory)
    if saved.get("vocab_fingerprint") != t.vocab.fingerprint:
        raise CheckpointError(
            f"{directory} was trained on another vocabulary (fingerprint "
            f"{saved.get('vocab_fingerprint')}, the data has {t.vocab.fingerprint})"
        )
    if ModelConfig.from_dict(saved["model"]) != t.model_config:
        raise CheckpointError(f"{directory}: model.* settings differ from the checkpoint's")
    loaded = checkpoint.load(directory, device=t.device)
    t.model.load_state_dict(loaded.state_dict())
    t.model.train()
    # Each of the three resume-only files may be damaged or foreign (truncated, zero bytes,
    # a pickle under the name): whatever reading it raises becomes one CheckpointError that
    # names the file, never a traceback.
    with _reading(directory / OPTIMIZER_FILE):
        load_optimizer(t.optimizer, directory / OPTIMIZER_FILE, t.model)
    with _reading(directory / STATE_FILE):
        state = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        world_size = state["world_size"]
    if world_size != t.dist.world_size:
        raise CheckpointError(
            f"{directory} was written by {world_size} processes; resume it with "
            f"the same number (now {t.dist.world_size}) to keep each row's memory"
        )
    with _reading(directory / STATE_FILE):
        t.counters = Counters.from_dict(state)
        t.stream.load_state_dict(state["data"])
        t.scaler.load_state_dict(state["grad_scaler"])
        set_rng_state(state["rng"][t.dist.rank])
    if state.get("has_memory"):
        with _reading(directory / MEMORY_FILE):
            t.memory = _read_memory(t, directory / MEMORY_FILE)


def _read_memory(t: Trainer, path: Path) -> Memory:
    tensors = load_file(str(path), device=str(t.device))
    per = t.config.data.batch_size // t.dist.world_size
    rows = slice(t.dist.rank * per, (t.dist.rank + 1) * per)
    mems = [tensors[f"mems.{n}"][rows] for n in range(t.model_config.n_layer)]
    mask = tensors["mem_mask"][rows] if "mem_mask" in tensors else None
    want = (per, t.model_config.mem_len, t.model_config.d_model)
    for n, m in enumerate(mems):
        if m.dim() != 3 or m.size(0) != per or m.size(2) != want[2]:
            raise ValueError(f"mems.{n} has shape {tuple(m.shape)}, expected {want}")
    return Memory(mems, mask)
