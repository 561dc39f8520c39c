"""The CPU one-token decoding step: the layers of ``TransformerXL.transform`` for a single
query per row, over the same ``KVCache`` (an eager one, see txlm.model.cache).

Dimension legend
    B  rows     H  heads     Dh head dim     D  model dim     W  slots the query sees

Why it exists beside the one path. At batch 1 a step of a small model is a few MFLOP: on a
CPU its time goes to per-call overhead and to streaming the weights. Through the modules a
step makes ~40 tensor calls per layer (views, splits, head reshapes written for [B, L]
segments, module calls); this makes ~25, on weights laid out for one-row products. Measured
side by side (``benchmarks/compare_revisions.py``, results in
benchmarks/results/compare_revisions.json): decoding through the modules alone runs at ~0.7x
the speed of the code before the one path, with this step at ~1.0x. It runs only where it is
the same computation: a relative encoding ("xl", "shaw"), an unmasked step
(``KVCache.unmasked``; with same_length the step itself leaves out the one slot of a full
ring that the query may not see), and one full-precision dtype for weights and cache, or a
half-precision copy of the weights over a float32 cache (a CPU decoder under autocast, see
txlm.generate.CachedDecoder); every other step goes through the modules. Tested equal to
them (tests/test_generate_cache.py, every configuration there, across ring wrap-arounds).

The arithmetic is ``RelativeAttention`` for L = 1: content (a)+(c) as (q + u) . k, position
(b)+(d) as (q + v) . r with r the cache's slot-ordered, pre-scaled position keys, the scale
as baddbmm's alpha, softmax, values, output projection, residual and LayerNorm (post- or
pre-LN), then the feed-forward.

Half-precision weights over a float32 cache: the four weight products run in the weights'
dtype (as autocast runs them), everything else (attention, residual, LayerNorm) in float32
with autocast off (half-precision matrix-vector products are slower on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from txlm.model.attention import _as
from txlm.model.cache import KVCache
from txlm.model.transformer import TransformerXL


@dataclass
class _Layer:
    """One layer's tensors for a one-row step: weights as [in, out] views, so a step calls
    ``mm`` / ``addmm`` on them directly; LayerNorm as (weight, bias, eps)."""

    qkv_t: Tensor  # [D, 3 H Dh]: queries, keys, values
    out_t: Tensor  # [H Dh, D]
    fc1_t: Tensor  # [D, d_inner]
    fc1_b: Tensor
    fc2_t: Tensor  # [d_inner, D]
    fc2_b: Tensor
    norm1: tuple  # attention LayerNorm
    norm2: tuple  # feed-forward LayerNorm
    u: Tensor | None  # [H, Dh] content bias ("xl")
    v: Tensor | None  # [H, 1, Dh] position bias ("xl"), shaped for queries [H, B, Dh]
    scale: float


class OneTokenStep:
    """``step(ids [B], cache) -> hidden [B, D]`` of the last layer, for an unmasked step of an
    eager cache. ``applies(model, cache)`` says whether it is the model's computation."""

    def __init__(self, model: TransformerXL) -> None:
        c = model.config
        self.model, self.pre_lnorm = model, c.pre_lnorm
        self.n_head, self.d_head = c.n_head, model.layers[0].attn.d_head
        self.same_length, self.mem_len = c.same_length, c.mem_len
        half = model.layers[0].attn.qkv.weight.dtype in (torch.float16, torch.bfloat16)
        act = torch.float32 if half else model.layers[0].attn.qkv.weight.dtype

        def vec(t: Tensor) -> Tensor:  # vectors outside the weight products: activation dtype
            return t.detach().to(act)

        emb = model.embed
        plain = emb.div_val == 1 and not len(emb.projs)
        self.embed_weight = vec(emb.layers[0].weight) if plain else None
        self.layers = []
        for layer in model.layers:
            attn, ff = layer.attn, layer.ff
            u = v = None
            if c.attn_type == "xl":  # per-layer biases (untie_r) or the model's shared ones
                u = attn.u if attn.untie_r else model.u
                v = attn.v if attn.untie_r else model.v
            self.layers.append(
                _Layer(
                    qkv_t=attn.qkv.weight.detach().t(),
                    out_t=attn.out.weight.detach().t(),
                    fc1_t=ff.fc1.weight.detach().t(),
                    fc1_b=ff.fc1.bias.detach(),  # biases are added inside the products
                    fc2_t=ff.fc2.weight.detach().t(),
                    fc2_b=ff.fc2.bias.detach(),
                    norm1=(vec(attn.norm.weight), vec(attn.norm.bias), attn.norm.eps),
                    norm2=(vec(ff.norm.weight), vec(ff.norm.bias), ff.norm.eps),
                    u=None if u is None else vec(u),
                    v=None if v is None else vec(v)[:, None],
                    scale=attn.scale,
                )
            )

    @staticmethod
    def applies(model: TransformerXL, cache: KVCache) -> bool:
        """Relative encodings, inference, an eager cache, weights and cache in one full
        precision dtype (not under autocast), or half-precision weights over a float32 CPU
        cache (a decoder's copy under autocast; half-precision attention is normalised in
        float32 by the modules, not here)."""
        weight = model.layers[0].attn.qkv.weight
        device = weight.device.type
        full = (
            weight.dtype == cache.kv.dtype and weight.dtype in (torch.float32, torch.float64)
            and not torch.is_autocast_enabled(device)
        )  # fmt: skip
        half = (
            weight.dtype in (torch.float16, torch.bfloat16) and device == "cpu"
            and cache.kv.dtype == torch.float32
        )  # fmt: skip
        return (
            model.config.attn_type in ("xl", "shaw") and not model.training
            and not cache.static and (full or half)
        )  # fmt: skip

    def __call__(self, ids: Tensor, cache: KVCache) -> Tensor:
        with torch.autocast(self.model.layers[0].attn.qkv.weight.device.type, enabled=False):
            return self._step(ids, cache)

    def _step(self, ids: Tensor, cache: KVCache) -> Tensor:
        model = self.model
        batch, n_head, d_head = ids.size(0), self.n_head, self.d_head
        bh = batch * n_head
        if self.embed_weight is not None:  # the module's arithmetic without its call overhead
            h = torch.embedding(self.embed_weight, ids) * model.embed.scale  # [B, D]
        else:  # adaptive input embeddings
            h = _as(model.embed(ids[:, None]).view(batch, -1), cache.kv.dtype)
        # same_length: the query sees the M newest positions, itself included; in a full ring
        # of M + 1 slots (the only full ring of an unmasked step) the oldest is left out
        t = cache.written
        hidden = (
            (t - self.mem_len) % cache.slots if self.same_length and t >= self.mem_len else None
        )
        step = cache.advance(1, None, same_length=False)
        assert step.index is None, "OneTokenStep needs an unmasked step (KVCache.unmasked)"
        cache.ensure_tables(model.position_table)
        width, ring, slots = step.width, step.ring, step.slots
        dim, act, wdt = (h.size(-1),), h.dtype, self.layers[0].qkv_t.dtype
        for n, w in enumerate(self.layers):
            x = torch.layer_norm(h, dim, *w.norm1) if self.pre_lnorm else h
            qkv = _as(torch.mm(_as(x, wdt), w.qkv_t), act).view(batch, 3, n_head, d_head)
            buffer = cache.kv[n]  # [2, B, H, S, Dh]
            buffer.index_copy_(3, slots, qkv[:, 1:].transpose(0, 1).unsqueeze(3))
            keys = buffer[0].narrow(2, 0, width).reshape(bh, width, d_head)  # views
            values = buffer[1].narrow(2, 0, width).reshape(bh, width, d_head)
            q = qkv[:, 0]  # [B, H, Dh]
            qc = (q if w.u is None else q + w.u).reshape(bh, 1, d_head)
            rk = cache.ring_tables[n].narrow(1, ring, width)  # [H, W, Dh], scaled
            qp = q.transpose(0, 1)  # [H, B, Dh]
            if w.v is not None:
                qp = qp + w.v
            pos = torch.bmm(qp, rk.transpose(1, 2)).transpose(0, 1).reshape(bh, 1, width)
            scores = pos.baddbmm_(qc, keys.transpose(1, 2), alpha=w.scale)  # [B H, 1, W]
            if hidden is not None:
                scores.select(2, hidden).fill_(float("-inf"))
            attn = torch.bmm(torch.softmax(scores, dim=-1), values).view(batch, -1)
            out = _as(torch.mm(_as(attn, wdt), w.out_t), act)
            if self.pre_lnorm:
                h = h + out
                x = torch.layer_norm(h, dim, *w.norm2)
            else:
                h = x = torch.layer_norm(h + out, dim, *w.norm1)
            f = torch.addmm(w.fc1_b, _as(x, wdt), w.fc1_t).relu_()
            f = _as(torch.addmm(w.fc2_b, f, w.fc2_t), act)
            h = h + f if self.pre_lnorm else torch.layer_norm(h + f, dim, *w.norm2)
        return h
