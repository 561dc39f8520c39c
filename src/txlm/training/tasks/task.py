"""What a kind of training gives the trainer: the ``Task`` protocol.

Legend: b rows (documents) of this rank, c = b / A rows of one gradient-accumulation chunk,
M memory length, D model dim.

The trainer (``txlm.training.loop``) owns everything a step shares whatever it learns: the
optimizer and its schedule, the accumulation loop over the chunks with DDP's ``no_sync``,
the loss scaling and backward, clipping and Adam (``txlm.training.step``), the components a
``last`` checkpoint saves, validation's timing, the logs, the stop signals. A task gives it
the rest, and the trainer never asks which task it runs:

- the model (``build_model``; ``body``: its Transformer-XL, which a run started from a
  checkpoint fills and whose width the memory has);
- the batches (``batches``: an iterable of batches with ``state_dict`` / ``load_state_dict``,
  saved as the ``data`` component) and each batch's labels (``labels``: what the step counts,
  its N of the global batch being the labels other than -100);
- the loss of one chunk (``loss``): the summed loss of rows ``rows`` and the memory that
  chunk carries to the next step (None when it carries none);
- the evaluation of a split (``evaluate_split``: ``loss`` and ``tokens``, the task's
  ``metric``, and the names in ``reported``), the final evaluation (``final_evaluation``)
  and what the run's checkpoints record of the task and its data (``run_info``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from txlm.config import ModelConfig
from txlm.data.vocab import Vocab
from txlm.model import TransformerXL
from txlm.model.align import Stored
from txlm.training import distributed as dist
from txlm.training.state import Carry, MemoryChunk


class Task(Protocol):
    metric: str  # the training rows' metric (bpc, ppl, bits, ...)
    level: str  # what one symbol of the data is, for the run's first line
    unit: str  # what a step counts, for its progress ("tok", "doc")
    counted: str  # what an evaluation counts: its result's key ("tokens", "documents")
    vocab: Vocab
    unknown: dict[str, float] | None  # each split's share of unknown symbols, when measured
    compiles: bool  # whether ``run.compile=auto`` may compile the forward
    reported: tuple[str, ...]  # validation's numbers logged and printed besides the metric

    def build_model(self, model_config: ModelConfig, stored: Stored | None) -> nn.Module: ...

    def body(self, model: nn.Module) -> TransformerXL: ...

    def batches(
        self, model_config: ModelConfig, dist_info: dist.DistInfo, device: torch.device
    ) -> Iterable[Any]: ...

    def start(self, model: nn.Module, device: torch.device, *, compiled: bool) -> None: ...

    def labels(self, batch: Any) -> Tensor: ...

    def loss(
        self,
        model: Any,
        batch: Any,
        labels: Tensor,
        rows: slice,
        memory: MemoryChunk,
    ) -> tuple[Tensor, Carry | None]: ...

    def metric_value(self, loss: float) -> float: ...

    def evaluate_split(
        self, model: nn.Module, split: str, *, full: bool, desc: str | None = None
    ) -> dict[str, Any]: ...

    def final_evaluation(
        self, model: nn.Module, out: Path, device: torch.device, *, echo: bool
    ) -> dict[str, Any]: ...

    def run_info(self, model: nn.Module) -> dict[str, Any]: ...
