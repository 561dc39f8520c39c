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
import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txlm.model.align import Stored, stored_rows


def upcast(x: Tensor) -> Tensor:
    """Half-precision logits or scores are normalised and compared in float32; float32 and
    float64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _tail(x: Tensor, weight: Tensor, bias: Tensor, cluster: Tensor) -> Tensor:
    """A tail cluster's log-probabilities [N, n]: log p(cluster) + log p(token | cluster)."""
    return cluster + F.log_softmax(upcast(F.linear(x, weight, bias)), dim=-1)


def _tail_traced(
    x: Tensor, weight: Tensor, bias: Tensor, cluster: Tensor, spread: Tensor
) -> Tensor:
    """``_tail`` in a traced graph. For one row its product is a sum along each row of the
    weight, a loop the compiler generates and fuses with how the rows are read (one read of
    the weight, or of the rows an index picks): inside a branch of ``torch.cond`` the weight
    is one of the branch's inputs, not a constant, and a packaged step's C++ product
    template takes constant weights only. (``spread`` unused: the two branches of a
    ``torch.cond`` take the same operands.)"""
    if x.size(0) > 1:
        return _tail(x, weight, bias, cluster)
    logits = (x[:, None, :] * weight).sum(-1) + bias
    return cluster + F.log_softmax(upcast(logits), dim=-1)


def _spread(x: Tensor, weight: Tensor, bias: Tensor, cluster: Tensor, spread: Tensor) -> Tensor:
    """A skipped cluster's [N, n]: its mass spread evenly (a copy: a branch of ``torch.cond``
    returns no view of its inputs)."""
    return spread.expand(-1, weight.size(0)).clone()


def _cluster_bounds(vocab_size: int, cutoffs: list[int]) -> list[tuple[int, int]]:
    ends = [0, *cutoffs, vocab_size]
    return list(itertools.pairwise(ends))


def _stored(stored: Stored | None, d_embed: int, d_proj: int) -> tuple[int, int, int]:
    """The stored projection dim, (div_val 1) embedding dim and row multiple
    (txlm.model.align.Stored; None: the real ones)."""
    if stored is None:
        return d_proj, d_embed, 1
    return stored.d_model, stored.d_embed, stored.logits


class AdaptiveEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        d_embed: int,
        d_proj: int,
        cutoffs: list[int],
        div_val: int,
        stored: Stored | None = None,
    ) -> None:
        """``stored``: the padded widths to store the weights with (txlm.model.align); the
        rows are stored as the softmax stores them (a tied weight is one tensor)."""
        super().__init__()
        self.vocab_size, self.d_proj, self.div_val = vocab_size, d_proj, div_val
        self.bounds = _cluster_bounds(vocab_size, cutoffs)
        self.scale = d_proj**0.5  # embeddings are scaled by sqrt(d_model), as in Vaswani et al.
        self.layers = nn.ModuleList()
        self.projs = nn.ParameterList()
        dp, ep, multiple = _stored(stored, d_embed, d_proj)
        rows = stored_rows(self.bounds, div_val, multiple)
        if div_val == 1:
            self.layers.append(nn.Embedding(rows[0], ep))
            if d_proj != d_embed:
                self.projs.append(nn.Parameter(torch.zeros(dp, ep)))
        else:
            for i in range(len(self.bounds)):
                d_i = d_embed // div_val**i
                self.layers.append(nn.Embedding(rows[i], d_i))
                self.projs.append(nn.Parameter(torch.zeros(dp, d_i)))

    def forward(self, ids: Tensor) -> Tensor:
        """ids [B, L] -> [B, L, P]."""
        if self.div_val == 1:
            emb = F.embedding(ids, self.layers[0].weight)  # (no module call: one per token)
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
        self,
        vocab_size: int,
        d_embed: int,
        d_proj: int,
        cutoffs: list[int],
        div_val: int,
        stored: Stored | None = None,
    ) -> None:
        """``stored``: the padded widths to store the weights with (txlm.model.align)."""
        super().__init__()
        self.vocab_size, self.div_val = vocab_size, div_val
        self.bounds = _cluster_bounds(vocab_size, cutoffs)
        self.cutoffs = list(cutoffs)
        self.n_clusters = len(cutoffs)
        self.shortlist = self.bounds[0][1]
        dp, ep, multiple = _stored(stored, d_embed, d_proj)
        self.multiple = multiple  # every block's logits stored as a multiple of this
        rows = stored_rows(self.bounds, div_val, multiple)
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, ep))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        self.layers = nn.ModuleList()
        self.projs = nn.ParameterList()
        if div_val == 1:
            self.layers.append(nn.Linear(ep, rows[0]))
            if d_proj != d_embed:
                for _ in self.bounds:
                    self.projs.append(nn.Parameter(torch.zeros(dp, ep)))
        else:
            for i in range(len(self.bounds)):
                d_i = d_embed // div_val**i
                self.layers.append(nn.Linear(d_i, rows[i]))
                self.projs.append(nn.Parameter(torch.zeros(dp, d_i)))

    # -- per-cluster logits -------------------------------------------------------------
    def _weights(self, i: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Weight, bias and projection of cluster i (0 = the head's shortlist part)."""
        proj = self.projs[i] if len(self.projs) else None
        if self.div_val == 1:
            lo, hi = self.bounds[i]
            layer = self.layers[0]
            return layer.weight[lo:hi], layer.bias[lo:hi], proj
        layer = self.layers[i]
        lo, hi = self.bounds[i]
        if layer.weight.size(0) != hi - lo:  # padded rows (txlm.model.align)
            return layer.weight[: hi - lo], layer.bias[: hi - lo], proj
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
        return F.log_softmax(upcast(logits), dim=-1)

    # -- public -------------------------------------------------------------------------
    def log_prob(
        self,
        hidden: Tensor,
        need: Callable[[Tensor], Tensor] | None = None,
        *,
        head: Callable[[Tensor], Tensor] | None = None,
        branch: Literal["host", "graph", "none"] = "host",
        normalise: bool = True,
    ) -> Tensor:
        """hidden [N, P] -> log-probabilities [N, V] (float32 at least).

        ``need``: the tail clusters a draw may take its token from (a decoder's pruned
        draw, txlm.inference.sampling.clusters_needed): the head's log-probabilities [N, shortlist +
        C] -> bool [N, C]. A cluster no row needs is not computed: its tokens hold its mass
        spread evenly, head_c - log n_c. That is at most head_c, below every candidate a
        top-k cut or greedy keeps when ``need`` rules the cluster out, and it keeps the
        cluster's share of the cumulative distribution, so an inverse CDF falls where it
        would (inside a skipped cluster only within rounding of its edge). ``branch``: how
        a cluster no row needs is skipped. "host": a Python branch (eagerly, where reading
        the flag is free: a CPU). "graph": a branch in the traced graph (``torch.cond``),
        which a compiled step on a CPU takes in its own code, skipping the cluster's
        product. "none": nothing is read on the host (a GPU's step, one graph a CUDA graph
        captures): each cluster is computed and its values or the spread ones chosen by
        ``torch.where``, and for one row a cluster no row needs has each of its outputs read
        the weight's first row (a reduction with an indexed load, fused by a compiler: a
        row's bytes, not the weight's; its arithmetic is still the cluster's).
        ``head``: the head's product (a module: its weight [shortlist + C, E] and bias, the
        shortlist rows then the cluster rows, joined once by a decoder: one product, not
        two; in its dtype or quantised) on the projected hidden states.
        ``normalise=False``: what a draw needs, log-probabilities up to a constant per row (a
        draw renormalises): a full softmax's logits as they are.
        """
        if head is None:
            head_lp = self._head_log_probs(hidden)
        else:
            proj = self.projs[0] if len(self.projs) else None
            logits = upcast(head(hidden if proj is None else hidden @ proj))
            if not self.n_clusters and not normalise:
                return logits
            head_lp = F.log_softmax(logits, dim=-1)
        if not self.n_clusters:
            return head_lp
        needs = None if need is None else need(head_lp)  # [N, C]
        out = head_lp.new_empty(hidden.size(0), self.vocab_size)
        out[:, : self.shortlist] = head_lp[:, : self.shortlist]
        for i in range(1, self.n_clusters + 1):
            lo, hi = self.bounds[i]
            cluster = head_lp[:, self.shortlist + i - 1, None]  # log p(cluster i) [N, 1]
            spread = cluster - math.log(hi - lo)
            needed = None if needs is None else needs[:, i - 1].any()
            if needed is not None and branch == "host" and not bool(needed):
                out[:, lo:hi] = spread
                continue
            weight, bias, proj = self._weights(i)
            x = hidden if proj is None else hidden @ proj
            if needed is not None and branch == "graph":
                args = (x, weight, bias, cluster, spread)
                out[:, lo:hi] = torch.cond(needed, _tail_traced, _spread, args)
            elif needed is not None and branch == "none":
                if x.size(0) == 1:  # a skipped cluster's outputs each read its first row
                    rows = torch.where(needed, torch.arange(hi - lo, device=x.device), 0)
                    weight, bias = weight[rows], bias[rows]
                tail = _tail_traced(x, weight, bias, cluster, spread)
                out[:, lo:hi] = torch.where(needed, tail, spread)
            else:  # every cluster (no rule), or one a row needs (a host branch)
                out[:, lo:hi] = _tail(x, weight, bias, cluster)
        return out

    def nll(
        self,
        hidden: Tensor,
        target: Tensor,
        ignore_index: int = -100,
        *,
        sizes: Sequence[int] | None = None,
    ) -> Tensor:
        """Negative log-likelihood [N] in input order; 0 where target == ignore_index.

        Every block of the softmax (the head, each tail cluster) runs as one fused loss
        (``_BlockNLL``). The tail clusters take their tokens in buckets: one stable sort
        by cluster puts each cluster's tokens together, and cluster i reads the ``size_i``
        positions from its start (empty slots are masked). No ``nonzero``. ``sizes``: the
        buckets' sizes, one per tail cluster, from a caller that counted the labels where
        they are on the host (the trainer, ``txlm.training.step.TailBuckets``): static shapes with
        nothing read back and little more work than the counts; a token past a full bucket
        gets a NaN loss (a visible failure, which the trainer skips as a non-finite step),
        never a wrong finite one; N each (every bucket holds every token) is exact for any
        labels, at N x (tail rows) logits. None: the sizes are the clusters' token counts,
        read to the host once (the least work; a graph break under torch.compile).
        """
        ignore = target == ignore_index
        blocks = self._blocks()
        if not self.n_clusters:
            weight, bias, proj, real = blocks[0]
            x = hidden if proj is None else hidden @ proj
            return _BlockNLL.apply(x, weight, bias, target.masked_fill(ignore, -1), real)

        target = target.masked_fill(ignore, 0)
        # 0: shortlist (or ignored), i: tail cluster i; from Python ints, no device copy
        cluster = sum((target >= c).long() for c in self.cutoffs)
        head_col = torch.where(cluster == 0, target, self.shortlist + cluster - 1)
        weight, bias, proj, real = blocks[0]
        x = hidden if proj is None else hidden @ proj
        nll = _BlockNLL.apply(x, weight, bias, head_col.masked_fill(ignore, -1), real)

        n = hidden.size(0)
        ids = torch.arange(self.n_clusters + 1, device=target.device)
        counts = (cluster[None, :] == ids[:, None]).sum(1)  # [n_clusters + 1]
        starts = counts.cumsum(0) - counts
        order = torch.argsort(cluster, stable=True)
        if sizes is not None:
            if len(sizes) != self.n_clusters:
                raise ValueError(f"{len(sizes)} bucket sizes for {self.n_clusters} tail clusters")
            sizes = [min(n, int(k)) for k in sizes]
        else:
            sizes = counts[1:].tolist()
        for i, size in enumerate(sizes, start=1):
            lo = self.bounds[i][0]
            slot = torch.arange(size, device=target.device)
            valid = slot < counts[i]
            # clamped slots read some other token; they are masked and add 0 below
            idx = order[(starts[i] + slot).clamp(max=n - 1)]
            weight, bias, proj, real = blocks[i]
            x = hidden.index_select(0, idx)
            x = x if proj is None else x @ proj
            local = torch.where(valid, target.index_select(0, idx) - lo, -1)
            # Runs on empty buckets too, so every parameter is used each step (DDP).
            nll = nll.scatter_add(0, idx, _BlockNLL.apply(x, weight, bias, local, real))
            if size < n:  # tokens that found their bucket full
                over = (cluster == i) & (torch.cumsum(cluster == i, 0) > size)
                nll = nll.masked_fill(over, float("nan"))
        return nll

    def _blocks(self) -> list[tuple[Tensor, Tensor, Tensor | None, int]]:
        """Weight, bias, projection and real row count of each softmax block: the head
        (shortlist rows and the cluster rows joined), then each tail cluster; rows past the
        real ones are padding (zero, their logits -inf; txlm.model.align). A tied div_val 1
        weight is cut by one ``split``: its backward joins the blocks' gradients into one
        buffer, where each slice's backward would fill a full-size zero gradient and add."""
        projs = [self.projs[i] if len(self.projs) else None for i in range(len(self.bounds))]
        real = [hi - lo for lo, hi in self.bounds]
        if self.div_val == 1:
            layer = self.layers[0]
            sizes = [*real[:-1], real[-1] + layer.weight.size(0) - self.vocab_size]
            weights, biases = [layer.weight], [layer.bias]
            if len(sizes) > 1:  # (a split's backward is a copy even of one piece)
                weights, biases = layer.weight.split(sizes), layer.bias.split(sizes)
        else:
            weights = [layer.weight for layer in self.layers]
            biases = [layer.bias for layer in self.layers]
        if not self.n_clusters:
            return [(weights[0], biases[0], projs[0], real[0])]
        head_w, head_bias = weights[0], biases[0]
        if head_w.size(0) != real[0]:  # padded shortlist rows (div_val > 1): the cluster
            head_w, head_bias = head_w[: real[0]], head_bias[: real[0]]  # rows follow the real
        head = [head_w, self.cluster_weight]
        head_b = [head_bias, self.cluster_bias]
        rows = sum(w.size(0) for w in head)
        extra = -rows % self.multiple
        if extra:  # joined anyway: the padding costs no copy of its own
            head.append(self.cluster_weight.new_zeros(extra, self.cluster_weight.size(1)))
            head_b.append(self.cluster_bias.new_zeros(extra))
        blocks = [(torch.cat(head), torch.cat(head_b), projs[0], real[0] + self.n_clusters)]
        tails = zip(weights[1:], biases[1:], projs[1:], real[1:], strict=True)
        return [*blocks, *tails]


CHUNK_ELEMENTS = 1 << 24  # logits of one block's loss held at once (64 MB in float32)


class _BlockNLL(torch.autograd.Function):
    """NLL of one softmax block, -log_softmax(x W^T + b)[target], [n], over its ``real``
    first rows (the others are padding); target -1: no loss and no gradient (an ignored
    token or an empty bucket slot).

    The logits' gradient, softmax - onehot, is made in the forward, chunk by chunk over
    the tokens, and kept in the matmul dtype (so the float32 logits of half-precision
    training live one chunk at a time, and no [n, R] log-softmax output is saved and
    walked again). The backward scales D's rows by each token's upstream gradient g once:
    dx = (g D) W, dW = (g D)^T x, db = sum of the rows of g D. Under autocast the matmuls run in its
    dtype, the block's weight cast once and reused by the backward.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, target: Tensor, real: int) -> Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            xc, wc, bc = x.to(dtype), weight.to(dtype), bias.to(dtype)
            n, rows = x.size(0), weight.size(0)
            keep = target >= 0
            tgt = target.clamp(min=0)[:, None]
            step = max(1, CHUNK_ELEMENTS // max(rows, 1))
            # an empty head first, so that no tokens at all still gives [0] and [0, R]
            nlls = [x.new_zeros(0, dtype=upcast(xc).dtype)]
            grads = [xc.new_zeros(0, rows)]
            for s in range(0, n, step):
                t = tgt[s : s + step]
                logits = torch.addmm(bc, xc[s : s + step], wc.t())
                if real < rows:  # padded rows: no probability, no gradient
                    logits[:, real:] = float("-inf")
                logp = torch.log_softmax(upcast(logits), dim=-1)
                nlls.append(-logp.gather(1, t).squeeze(1))
                # d nll / d logits = softmax - onehot
                grad = logp.exp_().scatter_add_(1, t, torch.full_like(t, -1, dtype=logp.dtype))
                grads.append(grad.to(dtype))
            # one chunk (the usual case on a CPU): no copy
            nll = nlls[-1] if len(nlls) == 2 else torch.cat(nlls)
            grad = grads[-1] if len(grads) == 2 else torch.cat(grads)
        # rows without a target keep their gradient here and get no upstream weight instead
        ctx.save_for_backward(xc, wc, grad, keep)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype)
        return nll.masked_fill(~keep, 0.0)

    @staticmethod
    def backward(ctx, g: Tensor):
        xc, wc, grad, keep = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        # the logits' gradient once, then two products and the bias's sum
        d_logits = grad * g.masked_fill(~keep, 0.0).to(grad.dtype)[:, None]
        dx = (d_logits @ wc).to(x_dtype)
        dw = (d_logits.t() @ xc).to(w_dtype)
        half = grad.dtype in (torch.float16, torch.bfloat16)
        db = d_logits.sum(0, dtype=torch.float32 if half else None)
        return dx, dw, db.to(b_dtype), None, None
