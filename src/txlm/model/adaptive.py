"""Adaptive input embeddings (Baevski & Auli 2019) and projected adaptive log-softmax
(Grave et al. 2017), as Transformer-XL uses them for large vocabularies.

Legend: N tokens (flattened B*L), V vocabulary, P projection dim (= d_model),
E embedding dim of the head cluster (= d_embed); cluster i has E // div_val**i.

The vocabulary is split by ``cutoffs`` into a frequent head (the shortlist) and tail
clusters. With ``div_val > 1`` rarer clusters get narrower embeddings, each projected to P.
With no cutoffs both classes reduce to a plain embedding and a full softmax.

Layout note: the head softmax scores the shortlist tokens followed by one logit per tail
cluster, and cluster i (1-based) owns head column shortlist + i - 1 (row i - 1 of
cluster_weight), as the original code's training loss does. Published checkpoints were
trained that way, so converted weights need no reshuffling. (HF's ``log_prob`` helper reads
column -i instead, which disagrees with its own forward when there are 2+ tail clusters.)
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _upcast(x: Tensor) -> Tensor:
    """Half-precision logits are normalised in float32; float32/float64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _cluster_bounds(vocab_size: int, cutoffs: list[int]) -> list[tuple[int, int]]:
    ends = [0, *cutoffs, vocab_size]
    return list(itertools.pairwise(ends))


class AdaptiveEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int
    ) -> None:
        super().__init__()
        self.vocab_size, self.d_proj, self.div_val = vocab_size, d_proj, div_val
        self.bounds = _cluster_bounds(vocab_size, cutoffs)
        self.scale = d_proj**0.5  # embeddings are scaled by sqrt(d_model), as in Vaswani et al.
        self.layers = nn.ModuleList()
        self.projs = nn.ParameterList()
        if div_val == 1:
            self.layers.append(nn.Embedding(vocab_size, d_embed))
            if d_proj != d_embed:
                self.projs.append(nn.Parameter(torch.zeros(d_proj, d_embed)))
        else:
            for i, (lo, hi) in enumerate(self.bounds):
                d_i = d_embed // div_val**i
                self.layers.append(nn.Embedding(hi - lo, d_i))
                self.projs.append(nn.Parameter(torch.zeros(d_proj, d_i)))

    def forward(self, ids: Tensor) -> Tensor:
        """ids [B, L] -> [B, L, P]."""
        if self.div_val == 1:
            emb = self.layers[0](ids)
            if len(self.projs):
                emb = F.linear(emb, self.projs[0])
            return emb * self.scale
        # Every cluster embeds every token (ids clamped into its range) and each token keeps
        # its own cluster's row: static shapes and no data-dependent indexing, so no host
        # sync (a CUDA graph can capture a decoding step) at the cost of the narrow tail
        # clusters' small products on all tokens. Every parameter gets a gradient (zero
        # where unused) every step, which DDP requires.
        dtype = self.projs[0].dtype
        out = None
        for (lo, hi), layer, proj in zip(self.bounds, self.layers, self.projs, strict=True):
            emb = F.linear(layer((ids - lo).clamp(0, hi - lo - 1)), proj).to(dtype)
            out = (
                emb if out is None else torch.where(((ids >= lo) & (ids < hi))[..., None], emb, out)
            )
        return out * self.scale


