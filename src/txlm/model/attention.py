"""Multi-head attention over [memory; current segment] with the paper's relative encoding.

Dimension legend
    B  batch                 L  segment (query) length     M  memory length
    K  key length = M + L    H  heads                      Dh head dim
    D  model dim             scores are laid out [B, H, L, K]

The paper's relative score (Sec. 3.3, Eq. after "relative positional encodings"):

    A_ij = q_i.k_j  +  q_i.W_kR R_{i-j}  +  u.k_j  +  v.W_kR R_{i-j}
            (a)             (b)             (c)          (d)

grouped as (q_i + u).k_j  +  (q_i + v).r_{i-j}: two matmuls. The second is computed once per
distance, [L, K+1], then turned into the per-pair layout by ``rel_shift`` (Appendix B) — here a
strided view, no padding and no copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txlm.config import ModelConfig
from txlm.model.align import Stored
from txlm.model.cache import CacheStep, slot_scores
from txlm.model.dropout import Dropout, dropout

_NO_EXTRAS: Mapping[str, Tensor] = MappingProxyType({})  # what a forward returns by default
_HALF = (torch.float16, torch.bfloat16)  # dtypes normalised in float32


def rel_shift(x: Tensor, klen: int | None = None) -> Tensor:
    """Per-distance scores [..., L, K+1] -> per-pair scores [..., L, K].

    Column c of ``x`` holds distance K-1-c (the last column, c = K, distance -1). Query i sits
    at key index M+i, so pair (i, j) needs distance M+i-j, i.e. column c = L-1-i+j. In the
    flat row-major buffer that is offset i*(K+1) + L-1-i+j = (L-1) + i*K + j: a view with
    storage offset L-1 and row stride K. The extra distance -1 column makes the row stride K
    equal to the view's width, so no element is viewed twice (a cheap backward) and every
    visible pair (j <= M+i) reads from its own row; the masked pairs read finite junk.

    Written as flatten + slice + view (not ``as_strided``): the same view, but it never asks
    for the storage offset, which torch.compile cannot trace without a graph break.

    ``klen`` < W - 1 for a wider x [..., L, W] (columns past K: more negative distances,
    which only masked pairs read): the view then has row stride W - 1, cut to K columns.
    """
    qlen, width = x.shape[-2:]
    klen = width - 1 if klen is None else klen
    flat = x.contiguous().flatten(-2)  # [..., L*W]
    rows = flat[..., qlen - 1 : qlen - 1 + qlen * (width - 1)].unflatten(-1, (qlen, width - 1))
    return rows if width - 1 == klen else rows[..., :klen]


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)``, without an operation when it is in ``dtype`` already (a decoding step
    would otherwise make dozens of no-op calls)."""
    return x if x.dtype == dtype else x.to(dtype)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """LayerNorm over the last dim, or over its first ``weight.size(0)`` (the real model dim
    of a residual stream stored wider, txlm.model.align.Stored), zeros after. Half-precision
    activations under autocast stay half (autocast would return float32); the kernel keeps
    its statistics in float32 and reads float32 weights as they are."""
    if x.dtype in _HALF and torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return layer_norm(x, weight, bias, eps)
    d = weight.size(0)
    if x.size(-1) == d:
        return torch.layer_norm(x, (d,), weight, bias, eps)
    return F.pad(torch.layer_norm(x[..., :d], (d,), weight, bias, eps), (0, x.size(-1) - d))


def _args(norm: nn.LayerNorm) -> tuple[Tensor, Tensor, float]:
    """A LayerNorm module's (weight, bias, eps), as ``layer_norm`` takes them."""
    return norm.weight, norm.bias, norm.eps


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True: may attend) -> 0 / -inf bias of the same shape, to add to scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )


def _key_padding(klen: int, multiple: int) -> tuple[int, int]:
    """Masked key slots in front of [memory; segment] and extra distances at the near end
    that align the key axis K' = K + front and the per-distance width W >= K' + 1.

    The relative shift gives pair (i, j) distance K - L + i - j; with the key axis K' =
    K + front, slot j' = j + front gets K' - L + i - j' = the real distance. So the shift
    needs only ``front`` more distances, at the far end (zero keys: the slots are masked),
    and the bias comes out in its final [.., L, K'] layout, K' a multiple of 8, with no
    padding or slicing of the [B, H, L, K] tensor (nor of its gradient) by the kernel.
    The per-distance product gets K' + 1 rounded up to ``multiple`` columns (zero keys for
    more negative distances, read by masked pairs only), so its rows are aligned too.
    """
    front = -klen % multiple
    return front, -(klen + front + 1) % multiple


