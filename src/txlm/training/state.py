"""The run's state besides the weights, one component per kind, and how each is written
without pickle.

Legend: b rows of this rank, M memory length, D model dim.

Everything a step depends on: the counters, Adam's moments, every RNG, the memory of the
training rows and the data position (the stream iterator) and the fp16 grad scaler. Each
component has ``state_dict()`` / ``load_state_dict()``; ``txlm.training.checkpoint_manager``
is handed the components and writes them next to the weights in ``last``. Reading them back
makes a resumed run take exactly the steps it would have taken.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from txlm.errors import CheckpointError
from txlm.model import align


class Stateful(Protocol):
    """What the checkpoint manager asks of a component (torch's convention)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Counters:
    """The counters of a run (saved in trainer_state.json)."""

    step: int = 0  # optimizer steps taken (the schedule is a pure function of it)
    best_valid: float | None = None  # best validation loss so far
    bad_steps: int = 0  # consecutive non-finite steps
    train_seconds: float = 0.0  # time in training steps (validation and compiling excluded)
    tokens_seen: int = 0  # labelled tokens of the global batches so far
    # Where the schedule was at the last step: the step, or further on under a time budget.
    schedule_step: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "best_valid_loss": self.best_valid,
            "bad_steps": self.bad_steps,
            "train_seconds": self.train_seconds,
            "tokens_seen": self.tokens_seen,
            "schedule_step": self.schedule_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.best_valid = state.get("best_valid_loss")
        self.bad_steps = int(state.get("bad_steps", 0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.schedule_step = float(state.get("schedule_step", self.step))


# -- memory of the training rows -----------------------------------------------------------
# Legend: c rows of a chunk, M memory length, D model dim.
# What a chunk's forward carries to the next step: each layer's states [c, M, D] and which
# positions are valid ([c, M] bool, None: all)
Carry = tuple[list[Tensor], Tensor | None]
# The memory a chunk's forward is given: as a Carry, or (None, None) before the first step
MemoryChunk = tuple[list[Tensor] | None, Tensor | None]


class Memory:
    """The per-row memory of this rank's ``rows`` training rows; empty (``mems`` None) until
    the first step and after an epoch starts. ``width``: D as the model stores it (a model
    with padded widths, ``txlm.model.align``, carries zeros past ``d_model``); the state
    holds the real ``d_model``, as checkpoints hold the real shapes of weights and Adam."""

    def __init__(self, rows: int, n_layer: int, d_model: int, width: int | None = None) -> None:
        self.rows, self.n_layer, self.d_model = rows, n_layer, d_model
        self.width = d_model if width is None else width
        self.mems: list[Tensor] | None = None  # n_layer x [b, M, D]
        self.mask: Tensor | None = None  # [b, M] bool or None (all valid)

    def clear(self) -> None:
        self.mems, self.mask = None, None

    def chunk(self, rows: slice) -> MemoryChunk:
        if self.mems is None:
            return None, None
        mask = None if self.mask is None else self.mask[rows]
        return [m[rows] for m in self.mems], mask

    def update(self, parts: list[Carry | None], keep: Tensor | None = None) -> None:
        """The memory of the step's gradient-accumulation chunks (mems, mask), concatenated
        into rows; chunks that carry none (None: a classifier's, each batch holding whole
        documents) leave it empty. ``keep``: a 0-d bool on the device, false when the step was
        not finite; its states are then replaced by zeros (and masked where a mask is
        carried), so that no NaN feeds the next segment, without the host having to look. In
        place: the step's backward is done, nothing else reads these tensors, and a copy
        would move the whole memory once more every step."""
        if any(part is None for part in parts):
            return
        carried = cast(list[Carry], parts)
        if len(carried) == 1:
            mems, mask = carried[0]
        else:
            mems = [torch.cat(layer, dim=0) for layer in zip(*[m for m, _ in carried], strict=True)]
            mask = None
            if any(part_mask is not None for _, part_mask in carried):
                mask = torch.cat(  # a chunk without a mask has all positions valid
                    [
                        torch.ones(m[0].shape[:2], dtype=torch.bool, device=m[0].device)
                        if part_mask is None
                        else part_mask
                        for m, part_mask in carried
                    ],
                    dim=0,
                )
        if keep is not None:
            drop = ~keep
            for m in mems:
                m.masked_fill_(drop, 0.0)
            mask = None if mask is None else mask & keep
        self.mems, self.mask = list(mems), mask

    def state_dict(self) -> dict[str, Tensor]:
        """This rank's rows: ``mems.N`` [b, M, D] per layer and ``mem_mask`` [b, M] when
        carried; empty when there is no memory."""
        if self.mems is None:
            return {}
        state = {f"mems.{n}": m[..., : self.d_model] for n, m in enumerate(self.mems)}
        if self.mask is not None:
            state["mem_mask"] = self.mask
        return state

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if not state:
            self.clear()
            return
        mems = [state[f"mems.{n}"] for n in range(self.n_layer)]
        want = (self.rows, "M", self.d_model)
        for n, m in enumerate(mems):
            if m.dim() != 3 or m.size(0) != self.rows or m.size(2) != self.d_model:
                raise ValueError(f"mems.{n} has shape {tuple(m.shape)}, expected {want}")
        mask = state.get("mem_mask")
        if mask is not None and tuple(mask.shape) != tuple(mems[0].shape[:2]):
            raise ValueError(f"mem_mask has shape {tuple(mask.shape)}, expected [b, M]")
        if self.width != self.d_model:
            mems = [torch.nn.functional.pad(m, (0, self.width - self.d_model)) for m in mems]
        self.mems, self.mask = mems, mask


# -- RNG ------------------------------------------------------------------------------------
def _b64(t: Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


class RNG:
    """Every RNG a step may draw from (torch CPU and CUDA, numpy, Python), as JSON. The
    generators are the process's own: this component only reads and sets them."""

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state()
        py_state = random.getstate()
        state: dict[str, Any] = {
            "torch": _b64(torch.get_rng_state()),
            "numpy": [np_state[0], np_state[1].tolist(), *[float(x) for x in np_state[2:]]],
            "python": [py_state[0], list(py_state[1]), py_state[2]],
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(_unb64(state["torch"]))
        n = state["numpy"]
        np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), int(n[2]), int(n[3]), n[4]))
        p = state["python"]
        random.setstate((p[0], tuple(p[1]), p[2]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


# -- optimizer ------------------------------------------------------------------------------
def _padding(model: nn.Module | None) -> dict[int, tuple[int, int, int]]:
    """Optimizer state index -> padding of that parameter (``txlm.model.align``): the
    optimizer holds ``list(model.parameters())``, the order of ``named_parameters``."""
    if model is None:
        return {}
    axes = align.padded_axes(model)
    return {i: axes[n] for i, (n, _) in enumerate(model.named_parameters()) if n in axes}


def save_optimizer(
    optimizer: torch.optim.Optimizer, path: Path, model: nn.Module | None = None
) -> None:
    """Adam's per-parameter tensors in safetensors, its hyper-parameters as JSON metadata.
    Moments of padded heads are saved in the real shapes, as the model's weights are."""
    sd = optimizer.state_dict()
    padding = _padding(model)
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, pstate in sd["state"].items():
        for key, value in pstate.items():
            if isinstance(value, Tensor):
                if idx in padding and value.dim() > 0:
                    value = align.strip(value, *padding[idx])
                tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    # a hyper-parameter held as a 0-d tensor (the trainer's learning rate) saved as its value
    groups = [
        {k: v.item() if isinstance(v, Tensor) else v for k, v in group.items()}
        for group in sd["param_groups"]
    ]
    meta = {"param_groups": json.dumps(groups), "scalars": json.dumps(scalars)}
    save_file(tensors, str(path), metadata=meta)


def load_optimizer(
    optimizer: torch.optim.Optimizer, path: Path, model: nn.Module | None = None
) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if "param_groups" not in meta:
        raise CheckpointError(f"{path} lacks the optimizer's param_groups metadata")
    padding = _padding(model)
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        idx, key = name.split(".", 1)
        index = int(idx)
        if index in padding and value.dim() > 0:
            value = align.pad(value, *padding[index])
        state.setdefault(index, {})[key] = value
    for idx, extra in json.loads(meta.get("scalars", "{}")).items():
        state.setdefault(int(idx), {}).update(extra)
    try:
        optimizer.load_state_dict(
            {"state": state, "param_groups": json.loads(meta["param_groups"])}
        )
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{path} does not fit this model's optimizer: {exc}") from None
