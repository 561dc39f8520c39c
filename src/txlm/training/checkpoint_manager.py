"""The run's checkpoints: ``out/last`` (everything to resume exactly) and ``out/best``.

The trainer hands its components to a ``CheckpointManager`` once; the manager knows nothing
of the trainer. ``last`` holds the weights (``txlm.checkpoints.checkpoint``) plus three resume-only
files:

    optimizer.safetensors   Adam's moments (real shapes where heads are padded)
    memory.safetensors      every rank's rows of the ``Memory`` component, in rank order
    trainer_state.json      the ``Counters`` at the top level, then one entry per component:
                            shared ones (the data position, the grad scaler) as rank 0 has
                            them, per-rank ones (the RNG) as a list in rank order

and one ``NAME.safetensors`` per tensor component (``average.safetensors``: the weight
average, ``txlm.training.averaging``), as rank 0 has it.

Saving is collective: every rank calls it, rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from txlm import atomic
from txlm.checkpoints import checkpoint
from txlm.config import ModelConfig
from txlm.errors import CheckpointError, TrainingError, TxlmError
from txlm.training import distributed as dist
from txlm.training.state import Counters, Memory, Stateful, load_optimizer, save_optimizer

OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
MEMORY_FILE = "memory.safetensors"
RESUME_FILES = (STATE_FILE, OPTIMIZER_FILE, MEMORY_FILE, checkpoint.WEIGHTS_FILE)


class CheckpointManager:
    """Writes and reads ``out/last`` and ``out/best`` for the components it is given.

    ``model_config``: the configuration the model was built with (a resume must match it).
    ``run_info``: what every checkpoint's config.json records about the run besides the
    model (the training configuration, the vocabulary's fingerprint, the dataset).
    ``shared``: components equal on every rank, saved from rank 0; ``per_rank``: components
    that differ by rank (the RNG of each rank's dropout), each rank saves and reads its own.
    ``tensors``: components equal on every rank whose state is tensors (the weight average),
    each saved from rank 0 to its own safetensors file in ``last``.
    """

    def __init__(
        self,
        out: Path,
        *,
        model: nn.Module,
        model_config: ModelConfig,
        optimizer: torch.optim.Optimizer,
        counters: Counters,
        memory: Memory,
        shared: Mapping[str, Stateful],
        per_rank: Mapping[str, Stateful],
        tensors: Mapping[str, Stateful] | None = None,
        vocab: Any,
        run_info: dict[str, Any],
        dist_info: dist.DistInfo,
        device: torch.device,
    ) -> None:
        self.out = out
        self.model, self.model_config, self.optimizer = model, model_config, optimizer
        self.counters, self.memory = counters, memory
        self.shared, self.per_rank = dict(shared), dict(per_rank)
        self.tensors = dict(tensors or {})
        self.vocab, self.run_info = vocab, run_info
        self.dist, self.device = dist_info, device

    # -- saving -----------------------------------------------------------------------------
    def save(self, kind: str) -> None:
        """Write ``out/last`` (resumable) or ``out/best`` (the model). Collective."""
        resume = self._gather() if kind == "last" else None
        if not self.dist.is_main:
            return

        def fill(tmp: Path) -> None:
            if resume is None:
                return
            state, memory = resume
            save_optimizer(self.optimizer, tmp / OPTIMIZER_FILE, self.model)
            save_file(memory, str(tmp / MEMORY_FILE))
            for name, component in self.tensors.items():
                save_file(component.state_dict(), str(tmp / f"{name}.safetensors"))
            atomic.write_json(tmp / STATE_FILE, state)

        c = self.counters
        checkpoint.save(
            self.model,  # type: ignore[arg-type]
            self.out / kind,
            vocab=self.vocab,  # every file the vocabulary needs (a bpe tokenizer.json too)
            extra_config={
                **self.run_info,
                "checkpoint": {"kind": kind, "step": c.step, "best_valid_loss": c.best_valid},
            },
            extra_files=fill,
        )

    def _gather(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The resume state of every rank: JSON on rank 0, the memory rows gathered."""
        local = self.memory.state_dict()
        mem_keys = sorted(k for k in local if k.startswith("mems."))
        if dist.all_gather_object(mem_keys) != [mem_keys] * self.dist.world_size:
            raise TrainingError("ranks disagree on whether memory exists (a bug)")
        if local and any(dist.all_gather_object("mem_mask" in local)) and "mem_mask" not in local:
            # some rank carries a mask: the rows of the others are all valid
            local["mem_mask"] = torch.ones(
                local["mems.0"].shape[:2], dtype=torch.bool, device=local["mems.0"].device
            )
        memory = {k: dist.all_gather_rows(v).cpu().contiguous() for k, v in local.items()}
        state: dict[str, Any] = {
            **self.counters.state_dict(),
            **{name: c.state_dict() for name, c in self.shared.items()},
            **{name: dist.all_gather_object(c.state_dict()) for name, c in self.per_rank.items()},
            "world_size": self.dist.world_size,
            "has_memory": bool(local),
        }
        return state, memory

    # -- resuming ---------------------------------------------------------------------------
    def load(self, directory: Path) -> None:
        """Put every component exactly where ``directory`` (a ``last`` checkpoint) left it."""
        directory = checkpoint.resolve(directory)
        for name in RESUME_FILES:
            if not (directory / name).is_file():
                raise CheckpointError(
                    f"{directory} has no {name}: only a `last` checkpoint can be resumed"
                )
        opened = checkpoint.Checkpoint.open(directory)
        saved = opened.data
        fingerprint = self.run_info.get("vocab_fingerprint")
        if saved.get("vocab_fingerprint") != fingerprint:
            raise CheckpointError(
                f"{directory} was trained on another vocabulary (fingerprint "
                f"{saved.get('vocab_fingerprint')}, the data has {fingerprint})"
            )
        if ModelConfig.from_dict(saved["model"]) != self.model_config:
            raise CheckpointError(f"{directory}: model.* settings differ from the checkpoint's")
        # a language model, or a classifier (body.* and head.*): the checkpoint's own kind
        loaded = opened.load_model(
            self.device, align_heads=False, task=self.run_info.get("task", "lm")
        )
        self.model.load_state_dict(loaded.state_dict())
        self.model.train()
        # Each of the three resume-only files may be damaged or foreign (truncated, zero
        # bytes, a pickle under the name): whatever reading it raises becomes one
        # CheckpointError that names the file, never a traceback.
        with _reading(directory / OPTIMIZER_FILE):
            load_optimizer(self.optimizer, directory / OPTIMIZER_FILE, self.model)
        with _reading(directory / STATE_FILE):
            state = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
            if not isinstance(state, dict):
                raise ValueError("not a JSON object")
            world_size = state["world_size"]
        if world_size != self.dist.world_size:
            raise CheckpointError(
                f"{directory} was written by {world_size} processes; resume it with "
                f"the same number (now {self.dist.world_size}) to keep each row's memory"
            )
        with _reading(directory / STATE_FILE):
            self.counters.load_state_dict(state)
            for name, component in self.shared.items():
                component.load_state_dict(state[name])
            for name, component in self.per_rank.items():
                component.load_state_dict(state[name][self.dist.rank])
        for name, component in self.tensors.items():
            path = directory / f"{name}.safetensors"
            if path.is_file():  # absent: the run had none yet (a setting turned on to resume)
                with _reading(path):
                    component.load_state_dict(load_file(str(path), device=str(self.device)))
        self.memory.clear()
        if state.get("has_memory"):
            with _reading(directory / MEMORY_FILE):
                tensors = load_file(str(directory / MEMORY_FILE), device=str(self.device))
                rows = slice(
                    self.dist.rank * self.memory.rows, (self.dist.rank + 1) * self.memory.rows
                )
                self.memory.load_state_dict({k: v[rows] for k, v in tensors.items()})


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
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