class RelativeAttention(nn.Module):
    """One layer's attention, for every encoding of the paper's Table 6 (see config.AttnType)."""

    def __init__(self, config: ModelConfig, layer: int = 0, stored: Stored | None = None) -> None:
        """``stored``: the widths to store the weights with and the key layout
        (txlm.model.align; None: as configured)."""
        super().__init__()
        stored = Stored.of(config) if stored is None else stored
        self.layer = layer  # its index in the model: which of a cache's layers it reads
        # d_head: the head dim as stored (Dhp); the scale is the real one
        self.n_head, self.d_head = config.n_head, stored.d_head
        self.attn_type = config.attn_type
        self.pre_lnorm = config.pre_lnorm
        self.attn_impl = config.attn_impl
        self.dropatt = config.dropatt
        self.scale = 1.0 / math.sqrt(config.d_head)
        # keys [memory; segment] rounded up to a multiple of this with masked slots in front
        # (1: as they come)
        self.key_multiple = stored.keys
        inner = config.n_head * stored.d_head

        # Rows [0, inner) project queries, [inner, 3 inner) keys and values. One weight so a
        # checkpoint stores it once; queries are projected from the current segment only.
        self.qkv = nn.Linear(stored.d_model, 3 * inner, bias=False)
        self.out = nn.Linear(inner, stored.d_model, bias=False)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)  # the real D
        self.drop = Dropout(config.dropout)
        self.locked = config.variational_dropout  # one mask per row, shared across positions

        self.untie_r = self.attn_type == "xl" and config.untie_r  # u, v of its own
        if self.attn_type == "xl":
            self.r_net = nn.Linear(stored.d_model, inner, bias=False)  # W_kR
            if config.untie_r:
                self.u = nn.Parameter(torch.zeros(config.n_head, stored.d_head))
                self.v = nn.Parameter(torch.zeros(config.n_head, stored.d_head))
        elif self.attn_type == "shaw":
            # Learned relative embeddings, one per clipped distance, per layer.
            self.r_emb = nn.Parameter(torch.zeros(config.n_positions, config.n_head, stored.d_head))

    # -- pieces -------------------------------------------------------------------------
    def _heads(self, x: Tensor) -> Tensor:
        """[B, T, H*Dh] -> [B, H, T, Dh]."""
        return x.view(*x.shape[:-1], self.n_head, self.d_head).transpose(1, 2)

    def _split_qkv(self) -> tuple[Tensor, Tensor]:
        """Query rows [I, D] and key/value rows [2I, D] of the fused weight, as views.

        One ``split`` rather than two slices: its backward concatenates the two gradients,
        where each slice's backward would zero-fill a full-size gradient and add them up.
        """
        inner = self.n_head * self.d_head
        w_q, w_kv = self.qkv.weight.split([inner, 2 * inner])
        return w_q, w_kv

    def project_kv(self, x: Tensor, w_kv: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values [B, H, T, Dh] of (normalised, for pre-LN) hidden states [B, T, D]."""
        if w_kv is None:
            w_kv = self._split_qkv()[1]
        kv = F.linear(x, w_kv)
        k, v = kv.chunk(2, dim=-1)
        return self._heads(k), self._heads(v)

    def position_keys(self, pos: Tensor) -> Tensor:
        """Per-distance keys [H, K+1, Dh]: W_kR R for "xl", learned rows for "shaw"."""
        if self.attn_type == "xl":
            if pos.size(-1) != self.r_net.in_features:  # a padded model dim (align)
                pos = F.pad(pos, (0, self.r_net.in_features - pos.size(-1)))
            r = self.r_net(pos)  # pos is R [K+1, D]
            return r.unflatten(-1, (self.n_head, self.d_head)).transpose(0, 1)
        # pos holds distances [K+1]; clip into the table (negative: masked pairs only)
        idx = pos.long().clamp(0, self.r_emb.size(0) - 1)
        return self.r_emb[idx].transpose(0, 1)

    def _scores(self, qc: Tensor, k: Tensor, bias: Tensor | None, fresh: bool) -> Tensor:
        """Scaled scores [B H, L, K] = scale * qc . k + bias, in one pass over the
        [B, H, L, K] buffer (it dominates the memory traffic): the content matmul accumulates
        onto the bias (baddbmm, beta = 1, alpha = scale). In place when the bias is ``fresh``
        (a sum nothing else references) and not a view autograd would have to copy for it."""
        qc, kt = qc.flatten(0, 1), k.transpose(-1, -2).flatten(0, 1)  # [B H, L, Dh], [B H, Dh, K]
        if bias is None:  # nothing to add (an unmasked step of an absolute encoding)
            return torch.bmm(qc, kt).mul_(self.scale)
        merged = bias.dim() == 3  # [B H, L, K] already
        if fresh and (merged or not torch.is_grad_enabled()):
            # backward needs qc and kt only; a 3-D bias is used as it is (even a same-shape
            # view would make autograd copy it for the in-place op)
            bias = bias if merged else bias.flatten(0, 1)
            return bias.baddbmm_(qc, kt, alpha=self.scale)
        bias = bias.expand(*k.shape[:2], qc.size(1), kt.size(2)).flatten(0, 1)
        return torch.baddbmm(bias, qc, kt, alpha=self.scale)

    def _bias(
        self,
        q: Tensor,
        rk: Tensor | None,
        mask: Tensor | None,
        v: Tensor | None,
        cache: CacheStep | None,
    ) -> tuple[Tensor | None, bool]:
        """The additive bias: the scaled position scores (b)+(d) plus the mask as 0 / -inf,
        and whether it is a fresh tensor (see ``_scores``). It is [B H, L, K] for a shared
        [L, K] mask or none, else broadcastable to [B, H, L, K]; None when there is neither.

        (q + v) . r is computed once per distance, then laid out per pair: by the relative
        shift (a view) for [memory; segment] keys, by the cache's distance index for its
        ring of slots (or not at all: an eager step's keys come in slot order). The scale
        goes onto the queries ([B, H, L, Dh], K/Dh times smaller).
        """
        mask_bias = None
        if mask is not None:
            dtype = q.dtype if rk is None else rk.dtype
            mask_bias = _as(mask, dtype) if mask.is_floating_point() else additive_mask(mask, dtype)
        if rk is None:
            return mask_bias, False
        qp = _as(q if v is None else q + v, rk.dtype)
        if cache is not None:
            # against its position keys, scaled already (TransformerXL.position_table):
            # [B, H, L, S] (or W), a fresh bias
            pairs = slot_scores(qp, rk, cache.index)
            # one row's [H, L, ·] is the [B H, L, ·] _scores takes already
            pairs = pairs if qp.size(0) > 1 else pairs.flatten(0, 1)
            return (pairs if mask_bias is None else pairs + mask_bias), True
        # from [B, H, L, K+1] (or wider, see _key_padding)
        klen = rk.size(1) - 1 if mask is None else mask.size(-1)
        pairs = rel_shift((qp * self.scale) @ rk.transpose(-1, -2), klen)
        if mask_bias is None or mask_bias.dim() == 2:  # merging (B, H) is a view
            batch, heads, qlen, klen = pairs.shape
            pairs = pairs.reshape(batch * heads, qlen, klen)
            # the sum is a new 3-D tensor
            return (pairs, True) if mask_bias is None else (pairs + mask_bias, True)
        return pairs + mask_bias, True

    # -- forward ------------------------------------------------------------------------
    def forward(
        self,
        h: Tensor,
        mem: Tensor | None,
        mask: Tensor | None,
        pos: Tensor | None,
        u: Tensor | None = None,
        v: Tensor | None = None,
        *,
        cache: CacheStep | None = None,
        return_probs: bool = False,
    ) -> tuple[Tensor, Mapping[str, Tensor]]:
        """h [B, L, D] current inputs, mem [B, M, D] (layer inputs of earlier positions), for
        every L: a training or evaluation segment, a prompt's segment or one decoded token.

        mask: True (or 0.0) where attention is allowed, [L, K] or [B, 1, L, K]; float masks
            are additive (0 / -inf). None: every key is visible.
        pos: R [K+1, D] for "xl", distances [K+1] for "shaw", None for absolute encodings.
        u, v: the model's shared position biases [H, 1, Dh] ("xl" without untie_r).
        cache: inference only, this segment's step of a ``KVCache`` (txlm.model.cache). It
            stores this segment's keys and values and supplies the keys, values and position
            keys of its slots (K = S or the W written ones), their distance index, and the
            mask (``mem``, ``mask`` and ``pos`` are not used).
        Returns (output [B, L, D], extras) with "probs" [B, H, L, K] on request.
        """
        norm, (u, v) = _args(self.norm), self._position_biases(u, v)
        x = layer_norm(h, *norm) if self.pre_lnorm else h
        front = 0
        if cache is not None:
            mask = cache.mask
        elif self.key_multiple > 1 and mask is not None and not return_probs:
            # aligned keys for [memory; segment] (see _key_padding), with the probabilities
            # over the real keys only when they are asked for
            klen = h.size(1) + (0 if mem is None else mem.size(1))
            front, back = _key_padding(klen, self.key_multiple)
            value = float("-inf") if mask.is_floating_point() else False
            mask = F.pad(mask, (front, 0), value=value)
            if pos is not None:  # R [K+1, D] rows or distances [K+1]: for masked pairs only
                pos = F.pad(pos, (0, 0, front, back) if pos.dim() == 2 else (front, back))
        q, k, val = self._project(x, mem, cache, front)

        if cache is not None:
            rk = cache.table(self.layer)  # held in the cache's dtype
        else:
            rk = self.position_keys(pos) if pos is not None else None
            rk = _as(rk, k.dtype) if rk is not None else None
        # the Triton kernel makes no bias [B, H, L, K]
        fused = self.attn_impl == "triton" and self._use_triton(mask, cache, return_probs)
        bias, fresh = (None, False) if fused else self._bias(q, rk, mask, v, cache)
        qc = q if u is None else q + u  # content terms (a) + (c)

        extras = _NO_EXTRAS
        if fused:
            from txlm.model import triton_attention  # the triton package only when used

            qp = q if v is None else q + v  # position terms (b) + (d)
            attn = triton_attention.relative_attention(qc, qp, k, val, rk, mask, self.scale)
        elif self.attn_impl == "sdpa" and self._use_sdpa(q, rk, return_probs):
            p_drop = self.dropatt if self.training else 0.0
            if bias is not None:
                if bias.dim() == 3:
                    bias = bias.view(q.size(0), q.size(1), *bias.shape[1:])
                bias = _as(bias, k.dtype)
            attn = F.scaled_dot_product_attention(
                _as(qc, k.dtype), k, val, attn_mask=bias, dropout_p=p_drop, scale=self.scale
            )
        else:
            # the keys' dtype is the matmuls' (bf16 under autocast, where q + u promotes)
            bias = None if bias is None else _as(bias, k.dtype)
            scores = self._scores(_as(qc, k.dtype), k, bias, fresh)
            if cache is not None and cache.hidden is not None:  # an eager step's one slot
                scores.select(-1, cache.hidden).fill_(float("-inf"))
            if scores.dtype not in _HALF:
                probs = torch.softmax(scores, dim=-1)
            else:  # half precision is normalised in float32
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(val.dtype)
            if return_probs:
                extras = {"probs": probs.view(*q.shape[:3], -1)}
            if self.training:
                probs = dropout(probs, self.dropatt, True)
            # [B H, L, Dh] from [B H, L, K] as _scores lays them out: one bmm
            attn = torch.bmm(probs, val.flatten(0, 1))

        # the heads' outputs as rows [B L, H Dh] for one 2-D product
        batch, heads, qlen, d_head = q.shape
        out = self.out(
            attn.view(batch, heads, qlen, d_head).transpose(1, 2).reshape(batch * qlen, -1)
        )
        out = out.view_as(h)
        if self.training:
            out = dropout(out, self.drop.p, True, self.locked)
        return h + out if self.pre_lnorm else layer_norm(h + out, *norm), extras

    def _position_biases(
        self, u: Tensor | None, v: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """The content and position biases u, v this layer adds ("xl" only), [H, 1, Dh] to
        broadcast over the queries: its own (untie_r) or the model's shared ones (given so)."""
        if self.attn_type != "xl":
            return None, None
        if self.untie_r:
            return self.u.unsqueeze(1), self.v.unsqueeze(1)
        return u, v

    def _project(
        self, x: Tensor, mem: Tensor | None, cache: CacheStep | None, front: int = 0
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries [B, H, L, Dh] of this segment; keys and values [B, H, K, Dh] of all it sees
        (``front`` zero keys and values first: masked slots that align K, _key_padding).

        One product gives this segment's q, k and v (one ``split``: its backward is a single
        concatenation, where slices would each zero-fill a full-size gradient). The memory
        is a constant (stop-gradient, Sec. 3.2), projected in its own product, so training's
        backward computes no input gradient for its M rows (2 B M D 2I FLOPs per layer).
        Over a cache the keys and values are its slots, this segment's written into them
        (``CacheStep.update``).
        """
        batch, qlen = x.shape[:2]
        # one 2-D product on the B L rows (a 3-D input would take matmul's reshapes)
        qkv = self.qkv(x.flatten(0, 1))  # [B L, 3I]
        if cache is not None:  # -> [3, B, H, L, Dh]: one write for k and v
            qkv = qkv.view(batch, qlen, 3, self.n_head, self.d_head).permute(2, 0, 3, 1, 4)
            k, val = cache.update(self.layer, qkv[1:])
            return _as(qkv[0], k.dtype), k, val  # attention runs in the cache's dtype
        inner = self.n_head * self.d_head
        q, kv = qkv.view(batch, qlen, -1).split_with_sizes([inner, 2 * inner], dim=-1)
        q = self._heads(q)
        parts = [kv]
        if mem is not None and mem.size(1) > 0:
            m = layer_norm(mem, *_args(self.norm)) if self.pre_lnorm else mem
            parts.insert(0, _as(F.linear(m, self._split_qkv()[1]), kv.dtype))
        if front:  # in the same concatenation: no copy of its own
            parts.insert(0, kv.new_zeros(kv.size(0), front, kv.size(2)))
        if len(parts) > 1:
            kv = torch.cat(parts, dim=1)
        k, val = (self._heads(t) for t in kv.chunk(2, dim=-1))
        return q, k, val

    def _use_triton(self, mask: Tensor | None, cache: CacheStep | None, probs: bool) -> bool:
        """Whether txlm.model.triton_attention runs: for [memory; segment] keys under a bool
        mask, with no probabilities asked for and no attention dropout to apply (it has
        none); anything else takes the math path."""
        if self.attn_impl != "triton" or cache is not None or probs:
            return False
        no_dropout = self.dropatt == 0 or not self.training
        return no_dropout and (mask is None or mask.dtype == torch.bool)

    def _use_sdpa(self, q: Tensor, rk: Tensor | None, return_probs: bool) -> bool:
        """Whether the fused kernel runs; on the CPU the choice is measured
        (benchmarks/compare.py). There torch's fused SDPA kernel has no backward for an
        attention bias: when the position bias needs a gradient (training) SDPA falls back
        to its unfused reference math, which makes more passes over the scores than
        ``_scores``; and for a single query (decoding) its blocked kernel costs more than
        two matrix-vector products."""
        if self.attn_impl != "sdpa" or return_probs or q.size(2) == 1:
            return False
        if q.device.type != "cpu":
            return True
        bias_needs_grad = (
            rk is not None and torch.is_grad_enabled() and (q.requires_grad or rk.requires_grad)
        )
        return not bias_needs_grad


class PositionwiseFF(nn.Module):
    """Two-layer ReLU network with residual and LayerNorm (post-LN as in the paper)."""

    def __init__(self, config: ModelConfig, stored: Stored | None = None) -> None:
        """``stored``: the widths to store the weights with (txlm.model.align)."""
        super().__init__()
        stored = Stored.of(config) if stored is None else stored
        self.pre_lnorm = config.pre_lnorm
        self.fc1 = nn.Linear(stored.d_model, stored.d_inner)
        self.fc2 = nn.Linear(stored.d_inner, stored.d_model)
        self.drop = Dropout(config.dropout)
        self.locked = config.variational_dropout  # one mask per row, shared across positions
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)  # the real D

    def forward(self, h: Tensor) -> Tensor:
        """h [B, L, D] -> [B, L, D]."""
        # on rows [B L, D]: a 2-D input with a bias is one addmm per product, where torch
        # may run a 3-D one as a product and a separate pass to add the bias
        rows = h.flatten(0, 1)
        x = layer_norm(rows, *_args(self.norm)) if self.pre_lnorm else rows
        inner = self.fc1(x).relu_()
        if self.training:  # dropped as [B, L, .]: a locked mask is one per row
            p, locked = self.drop.p, self.locked
            inner = dropout(inner.view(*h.shape[:-1], -1), p, True, locked).view_as(inner)
        out = self.fc2(inner)
        if self.training:
            out = dropout(out.view_as(h), self.drop.p, True, self.locked).view_as(rows)
        out = rows + out
        out = out if self.pre_lnorm else layer_norm(out, *_args(self.norm))
        return out.view_as(h)
