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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txlm.config import ModelConfig
from txlm.model.dropout import Dropout, dropout


def rel_shift(x: Tensor) -> Tensor:
    """Per-distance scores [..., L, K+1] -> per-pair scores [..., L, K].

    Column c of ``x`` holds distance K-1-c (the last column, c = K, distance -1). Query i sits
    at key index M+i, so pair (i, j) needs distance M+i-j, i.e. column c = L-1-i+j. In the
    flat row-major buffer that is offset i*(K+1) + L-1-i+j = (L-1) + i*K + j: a view with
    storage offset L-1 and row stride K. The extra distance -1 column makes the row stride K
    equal to the view's width, so no element is viewed twice (a cheap backward) and every
    visible pair (j <= M+i) reads from its own row; the masked pairs read finite junk.

    Written as flatten + slice + view (not ``as_strided``): the same view, but it never asks
    for the storage offset, which torch.compile cannot trace without a graph break.
    """
    qlen, kp1 = x.shape[-2:]
    klen = kp1 - 1
    flat = x.contiguous().flatten(-2)  # [..., L*(K+1)]
    return flat[..., qlen - 1 : qlen - 1 + qlen * klen].unflatten(-1, (qlen, klen))


def _additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True: may attend) -> 0 / -inf bias of the same shape, to add to scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )


