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
(``KVCache.unmasked``), and one full-precision dtype for weights and cache; every other step
goes through the modules. Tested equal to them (tests/test_generate_cache.py, every
configuration there, across ring wrap-arounds).

The arithmetic is ``RelativeAttention`` for L = 1: content (a)+(c) as (q + u) . k, position
(b)+(d) as (q + v) . r with r the cache's slot-ordered, pre-scaled position keys, the scale
as baddbmm's alpha, softmax, values, output projection, residual and LayerNorm (post- or
pre-LN), then the feed-forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

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
        emb = model.embed
        plain = emb.div_val == 1 and not len(emb.projs)
        self.embed_weight = emb.layers[0].weight.detach() if plain else None
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
                    fc1_b=ff.fc1.bias.detach(),
                    fc2_t=ff.fc2.weight.detach().t(),
                    fc2_b=ff.fc2.bias.detach(),
                    norm1=(attn.norm.weight.detach(), attn.norm.bias.detach(), attn.norm.eps),
                    norm2=(ff.norm.weight.detach(), ff.norm.bias.detach(), ff.norm.eps),
                    u=None if u is None else u.detach(),
                    v=None if v is None else v.detach()[:, None],
                    scale=attn.scale,
                )
            )

    @staticmethod
    def applies(model: TransformerXL, cache: KVCache) -> bool:
        """Relative encodings, inference, an eager cache, weights and cache in one full
        precision dtype (half precision attention is normalised in float32 by the modules,
        not here)."""
        weight = model.layers[0].attn.qkv.weight
        return (
            model.config.attn_type in ("xl", "shaw") and not model.training
            and not cache.static and weight.dtype == cache.kv.dtype
            and weight.dtype in (torch.float32, torch.float64)
            and not torch.is_autocast_enabled(weight.device.type)
        )  # fmt: skip

    def __call__(self, ids: Tensor, cache: KVCache) -> Tensor:
        model = self.model
        batch, n_head, d_head = ids.size(0), self.n_head, self.d_head
        bh = batch * n_head
        if self.embed_weight is not None:  # the module's arithmetic without its call overhead
            h = torch.embedding(self.embed_weight, ids) * model.embed.scale  # [B, D]
        else:  # adaptive input embeddings
            h = model.embed(ids[:, None]).view(batch, -1)
        step = cache.advance(1, None, same_length=False)
        assert step.index is None, "OneTokenStep needs an unmasked step (KVCache.unmasked)"
        cache.ensure_tables(model.position_table)
        width, ring, slots = step.width, step.ring, step.slots
        dim = (h.size(-1),)
        for n, w in enumerate(self.layers):
            x = torch.layer_norm(h, dim, *w.norm1) if self.pre_lnorm else h
            qkv = torch.mm(x, w.qkv_t).view(batch, 3, n_head, d_head)
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
            attn = torch.bmm(torch.softmax(scores, dim=-1), values).view(batch, -1)
            out = torch.mm(attn, w.out_t)
            if self.pre_lnorm:
                h = h + out
                x = torch.layer_norm(h, dim, *w.norm2)
            else:
                h = x = torch.layer_norm(h + out, dim, *w.norm1)
            f = torch.addmm(w.fc2_b, torch.addmm(w.fc1_b, x, w.fc1_t).relu_(), w.fc2_t)
            h = h + f if self.pre_lnorm else torch.layer_norm(h + f, dim, *w.norm2)
        return h
