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

Pruned draws (``select``). With clusters most of the output layer's bytes are the tail
clusters', and most draws need none of them. A token of tail cluster c has log-probability
head_c + log p(token | c) <= head_c, so:
- greedy, top-k (and top-p inside the top k): a cluster whose head_c is below the k-th best
  shortlist log-probability holds no candidate; the k best of the shortlist and the clusters
  that may hold one are the k best of the vocabulary, the same values, so the same draw;
- plain sampling (temperature 1): the inverse CDF over the vocabulary, laid out shortlist
  then cluster by cluster as the head is, is the head's inverse CDF at the same uniform,
  then, inside the cluster drawn, the cluster's at the uniform rescaled to it: two stages,
  the tail product of the one cluster drawn only.
Which clusters a batch needs is a device tensor. ``host_branch=True`` (eager, where reading
it is free: a CPU) skips the others with a Python branch. Otherwise nothing reads it on the
host: every cluster is computed and its result or the skipped value chosen by
``torch.where`` on the flag, and for one row a cluster no row needs has each of its outputs
read the weight's first column (``logits(needed=)``), so that it costs a column's bytes
rather than the weight's. (A ``torch.cond`` would read its predicate on the host in the
compiled code, which a CUDA graph cannot capture.) With the draw's random numbers given
(``noise``, txlm.sampling.draw_noise) the selection is a pure function of the hidden state
and the noise: one graph, capturable. Other settings (top-p alone, a temperature without
top-k) draw from the full distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from txlm.model.adaptive import AdaptiveLogSoftmax, upcast
from txlm.model.attention import matmul
from txlm.model.layout import one_row_layout
from txlm.sampling import (
    SamplingConfig,
    candidate_probs,
    cdf_index,
    draw_noise,
    race,
    sample,
)


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

    def logits(self, i: int, hidden: Tensor, needed: Tensor | None = None) -> Tensor:
        """Cluster i's logits [B, n_i] (the head's: [B, shortlist + C]). ``needed``: a 0-d
        bool device flag; where it is False the values are discarded by the caller, and one
        row's product then reads the weight's first column for every output (a reduction
        with an indexed load, fused by the compiler: the bytes of a column, not of the
        weight). Several rows take the library product (each weight is reused across rows,
        and some row usually needs each cluster)."""
        proj, weight_t, bias = self.clusters[i]
        hidden = hidden if hidden.dtype == self.dtype else hidden.to(self.dtype)
        if proj is not None:
            hidden = hidden @ proj  # [B, P] @ [P, E_i]
        if needed is None or hidden.size(0) != 1:
            return torch.addmm(bias, hidden, weight_t)
        cols = torch.where(needed, torch.arange(weight_t.size(1), device=weight_t.device), 0)
        return matmul(hidden, weight_t[:, cols], True) + bias[cols]

    def head_log_probs(self, hidden: Tensor) -> Tensor:
        """[B, shortlist + C]: the shortlist tokens', then each tail cluster's."""
        return F.log_softmax(upcast(self.logits(0, hidden)), dim=-1)

    def tail_log_probs(
        self, i: int, hidden: Tensor, head: Tensor, needed: Tensor | None = None
    ) -> Tensor:
        """[B, n_i]: log-probabilities of cluster i's tokens (i >= 1), given the head's."""
        tail = F.log_softmax(upcast(self.logits(i, hidden, needed)), dim=-1)
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

    # -- pruned draws -------------------------------------------------------------------
    def prunes(self, sampling: SamplingConfig) -> bool:
        """Whether ``select`` skips clusters for ``sampling`` (else it draws from ``scores``)."""
        if not self.n_clusters:
            return False
        if sampling.greedy:
            return True
        if sampling.top_k is not None:
            return sampling.top_k <= self.shortlist
        plain = sampling.top_p is None or sampling.top_p >= 1.0
        return plain and sampling.temperature == 1.0

    def select(
        self,
        hidden: Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
        *,
        noise: Tensor | None = None,
        host_branch: bool = True,
    ) -> Tensor:
        """The next token per row, [B]: ``sample(scores(hidden), sampling, generator)``
        with the tail clusters that cannot hold the draw skipped (see the module doc).
        ``noise``: the draw's random numbers (txlm.sampling.draw_noise over the vocabulary),
        else drawn here from ``generator``."""
        if not self.prunes(sampling):
            return sample(self.scores(hidden), sampling, generator, noise=noise)
        head = self.head_log_probs(hidden)  # [B, shortlist + C]
        if noise is None and not sampling.greedy:
            noise = draw_noise(
                sampling, head.size(0), self.vocab_size, generator, head.device, head.dtype
            )
        if sampling.greedy or sampling.top_k is not None:
            return self._select_top(hidden, head, sampling, noise, host_branch)
        return self._select_two_stage(hidden, head, noise, host_branch)

    def _cluster(self, need: Tensor, host_branch: bool, fn, skip, *operands: Tensor):
        """``fn(*operands)`` where some row needs the cluster (``need`` [B] bool), else
        ``skip(*operands)`` (the same shapes). ``host_branch``: a Python branch on ``need``;
        otherwise both, chosen on the device, ``fn`` given the flag (``needed=``, see
        ``logits``)."""
        if host_branch:
            return fn(*operands) if bool(need.any()) else skip(*operands)
        needed = need.any()
        taken, skipped = fn(*operands, needed=needed), skip(*operands)
        if isinstance(taken, Tensor):
            return torch.where(needed, taken, skipped)
        return tuple(torch.where(needed, a, b) for a, b in zip(taken, skipped, strict=True))

    def _select_top(self, hidden, head, sampling, noise, host_branch) -> Tensor:
        k = 1 if sampling.greedy else sampling.top_k
        short = self.shortlist
        vals, ids = head[:, :short].topk(k, dim=-1)  # [B, k]
        kth = vals[:, -1:]  # a tail token at or above it needs head_c >= it
        all_vals, all_ids = [vals], [ids]
        for i in range(1, self.n_clusters + 1):
            lo, hi = self.bounds[i]
            kc = min(k, hi - lo)

            def top(h: Tensor, hd: Tensor, i: int = i, kc: int = kc, needed=None):
                vals, ids = self.tail_log_probs(i, h, hd, needed).topk(kc, dim=-1)
                return vals, ids  # a plain tuple, as ``none``'s

            def none(h: Tensor, hd: Tensor, kc: int = kc) -> tuple[Tensor, Tensor]:
                rows = hd.size(0)
                ids = torch.zeros(rows, kc, dtype=torch.long, device=hd.device)
                return hd.new_full((rows, kc), float("-inf")), ids

            need = head[:, short + i - 1] >= kth[:, 0]
            v, j = self._cluster(need, host_branch, top, none, hidden, head)
            all_vals.append(v)
            all_ids.append(j + lo)
        vals, pos = torch.cat(all_vals, dim=-1).topk(k, dim=-1)  # the vocabulary's k best
        ids = torch.cat(all_ids, dim=-1).gather(1, pos)
        if sampling.greedy:
            return ids[:, 0]
        return ids.gather(1, race(candidate_probs(vals, sampling), noise)).squeeze(1)

    def _select_two_stage(self, hidden, head, noise, host_branch) -> Tensor:
        short = self.shortlist
        probs = head.exp()  # [B, shortlist + C]: tokens of the shortlist, then clusters
        cdf = probs.cumsum(dim=-1)
        u = noise.to(cdf.dtype)  # [B, 1]
        first = cdf_index(cdf, u)  # [B]
        token = first.clone()  # right where it is a shortlist token
        for i in range(1, self.n_clusters + 1):
            col = short + i - 1
            lo, _ = self.bounds[i]
            drawn = first == col
            # the uniform rescaled into the cluster's share of the head's CDF
            inner = (u[:, 0] - (cdf[:, col] - probs[:, col])) / probs[:, col]

            def within(h: Tensor, hd: Tensor, inner: Tensor, i: int = i, needed=None) -> Tensor:
                tail = F.softmax(upcast(self.logits(i, h, needed)), dim=-1)  # p(token | cluster)
                return cdf_index(tail.cumsum(dim=-1), inner[:, None])

            def none(h: Tensor, hd: Tensor, inner: Tensor) -> Tensor:
                return torch.zeros(hd.size(0), dtype=torch.long, device=hd.device)

            j = self._cluster(drawn, host_branch, within, none, hidden, head, inner)
            token = torch.where(drawn, j + lo, token)
        return token