class RelativeAttention(nn.Module):
    """One layer's attention, for every encoding of the paper's Table 6 (see config.AttnType)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.d_head = config.n_head, config.d_head
        self.attn_type = config.attn_type
        self.pre_lnorm = config.pre_lnorm
        self.attn_impl = config.attn_impl
        self.dropatt = config.dropatt
        self.scale = 1.0 / math.sqrt(config.d_head)
        inner = config.n_head * config.d_head

        # Rows [0, inner) project queries, [inner, 3 inner) keys and values. One weight so a
        # checkpoint stores it once; queries are projected from the current segment only.
        self.qkv = nn.Linear(config.d_model, 3 * inner, bias=False)
        self.out = nn.Linear(inner, config.d_model, bias=False)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.drop = Dropout(config.dropout)

        if self.attn_type == "xl":
            self.r_net = nn.Linear(config.d_model, inner, bias=False)  # W_kR
            if config.untie_r:
                self.u = nn.Parameter(torch.zeros(config.n_head, config.d_head))
                self.v = nn.Parameter(torch.zeros(config.n_head, config.d_head))
        elif self.attn_type == "shaw":
            # Learned relative embeddings, one per clipped distance, per layer.
            self.r_emb = nn.Parameter(torch.zeros(config.n_positions, config.n_head, config.d_head))

    # -- pieces -------------------------------------------------------------------------
    def _heads(self, x: Tensor) -> Tensor:
        """[B, T, H*Dh] -> [B, H, T, Dh]."""
        return x.unflatten(-1, (self.n_head, self.d_head)).transpose(1, 2)

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
            r = self.r_net(pos)  # pos is R [K+1, D]
            return r.unflatten(-1, (self.n_head, self.d_head)).transpose(0, 1)
        # pos holds distances [K+1]; clip into the table (negative: masked pairs only)
        idx = pos.long().clamp(0, self.r_emb.size(0) - 1)
        return self.r_emb[idx].transpose(0, 1)

    def score_terms(
        self, q: Tensor, k: Tensor, rk: Tensor | None, u: Tensor | None, v: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Content scores (a)+(c) [B, H, L, K] and shifted position scores (b)+(d), unscaled."""
        qc = q if u is None else q + u[:, None, :]
        content = qc @ k.transpose(-1, -2)
        if rk is None:
            return content, None
        qp = q if v is None else q + v[:, None, :]
        return content, rel_shift(qp @ rk.transpose(-1, -2))

    def _scores(
        self,
        q: Tensor,
        k: Tensor,
        rk: Tensor | None,
        mask: Tensor,
        u: Tensor | None,
        v: Tensor | None,
    ) -> Tensor:
        """Scaled, masked scores [B, H, L, K]: the same numbers as ``score_terms`` summed,
        scaled and masked, in fewer passes over the [B, H, L, K] buffer (it dominates the
        memory traffic): the scale goes onto the queries ([B, H, L, Dh], K/Dh times smaller),
        the mask is an additive 0/-inf bias added to the shifted position scores, and the
        content matmul accumulates onto that sum (baddbmm with beta = 1).
        """
        batch, heads, qlen, d_head = q.shape
        klen = k.size(2)
        rows = batch * heads
        # The keys' dtype is the matmuls' (bf16 under autocast, where q + u would promote to
        # float32): baddbmm_ is in place, so autocast does not cast its inputs for us.
        dtype = k.dtype
        qc = ((q if u is None else q + u[:, None, :]) * self.scale).to(dtype)
        qc = qc.reshape(rows, qlen, d_head)
        kt = k.transpose(-1, -2).reshape(rows, d_head, klen)
        mask_bias = _additive_mask(mask, dtype)  # [L, K] or [B, 1, L, K]
        if rk is not None and mask.dim() == 2:
            qp = ((q if v is None else q + v[:, None, :]) * self.scale).to(dtype)
            # rel_shift's view merges (B, H) without a copy; the sum is a new 3-D tensor that
            # nothing else references, so the content matmul may accumulate into it in place
            # (add saves no inputs for backward; baddbmm's backward needs only qc and kt).
            scores = rel_shift(qp @ rk.transpose(-1, -2)).view(rows, qlen, klen) + mask_bias
            return scores.baddbmm_(qc, kt).view(batch, heads, qlen, klen)
        # Per-row masks (or no position term): the sum is [B, H, L, K] and its 3-D form a
        # view, which in-place autograd would have to copy; accumulate out of place instead.
        if rk is None:
            bias = mask_bias.expand(batch, heads, qlen, klen)
        else:
            qp = ((q if v is None else q + v[:, None, :]) * self.scale).to(dtype)
            bias = rel_shift(qp @ rk.transpose(-1, -2)) + mask_bias
        scores = torch.baddbmm(bias.reshape(rows, qlen, klen), qc, kt)
        return scores.view(batch, heads, qlen, klen)

    # -- forward ------------------------------------------------------------------------
    def forward(
        self,
        h: Tensor,
        mem: Tensor | None,
        mask: Tensor,
        pos: Tensor | None,
        u: Tensor | None = None,
        v: Tensor | None = None,
        *,
        past_kv: tuple[Tensor, Tensor] | None = None,
        return_kv: bool = False,
        return_probs: bool = False,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """h [B, L, D] current inputs, mem [B, M, D] (layer inputs of earlier positions).

        mask: bool [L, K] or [B, 1, L, K], True where attention is allowed.
        pos: R [K+1, D] for "xl", distances [K+1] for "shaw", None for absolute encodings.
        past_kv: keys/values [B, H, M, Dh] already projected for the memory (generation
            cache); then ``mem`` is not re-projected. ``return_kv`` hands back this segment's.
        Returns (output [B, L, D], extras) with extras "k", "v" (current positions) and
        "probs" [B, H, L, K] on request.
        """
        qlen = h.size(1)
        x_cur = self.norm(h) if self.pre_lnorm else h
        w_q, w_kv = self._split_qkv()
        extras: dict[str, Tensor] = {}
        if past_kv is not None:
            # the memory is already projected: one matmul gives this segment's q, k and v
            q, k_cur, v_cur = (self._heads(t) for t in self.qkv(x_cur).chunk(3, dim=-1))
            k = torch.cat([past_kv[0], k_cur], dim=2)
            val = torch.cat([past_kv[1], v_cur], dim=2)
        elif (
            mem is not None
            and mem.size(1) > 0
            and not self.pre_lnorm
            and x_cur.requires_grad
            and not mem.requires_grad
        ):
            # Training with memory: the memory is a constant (stop-gradient, Sec. 3.2), so
            # project it on its own. Projecting [memory; segment] in one product would make
            # the backward compute an input gradient for the M memory rows only to drop it:
            # 2 B M D 2I FLOPs per layer, ~4% of a step. (Pre-LN needs that gradient for
            # its LayerNorm's parameters, so it takes the general path below.)
            inner = self.n_head * self.d_head
            # this segment's queries, keys, values in one product; one split, whose backward
            # is a single concatenation (two slices would each zero-fill a [B, L, 3I] grad)
            q_cur, kv_cur = self.qkv(x_cur).split([inner, 2 * inner], dim=-1)
            kv = torch.cat([F.linear(mem, w_kv), kv_cur], dim=1)  # [B, K, 2I]
            q = self._heads(q_cur)
            k, val = (self._heads(t) for t in kv.chunk(2, dim=-1))
            k_cur, v_cur = k[:, :, -qlen:], val[:, :, -qlen:]
        else:
            q = self._heads(F.linear(x_cur, w_q))  # [B, H, L, Dh]
            if mem is not None and mem.size(1) > 0:
                x_all = torch.cat([self.norm(mem) if self.pre_lnorm else mem, x_cur], dim=1)
            else:
                x_all = x_cur
            k, val = self.project_kv(x_all, w_kv)
            k_cur, v_cur = k[:, :, -qlen:], val[:, :, -qlen:]
        if return_kv:
            extras["k"], extras["v"] = k_cur, v_cur

        if self.attn_type == "xl":
            u = self.u if hasattr(self, "u") else u
            v = self.v if hasattr(self, "v") else v
        else:
            u = v = None
        rk = self.position_keys(pos) if pos is not None else None
        rk = rk.to(q.dtype) if rk is not None else None

        if self._use_sdpa(q, rk, return_probs):
            attn = self._sdpa(q, k, val, rk, mask, u, v)
        else:
            scores = self._scores(q, k, rk, mask, u, v)
            probs = torch.softmax(
                scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)
            )
            probs = probs.to(val.dtype)
            if return_probs:
                extras["probs"] = probs
            probs = dropout(probs, self.dropatt, self.training)
            attn = probs @ val

        out = self.drop(self.out(attn.transpose(1, 2).flatten(2)))  # [B, L, D]
        out = h + out if self.pre_lnorm else self.norm(h + out)
        return out, extras

    def _use_sdpa(self, q: Tensor, rk: Tensor | None, return_probs: bool) -> bool:
        """Whether the fused kernel runs. On the CPU, torch's fused SDPA kernel has no
        backward for an attention bias: when the position bias needs a gradient (training)
        SDPA falls back to its unfused reference math, which makes more passes over the
        scores than ``_scores`` (measured: benchmarks/compare.py), so we use ours there."""
        if self.attn_impl != "sdpa" or return_probs:
            return False
        bias_needs_grad = (
            rk is not None and torch.is_grad_enabled() and (q.requires_grad or rk.requires_grad)
        )
        return not (bias_needs_grad and q.device.type == "cpu")

    def _sdpa(
        self,
        q: Tensor,
        k: Tensor,
        val: Tensor,
        rk: Tensor | None,
        mask: Tensor,
        u: Tensor | None,
        v: Tensor | None,
    ) -> Tensor:
        """Fused path: (a)+(c) inside scaled_dot_product_attention, (b)+(d) as additive bias."""
        p_drop = self.dropatt if self.training else 0.0
        if rk is None:
            return F.scaled_dot_product_attention(q, k, val, attn_mask=mask, dropout_p=p_drop)
        # One pass builds the bias: the scale goes onto the queries ([B, H, L, Dh]) and the
        # mask is added as 0/-inf, instead of a scale pass and a masked_fill pass.
        qp = ((q if v is None else q + v[:, None, :]) * self.scale).to(k.dtype)
        bias = rel_shift(qp @ rk.transpose(-1, -2)) + _additive_mask(mask, k.dtype)
        qc = q if u is None else q + u[:, None, :]
        return F.scaled_dot_product_attention(
            qc, k, val, attn_mask=bias, dropout_p=p_drop, scale=self.scale
        )


class PositionwiseFF(nn.Module):
    """Two-layer ReLU network with residual and LayerNorm (post-LN as in the paper)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pre_lnorm = config.pre_lnorm
        self.fc1 = nn.Linear(config.d_model, config.d_inner)
        self.fc2 = nn.Linear(config.d_inner, config.d_model)
        self.drop = Dropout(config.dropout)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, h: Tensor) -> Tensor:
        x = self.norm(h) if self.pre_lnorm else h
        out = self.drop(self.fc2(self.drop(F.relu(self.fc1(x)))))
        return h + out if self.pre_lnorm else self.norm(h + out)
