"""A document classifier: the Transformer-XL body reads a document segment by segment with
its memory; a head pools the final-layer states and a linear layer gives the labels'
log-probabilities.

Legend: b rows (documents), T = S * L a row's padded length, S segments of length L,
M memory length, D model dim, C labels.

    clf = Classifier(body, ClassifierConfig(labels=["comedy", "tragedy"]))
    out = clf(input_ids [b, T], start [b], labels=None)   # txlm.classify.documents' layout
    out.log_probs [b, C]; out.losses [b] (labels given): each document's cross-entropy

Reading. Rows are right-aligned documents (``start[i]``: the first real token, flagged as a
document start so nothing real attends to the padding before it). The body runs on one
segment at a time, carrying its memory (``model.transform``), so a document of any length
costs the activations of one segment over M + L keys: constant memory. The memory is
detached (the paper's stop-gradient); only the last ``grad_segments`` segments keep their
graph for the backward (0: every segment), the earlier ones run without autograd. Leading
segments that are padding in every row are skipped.

Pooling (``pooling``):

- ``mean``: the mean of the final-layer states over every real position of the document,
  summed segment by segment into one [b, D] accumulator (constant memory). Every part of
  the document speaks directly, and the memory enriches each state with what came before.
  The states of segments read without autograd enter as constants.
- ``last``: the final-layer state at the document's last token. It sees the last segment
  directly and everything earlier only through the memory (and, layer upon layer, up to
  about n_layer x M tokens back): the pooling that depends on the memory, the Transformer-XL
  analogue of a recurrent classifier's final state.

The body stays a whole ``TransformerXL`` (its output layer too, unused here): its weights
load from, and save as, a language-model checkpoint's, and ``head.*`` is what is added.
The output layer's own tensors get no gradient; they are frozen so that DDP, which expects a
gradient for every trainable parameter, and Adam leave them alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from txlm.config import ModelConfig
from txlm.errors import ConfigError
from txlm.model import TransformerXL
from txlm.model.lengths import Lengths

POOLINGS = ("mean", "last")


@dataclass(frozen=True)
class ClassifierConfig:
    labels: tuple[str, ...]
    pooling: Literal["mean", "last"] = "mean"
    grad_segments: int = 1  # the last k segments keep their graph (0: all)

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(self.labels))
        if len(self.labels) < 2 or len(set(self.labels)) != len(self.labels):
            raise ConfigError(f"a classifier needs two or more distinct labels, got {self.labels}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.grad_segments < 0:
            raise ConfigError(f"grad_segments must be >= 0, got {self.grad_segments}")

    def to_dict(self) -> dict[str, Any]:
        return {"labels": list(self.labels), "pooling": self.pooling,
                "grad_segments": self.grad_segments}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClassifierConfig:
        known = {"labels", "pooling", "grad_segments"}
        if not isinstance(data, dict) or "labels" not in data or set(data) - known:
            raise ConfigError(f"not a classifier configuration: {data!r}")
        return cls(**{**data, "labels": tuple(data["labels"])})


@dataclass
class ClassifierOutput:
    log_probs: Tensor  # [b, C]
    losses: Tensor | None = None  # [b] cross-entropy of each document (labels given)
    pooled: Tensor | None = field(default=None, repr=False)  # [b, D]


class Classifier(nn.Module):
    vocab: Any = None  # the checkpoint's vocabulary, set by txlm.load_classifier

    def __init__(self, body: TransformerXL, config: ClassifierConfig) -> None:
        super().__init__()
        self.body = body
        self.classifier_config = config
        self.head = nn.Linear(body.config.d_model, len(config.labels))
        nn.init.normal_(self.head.weight, 0.0, body.config.init_std)
        nn.init.zeros_(self.head.bias)
        shared = {id(p) for p in body.embed.parameters()}
        for p in body.softmax.parameters():
            if id(p) not in shared:
                p.requires_grad_(False)

    @property
    def config(self) -> ModelConfig:
        """The body's configuration (what a checkpoint's ``model`` section holds)."""
        return self.body.config

    @property
    def lengths(self) -> Lengths:
        """The body's lengths: segment ``tgt_len``, memory ``mem_len``."""
        return self.body.lengths

    @property
    def layers(self) -> nn.ModuleList:
        """The body's decoder layers (what bf16 compute copies, ``txlm.training.precision``,
        keep in low precision)."""
        return self.body.layers

    @property
    def labels(self) -> tuple[str, ...]:
        return self.classifier_config.labels

    def num_parameters(self) -> int:
        return self.body.num_parameters() + sum(p.numel() for p in self.head.parameters())

    def forward(
        self, input_ids: Tensor, start: Tensor, labels: Tensor | None = None
    ) -> ClassifierOutput:
        """``input_ids`` [b, T] right-aligned rows, T a multiple of the segment length;
        ``start`` [b] on the host: each row's first real position; ``labels`` [b]."""
        L = self.lengths.tgt_len
        b, T = input_ids.shape
        if T % L:
            raise ValueError(f"rows of {T} tokens are not whole segments of {L}")
        start = start.cpu()
        device = input_ids.device
        first = int(start.min()) // L
        n = T // L
        k = self.classifier_config.grad_segments
        grad_from = first if k == 0 else max(first, n - k)
        starts_in = set((start // L).tolist())  # segments where some row's document starts
        positions = torch.arange(T, device=device)
        begin = start.to(device)[:, None]
        mean = self.classifier_config.pooling == "mean"
        total = torch.zeros(b, self.body.config.d_model, device=device)
        mems: list[Tensor] | None = None
        mem_mask: Tensor | None = None
        grad = torch.is_grad_enabled()
        h = total  # the loop's last segment replaces it (there is always one)
        for s in range(first, n):
            seg = slice(s * L, (s + 1) * L)
            reset = (positions[seg] == begin) if s in starts_in else None
            with torch.set_grad_enabled(grad and s >= grad_from):
                h, mems, mem_mask = self.body.transform(input_ids[:, seg], mems, reset, mem_mask)
                h = h[..., : total.size(-1)]  # the real D (a body stored wider: zeros past it)
                if mean:
                    real = (positions[seg] >= begin).unsqueeze(-1)  # [b, L, 1]
                    total = total + (h.float() * real).sum(1)
        # mean: over the real positions; last: the state at the document's last token
        pooled = total / (T - start).to(device, total.dtype)[:, None] if mean else h[:, -1].float()
        log_probs = torch.log_softmax(self.head(pooled.to(self.head.weight.dtype)).float(), -1)
        out = ClassifierOutput(log_probs, pooled=pooled)
        if labels is not None:
            out.losses = -log_probs.gather(1, labels[:, None]).squeeze(1)
        return out
