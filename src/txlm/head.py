"""The output layer for decoding: next-token distributions of one row per sequence.

Dimension legend
    B  rows     D  model dim (P, the projection's)     E_i  cluster i's embedding dim
    V  vocabulary     n_i  cluster i's tokens     C  tail clusters

The model's (adaptive) softmax, ``AdaptiveLogSoftmax``, by the same formula: the head
log-softmax over the shortlist and one logit per tail cluster, plus each tail cluster's own
log-softmax. Laid out for one-row products (txlm.model.layout: W^T [in, out], contiguous on a
CPU) in the decoder's dtype, with the head's shortlist and cluster rows joined into one
product. ``scores`` are what sampling needs: raw logits for a full softmax (its log-softmax
only shifts each row, and a draw renormalises), log-probabilities with clusters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from txlm.model.adaptive import AdaptiveLogSoftmax
from txlm.model.layout import one_row_layout
from txlm.sampling import upcast


class DecodingHead:
    def __init__(self, softmax: AdaptiveLogSoftmax, dtype: torch.dtype) -> None:
        self.n_clusters, self.shortlist = softmax.n_clusters, softmax.shortlist
        self.bounds = softmax.bounds
        self.vocab_size = softmax.vocab_size
        self.dtype = dtype
        # per cluster (projection [P, E_i] or None, W^T [E_i, n_i], bias [n_i]); the head's
        # also scores the tail clusters (C more columns)
        self.clusters: list[tuple[Tensor | None, Tensor, Tensor]] = []
        for i in range(len(self.bounds)):
            weight, bias, proj = softmax._weights(i)
            if i == 0 and self.n_clusters:
                weight = torch.cat([weight, softmax.cluster_weight], dim=0)
                bias = torch.cat([bias, softmax.cluster_bias], dim=0)
            proj = None if proj is None else proj.detach().to(dtype)
            self.clusters.append((proj, one_row_layout(weight, dtype), bias.detach().to(dtype)))

    def logits(self, i: int, hidden: Tensor) -> Tensor:
        """Cluster i's logits [B, n_i] (the head's: [B, shortlist + C])."""
        proj, weight_t, bias = self.clusters[i]
        hidden = hidden if hidden.dtype == self.dtype else hidden.to(self.dtype)
        if proj is not None:
            hidden = hidden @ proj  # [B, P] @ [P, E_i]
        return torch.addmm(bias, hidden, weight_t)

    def head_log_probs(self, hidden: Tensor) -> Tensor:
        """[B, shortlist + C]: the shortlist tokens', then each tail cluster's."""
        return F.log_softmax(upcast(self.logits(0, hidden)), dim=-1)

    def tail_log_probs(self, i: int, hidden: Tensor, head: Tensor) -> Tensor:
        """[B, n_i]: log-probabilities of cluster i's tokens (i >= 1), given the head's."""
        tail = F.log_softmax(upcast(self.logits(i, hidden)), dim=-1)
        return head[:, self.shortlist + i - 1, None] + tail

    def log_probs(self, hidden: Tensor) -> Tensor:
        """hidden [B, D] -> log-probabilities [B, V] (float32 at least)."""
        if not self.n_clusters:
            return F.log_softmax(upcast(self.logits(0, hidden)), dim=-1)
        return self.scores(hidden)

    def scores(self, hidden: Tensor) -> Tensor:
        """hidden [B, D] -> sampling scores [B, V]: log-probabilities up to a constant per
        row (float32 at least)."""
        if not self.n_clusters:
            return upcast(self.logits(0, hidden))
        head = self.head_log_probs(hidden)
        out = head.new_empty(hidden.size(0), self.vocab_size)
        out[:, : self.shortlist] = head[:, : self.shortlist]
        for i in range(1, self.n_clusters + 1):
            lo, hi = self.bounds[i]
            out[:, lo:hi] = self.tail_log_probs(i, hidden, head)
        return out

    def normalise(self, scores: Tensor) -> Tensor:
        """Sampling scores -> log-probabilities (they are already, with clusters)."""
        return scores if self.n_clusters else F.log_softmax(scores, dim=-1)
