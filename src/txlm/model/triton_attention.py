"""Relative attention over [memory; segment] in one fused Triton kernel, forward and backward.

Dimension legend
    B  batch               H  heads                L  queries (segment length)
    K  keys (memory + segment, plus any masked slots in front that align it)
    W  per-distance width of the position scores, >= K + 1 (attention.rel_shift)
    Dh head dim as stored  BM, BN query and key block sizes   BD padded head dim (power of 2)

The scores are the math path's (attention.RelativeAttention._scores):

    S[i, j] = scale * (q_i + u) . k_j  +  P[i, L - 1 - i + j]
    P       = (scale * (q + v)) @ rk^T          [B, H, L, W]: one score per distance

P is one ordinary matmul (cuBLAS on a GPU). The kernel reads P at the relative shift's index
by pointer arithmetic, so the per-pair bias [B, H, L, K] (and its padding, slicing and the
gradient's copy back) is never made. The forward is flash-attention style: an online softmax
over key blocks, with the log-sum-exp saved. The backward recomputes the probabilities; the
gradient of S is the gradient of P at the same index, and for a fixed query i each distance
column belongs to exactly one key j, so the kernel stores it without atomics. The gradients
of (q + v) and rk then come from the matmul's own backward (autograd, cuBLAS).

Why not the position term inside the kernel too (a tl.dot of a query block with the block of
rk rows it needs)? A [BM, BN] tile needs BM + BN - 1 distances, and each query row wants a
different diagonal of that product: a per-row shift of a register tile, which Triton has no
operation for. P costs 2 B H L W Dh FLOPs and one write plus one read of [B, H, L, W].

Who may attend to whom comes as per-row bounds, not a mask tensor. For every mask
txlm.model.mask.attention_mask builds (causality, same_length's window, document resets and
any memory validity) query i sees key j exactly when lo_i <= j <= hi_i and key j is seen by
some query at all (``kok``): a row's visible keys are its window's, minus the memory keys
that no query may see. ``_bounds`` derives these from the bool mask; the same bounds, taken
over the other axis (the first and last query that sees each key), let the backward's key
blocks skip the query blocks that cannot see them.

Attention dropout is not done here: RelativeAttention runs this only when ``dropatt`` is 0 or
the model is not training. On the CPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1`` before this module is imported): what the tests use to prove the
kernels against the math path (ARCHITECTURE.md C34).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from txlm.errors import ConfigError

# triton.jit reads this when it decorates the kernels below; on the CPU only the interpreter
# can run them
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _scores(q, k, offs_m, offs_n, lo, hi, kok, P, p_row, L, scale, HAS_P: tl.constexpr):
    """Scores [BM, BN] of a query block against a key block, and which of them are visible.

    q [BM, BD], k [BN, BD]; lo, hi [BM] each row's key bounds, kok [BN] the keys' validity;
    P + p_row: this (batch, head)'s per-distance scores, row stride W; masked entries of P
    are never read (a visible pair's column L-1-i+j lies in [0, K))."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    j = offs_n[None, :]
    visible = (j >= lo[:, None]) & (j <= hi[:, None]) & (kok[None, :] != 0)
    if HAS_P:
        col = (L - 1) - offs_m[:, None] + j
        s += tl.load(P + p_row + col, mask=visible, other=0.0).to(s.dtype)
    return s, visible


@triton.jit
def _key_block(K, V, KOK, k_base, v_base, kok_base, offs_n, offs_d, dims, s_kl, s_vl, KLEN):
    """Keys and values [BN, BD] at the key positions ``offs_n`` of one (batch, head), the
    keys' validity ``kok`` [BN] (0 past KLEN), which positions exist, and the [BN, BD] mask."""
    keys = offs_n < KLEN
    kv_mask = keys[:, None] & dims[None, :]
    k = tl.load(K + k_base + offs_n[:, None] * s_kl + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + v_base + offs_n[:, None] * s_vl + offs_d[None, :], mask=kv_mask, other=0.0)
    kok = tl.load(KOK + kok_base + offs_n, mask=keys, other=0)
    return k, v, kok, keys, kv_mask


@triton.jit
def _attention_fwd_kernel(
    QC, K, V, P, LO, HI, KOK, O, LSE,
    s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
    s_pb, s_ph, s_pl, s_ob, s_oh, s_ol, s_mb, s_kokb,
    H, L, KLEN, DH, scale,
    HAS_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """One block of BM queries of one (batch, head): O [BM, Dh] and LSE [BM].

    Grid (cdiv(L, BM), B * H). Strides s_<tensor><axis>, the last axis contiguous; s_mb is
    0 for a mask shared by the batch."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    rows = offs_m < L
    dims = offs_d < DH
    q = tl.load(
        QC + b * s_qb + h * s_qh + offs_m[:, None] * s_ql + offs_d[None, :],
        mask=rows[:, None] & dims[None, :], other=0.0,
    )  # fmt: skip
    # rows past L get an empty range, so they neither widen the loop nor see a key
    lo = tl.load(LO + b * s_mb + offs_m, mask=rows, other=KLEN)
    hi = tl.load(HI + b * s_mb + offs_m, mask=rows, other=-1)
    p_row = b * s_pb + h * s_ph + offs_m[:, None] * s_pl

    m_i = tl.full([BM], float("-inf"), ACC)  # running max
    l_i = tl.zeros([BM], ACC)  # running sum of exp(s - m_i)
    acc = tl.zeros([BM, BD], ACC)
    # only the key blocks some row of this block may see (causality skips about half)
    start = (tl.min(lo, 0) // BN) * BN
    for n0 in range(start, tl.max(hi, 0) + 1, BN):
        offs_n = n0 + tl.arange(0, BN)
        k, v, kok, _, _ = _key_block(K, V, KOK, b * s_kb + h * s_kh, b * s_vb + h * s_vh,
                                     b * s_kokb, offs_n, offs_d, dims, s_kl, s_vl,
                                     KLEN)  # fmt: skip
        s, visible = _scores(q, k, offs_m, offs_n, lo, hi, kok, P, p_row, L, scale, HAS_P)
        s = tl.where(visible, s.to(ACC), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no key yet keeps m = -inf: shift by 0 there, not by -inf
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(ACC)
        m_i = m_new

    safe = tl.where(l_i > 0, l_i, 1.0)  # a row with no visible key (none the model makes)
    out = acc / safe[:, None]
    tl.store(O + b * s_ob + h * s_oh + offs_m[:, None] * s_ol + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=rows[:, None] & dims[None, :])  # fmt: skip
    tl.store(LSE + bh * L + offs_m, m_i + tl.log(safe), mask=rows)


@triton.jit
def _attention_bwd_kernel(
    QC, K, V, P, DO, LSE, DELTA, LO, HI, KOK, QLO, QHI, DQ, DK, DV, DP,
    s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
    s_pb, s_ph, s_pl, s_ob, s_oh, s_ol, s_gb, s_gh, s_gl, s_mb, s_kokb,
    H, L, KLEN, DH, scale, NKB,
    HAS_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """Gradients, flash-attention-2 style: the probabilities recomputed from LSE.

    Grid (NKB + cdiv(L, BM), B * H). Programs pid < NKB own a block of BN keys and sum
    dK, dV over the query blocks that can see it; the others own a block of BM queries and
    sum dQ over its key blocks, storing dS into dP (zero-filled by the caller) on the way.
    Each program writes only its own rows: no atomics. DO and DQ have O's strides (s_o*),
    DK and DV the strides s_g*; DELTA [B, H, L] is rowsum(dO * O)."""
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_d = tl.arange(0, BD)
    dims = offs_d < DH
    q_base = b * s_qb + h * s_qh
    o_base = b * s_ob + h * s_oh
    if pid < NKB:  # -- dK, dV of one key block --------------------------------------------
        offs_n = pid * BN + tl.arange(0, BN)
        k, v, kok, keys, kv_mask = _key_block(K, V, KOK, b * s_kb + h * s_kh, b * s_vb + h * s_vh,
                                              b * s_kokb, offs_n, offs_d, dims, s_kl, s_vl,
                                              KLEN)  # fmt: skip
        qlo = tl.load(QLO + b * s_kokb + offs_n, mask=keys & (kok != 0), other=L)
        qhi = tl.load(QHI + b * s_kokb + offs_n, mask=keys & (kok != 0), other=-1)
        dk = tl.zeros([BN, BD], ACC)
        dv = tl.zeros([BN, BD], ACC)
        for m0 in range((tl.min(qlo, 0) // BM) * BM, tl.max(qhi, 0) + 1, BM):
            offs_m = m0 + tl.arange(0, BM)
            rows = offs_m < L
            q_mask = rows[:, None] & dims[None, :]
            q = tl.load(QC + q_base + offs_m[:, None] * s_ql + offs_d[None, :], mask=q_mask,
                        other=0.0)  # fmt: skip
            do = tl.load(DO + o_base + offs_m[:, None] * s_ol + offs_d[None, :], mask=q_mask,
                         other=0.0)  # fmt: skip
            lo = tl.load(LO + b * s_mb + offs_m, mask=rows, other=KLEN)
            hi = tl.load(HI + b * s_mb + offs_m, mask=rows, other=-1)
            lse = tl.load(LSE + bh * L + offs_m, mask=rows, other=0.0)
            delta = tl.load(DELTA + bh * L + offs_m, mask=rows, other=0.0)
            p_row = b * s_pb + h * s_ph + offs_m[:, None] * s_pl
            s, visible = _scores(q, k, offs_m, offs_n, lo, hi, kok, P, p_row, L, scale, HAS_P)
            p = tl.where(visible, tl.exp(s.to(ACC) - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee").to(ACC)
            dpr = tl.dot(do, tl.trans(v), input_precision="ieee").to(ACC)  # dO . v
            ds = p * (dpr - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee").to(ACC)
        g_off = b * s_gb + h * s_gh + offs_n[:, None] * s_gl + offs_d[None, :]
        tl.store(DK + g_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=kv_mask)
    else:  # -- dQ and dS of one query block -----------------------------------------------
        offs_m = (pid - NKB) * BM + tl.arange(0, BM)
        rows = offs_m < L
        q_mask = rows[:, None] & dims[None, :]
        q = tl.load(QC + q_base + offs_m[:, None] * s_ql + offs_d[None, :], mask=q_mask,
                    other=0.0)  # fmt: skip
        o_off = o_base + offs_m[:, None] * s_ol + offs_d[None, :]
        do = tl.load(DO + o_off, mask=q_mask, other=0.0)
        lo = tl.load(LO + b * s_mb + offs_m, mask=rows, other=KLEN)
        hi = tl.load(HI + b * s_mb + offs_m, mask=rows, other=-1)
        lse = tl.load(LSE + bh * L + offs_m, mask=rows, other=0.0)
        delta = tl.load(DELTA + bh * L + offs_m, mask=rows, other=0.0)
        p_row = b * s_pb + h * s_ph + offs_m[:, None] * s_pl
        dq = tl.zeros([BM, BD], ACC)
        for n0 in range((tl.min(lo, 0) // BN) * BN, tl.max(hi, 0) + 1, BN):
            offs_n = n0 + tl.arange(0, BN)
            k, v, kok, _, _ = _key_block(K, V, KOK, b * s_kb + h * s_kh, b * s_vb + h * s_vh,
                                         b * s_kokb, offs_n, offs_d, dims, s_kl, s_vl,
                                         KLEN)  # fmt: skip
            s, visible = _scores(q, k, offs_m, offs_n, lo, hi, kok, P, p_row, L, scale, HAS_P)
            p = tl.where(visible, tl.exp(s.to(ACC) - lse[:, None]), 0.0)
            dpr = tl.dot(do, tl.trans(v), input_precision="ieee").to(ACC)
            ds = p * (dpr - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee").to(ACC)
            if HAS_P:  # dS is dP at the shift's index; each (i, column) is one (i, j)
                col = (L - 1) - offs_m[:, None] + offs_n[None, :]
                tl.store(DP + p_row + col, ds.to(DP.dtype.element_ty), mask=visible)
        tl.store(DQ + o_off, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


# -- launch ------------------------------------------------------------------------------
# (BM, BN) query and key block sizes, powers of two >= 16 (tl.dot's least); the tests set
# smaller ones than L and K so that the blocks' edges are crossed
BLOCK = (64, 64)


def _head_strides(t: Tensor) -> tuple[int, int, int]:
    """Strides of [B, H, T, Dh] over (B, H, T); the kernels need the last axis contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def _batch_strides(lo: Tensor, kok: Tensor) -> tuple[int, int]:
    """Batch strides of the bounds: 0 for a mask shared by every row."""
    shared = lo.size(0) == 1
    return (0 if shared else lo.stride(0)), (0 if shared else kok.stride(0))


def _contig_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _like_heads(t: Tensor) -> Tensor:
    """An empty [B, H, T, Dh] laid out [B, T, H, Dh]: the layout the layer's projections
    read (attention.RelativeAttention.forward flattens heads next), so no copy follows."""
    b, h, n, d = t.shape
    return t.new_empty(b, n, h, d).transpose(1, 2)


def _forward(
    qc: Tensor, k: Tensor, v: Tensor, p: Tensor | None, lo: Tensor, hi: Tensor, kok: Tensor,
    scale: float, bm: int, bn: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """O [B, H, L, Dh] and LSE [B, H, L] (float32, float64 for float64 inputs)."""
    batch, heads, qlen, d_head = qc.shape
    klen = k.size(2)
    o = _like_heads(qc)
    lse = qc.new_empty(batch, heads, qlen, dtype=torch.promote_types(qc.dtype, torch.float32))
    pp = p if p is not None else qc  # a placeholder pointer, never read
    grid = (triton.cdiv(qlen, bm), batch * heads)
    _attention_fwd_kernel[grid](
        qc, k, v, pp, lo, hi, kok, o, lse,
        *_head_strides(qc), *_head_strides(k), *_head_strides(v), *_head_strides(pp),
        *_head_strides(o), *_batch_strides(lo, kok),
        heads, qlen, klen, d_head, scale,
        HAS_P=p is not None, BM=bm, BN=bn, BD=max(16, triton.next_power_of_2(d_head)),
        ACC=_acc(qc.dtype),
    )  # fmt: skip
    return o, lse


def _backward(
    do: Tensor, qc: Tensor, k: Tensor, v: Tensor, p: Tensor | None, o: Tensor, lse: Tensor,
    bounds: tuple[Tensor, ...], scale: float, bm: int, bn: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """dqc, dk, dv (laid out as _like_heads) and dP [B, H, L, W] (None without P)."""
    lo, hi, kok, qlo, qhi = bounds
    batch, heads, qlen, d_head = qc.shape
    klen = k.size(2)
    # dO in O's layout and dtype so the two share strides and tl.dot's operands one dtype;
    # delta in float32 (float64) like LSE
    if do.stride() != o.stride() or do.dtype != o.dtype:
        do = _like_heads(o).copy_(do)
    delta = (do.to(lse.dtype) * o.to(lse.dtype)).sum(-1).contiguous()  # [B, H, L]
    dq, dk, dv = _like_heads(qc), _like_heads(k), _like_heads(v)  # dq: o's strides
    # distance columns no visible pair maps to get no store: their gradient is 0
    dp = torch.zeros_like(p) if p is not None else None
    pp = p if p is not None else qc
    nkb = triton.cdiv(klen, bn)
    grid = (nkb + triton.cdiv(qlen, bm), batch * heads)
    _attention_bwd_kernel[grid](
        qc, k, v, pp, do, lse, delta, lo, hi, kok, qlo, qhi, dq, dk, dv,
        dp if dp is not None else pp,
        *_head_strides(qc), *_head_strides(k), *_head_strides(v), *_head_strides(pp),
        *_head_strides(o), *_head_strides(dk), *_batch_strides(lo, kok),
        heads, qlen, klen, d_head, scale, nkb,
        HAS_P=p is not None, BM=bm, BN=bn, BD=max(16, triton.next_power_of_2(d_head)),
        ACC=_acc(qc.dtype),
    )  # fmt: skip
    return dq, dk, dv, dp


class _RelAttention(torch.autograd.Function):
    """softmax(scale qc k^T + shift(P)) v with the kernels above; gradients for qc, k, v, P."""

    @staticmethod
    def forward(ctx, qc, k, v, p, bounds, scale, bm, bn):  # type: ignore[override]
        qc, k, v = _contig_last(qc), _contig_last(k), _contig_last(v)
        p = None if p is None else _contig_last(p)
        o, lse = _forward(qc, k, v, p, *bounds[:3], scale, bm, bn)
        ctx.save_for_backward(qc, k, v, p, o, lse, *bounds)
        ctx.scale, ctx.bm, ctx.bn = scale, bm, bn
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        qc, k, v, p, o, lse, *bounds = ctx.saved_tensors
        dq, dk, dv, dp = _backward(do, qc, k, v, p, o, lse, bounds, ctx.scale, ctx.bm, ctx.bn)
        return dq, dk, dv, dp, None, None, None, None


def _bounds(mask: Tensor | None, qlen: int, klen: int, device: torch.device) -> tuple[Tensor, ...]:
    """Compact visibility of a bool mask [L, K] or [B, 1, L, K] (see the module docstring):
    lo, hi [B', L] the first and last key each query sees, kok [B', K] whether any query
    sees a key, qlo, qhi [B', K] the first and last query that sees it (B' = 1 when the
    mask is shared). Only 1-byte passes over the mask; int32 results."""
    if mask is None:
        mask = torch.ones(qlen, klen, dtype=torch.bool, device=device)
    m = mask.reshape(-1, qlen, klen).view(torch.uint8)  # [B', L, K], a view of the bools
    # argmax returns the first maximum: the first True. A row of no True gets an empty
    # range (hi = -1); a key of no True gets kok = 0, which the kernels' key loops read
    lo = m.argmax(-1)
    hi = torch.where(m.amax(-1) > 0, (klen - 1) - m.flip(-1).argmax(-1), -1)
    kok = m.amax(-2)
    qlo = m.argmax(-2)
    qhi = (qlen - 1) - m.flip(-2).argmax(-2)
    return tuple(t.to(torch.int32).contiguous() for t in (lo, hi, kok, qlo, qhi))


def check_device(device: torch.device) -> None:
    """Refuse a CPU run whose kernels were not decorated for the interpreter."""
    if device.type == "cpu" and not INTERPRETED:
        raise ConfigError(
            "attn_impl triton on the CPU needs TRITON_INTERPRET=1 set before txlm starts"
        )


def relative_attention(
    qc: Tensor,
    qp: Tensor | None,
    k: Tensor,
    v: Tensor,
    rk: Tensor | None,
    mask: Tensor | None,
    scale: float,
) -> Tensor:
    """Attention output [B, H, L, Dh] (laid out [B, L, H, Dh]) of the math path's scores.

    qc = q + u, qp = q + v [B, H, L, Dh]; k, v [B, H, K, Dh]; rk [H, W, Dh] position keys
    per distance (W >= K + 1; None: no position term); mask bool [L, K] or [B, 1, L, K]
    (True: may attend), built by txlm.model.mask.attention_mask (the bounds rely on its
    structure)."""
    check_device(qc.device)
    dtype = k.dtype
    qlen, klen = qc.size(2), k.size(2)
    p = None
    if rk is not None and qp is not None:
        # the per-distance scores, scaled through the queries (K/Dh times smaller)
        p = (qp.to(dtype) * scale) @ rk.to(dtype).transpose(-1, -2)  # [B, H, L, W]
    bounds = _bounds(mask, qlen, klen, qc.device)
    return _RelAttention.apply(qc.to(dtype), k, v, p, bounds, scale, *BLOCK)