class AdaptiveLogSoftmax(nn.Module):
    """log p(token | hidden) over the whole vocabulary, or per-token NLL in input order."""

    def __init__(
        self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int
    ) -> None:
        super().__init__()
        self.vocab_size, self.div_val = vocab_size, div_val
        self.bounds = _cluster_bounds(vocab_size, cutoffs)
        self.cutoffs = list(cutoffs)
        self.n_clusters = len(cutoffs)
        self.shortlist = self.bounds[0][1]
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        self.layers = nn.ModuleList()
        self.projs = nn.ParameterList()
        if div_val == 1:
            self.layers.append(nn.Linear(d_embed, vocab_size))
            if d_proj != d_embed:
                for _ in self.bounds:
                    self.projs.append(nn.Parameter(torch.zeros(d_proj, d_embed)))
        else:
            for i, (lo, hi) in enumerate(self.bounds):
                d_i = d_embed // div_val**i
                self.layers.append(nn.Linear(d_i, hi - lo))
                self.projs.append(nn.Parameter(torch.zeros(d_proj, d_i)))

    # -- per-cluster logits -------------------------------------------------------------
    def _weights(self, i: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Weight, bias and projection of cluster i (0 = the head's shortlist part)."""
        proj = self.projs[i] if len(self.projs) else None
        if self.div_val == 1:
            lo, hi = self.bounds[i]
            layer = self.layers[0]
            return layer.weight[lo:hi], layer.bias[lo:hi], proj
        layer = self.layers[i]
        return layer.weight, layer.bias, proj

    @staticmethod
    def _logits(hidden: Tensor, weight: Tensor, bias: Tensor, proj: Tensor | None) -> Tensor:
        if proj is not None:
            hidden = hidden @ proj  # [N, P] @ [P, E_i] -> [N, E_i]
        return F.linear(hidden, weight, bias)

    def _head_log_probs(self, hidden: Tensor) -> Tensor:
        weight, bias, proj = self._weights(0)
        if not self.n_clusters:
            logits = self._logits(hidden, weight, bias, proj)
        elif hidden.size(0) >= weight.size(0):  # many rows: join the weights (the smaller copy)
            weight = torch.cat([weight, self.cluster_weight], dim=0)
            bias = torch.cat([bias, self.cluster_bias], dim=0)
            logits = self._logits(hidden, weight, bias, proj)
        else:  # few rows (decoding): join the logits instead of copying the head's weights
            h = hidden if proj is None else hidden @ proj
            logits = torch.cat(
                [F.linear(h, weight, bias), F.linear(h, self.cluster_weight, self.cluster_bias)],
                dim=-1,
            )
        return F.log_softmax(_upcast(logits), dim=-1)

    # -- public -------------------------------------------------------------------------
    def log_prob(self, hidden: Tensor) -> Tensor:
        """hidden [N, P] -> log-probabilities [N, V] (float32 at least)."""
        head = self._head_log_probs(hidden)
        if not self.n_clusters:
            return head
        out = hidden.new_empty(hidden.size(0), self.vocab_size, dtype=head.dtype)
        out[:, : self.shortlist] = head[:, : self.shortlist]
        for i in range(1, self.n_clusters + 1):
            lo, hi = self.bounds[i]
            tail = F.log_softmax(_upcast(self._logits(hidden, *self._weights(i))), dim=-1)
            out[:, lo:hi] = head[:, self.shortlist + i - 1, None] + tail
        return out

    def nll(self, hidden: Tensor, target: Tensor, ignore_index: int = -100) -> Tensor:
        """Negative log-likelihood [N] in input order; 0 where target == ignore_index."""
        ignore = target == ignore_index
        target = target.masked_fill(ignore, 0)
        head = self._head_log_probs(hidden)
        if not self.n_clusters:
            nll = -head.gather(1, target[:, None]).squeeze(1)
            return nll.masked_fill(ignore, 0.0)

        cluster = torch.bucketize(
            target, torch.tensor(self.cutoffs, device=target.device), right=True
        )  # 0: shortlist, i: tail cluster i
        head_col = torch.where(cluster == 0, target, self.shortlist + cluster - 1)
        nll = -head.gather(1, head_col[:, None]).squeeze(1)
        for i in range(1, self.n_clusters + 1):
            lo, _ = self.bounds[i]
            # Runs on empty selections too, so every parameter is used each step (DDP).
            idx = ((cluster == i) & ~ignore).nonzero().squeeze(1)
            logits = self._logits(hidden.index_select(0, idx), *self._weights(i))
            tail = F.log_softmax(_upcast(logits), dim=-1)
            picked = tail.gather(1, (target.index_select(0, idx) - lo)[:, None]).squeeze(1)
            nll = nll.index_add(0, idx, -picked)
        return nll.masked_fill(ignore, 0.0)
