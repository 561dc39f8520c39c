"""Attention visualisation of the paper's Appendix D (Figures 5, 6 and 7).

Legend: B batch (1 here), H heads, L segment (query) length, M memory length, K = M + L keys,
Dist relative distances 0 .. Dmax-1 (0 = the query's own position), N layers.

The text is evaluated like the paper's evaluation: segments of L tokens with a memory of M
hidden states per layer (``same_length`` on, so once the memory is full every query attends
to exactly M keys). From each layer's attention probabilities [B, H, L, K] we take, for query
i (key index M + i) and key j, the distance d = M + i - j and accumulate the probability at d.

- Figure 5: ``mean[n, h, d]``, the attention at distance d averaged over all queries. Each
  query's distribution sums to 1 over its keys, so every row of the average sums to 1 too.
- widest heads: ranked by the mean attended distance sum_d d * mean[n, h, d].
- Figure 6: one head's probabilities for one segment [L, K] and one query's row.
- Figure 7: the paper's terms (a) q.k, (b) q.W_kR R and (d) v.W_kR R, each put through its own
  softmax over the same visible keys, then averaged the same way (the "xl" encoding only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txlm.errors import ConfigError
from txlm.inference.evaluate import stream_segments
from txlm.model import TransformerXL
from txlm.model.attention import rel_shift
from txlm.model.lengths import Lengths


def by_distance(probs: Tensor, n_dist: int) -> Tensor:
    """[B, H, L, K] per-pair probabilities -> [B, H, L, n_dist] per-distance probabilities.

    Query i sits at key index M + i (M = K - L); distance d reads key M + i - d. Distances
    with no key (before the start of the memory) or beyond the keys hold 0.
    """
    *_, qlen, klen = probs.shape
    mlen = klen - qlen
    i = torch.arange(qlen, device=probs.device)[:, None]
    d = torch.arange(n_dist, device=probs.device)[None, :]
    key = mlen + i - d  # [L, Dist]
    valid = key >= 0
    index = key.clamp(min=0).expand(*probs.shape[:-1], n_dist)
    return probs.gather(-1, index) * valid


@dataclass
class SegmentView:
    """One head's attention over one segment (Figure 6)."""

    layer: int
    head: int
    segment_start: int  # stream index of the segment's first query
    probs: Tensor  # [L, K]
    query: int  # which row the single-position plot shows
    mem_len: int

    @property
    def position(self) -> int:
        """The stream position of the query shown."""
        return self.segment_start + self.query

    def by_distance(self) -> Tensor:
        """[D] the query's attention weight at each relative distance 0..D-1 (D: the keys it
        may see). Key j of the segment's K = M + L lies M + query - j back."""
        row = self.probs[self.query, : self.mem_len + self.query + 1]  # the visible keys
        return row.flip(0)

    def top_distances(self, k: int = 5) -> list[tuple[int, float]]:
        """The ``k`` most attended distances and their weights, heaviest first."""
        weights = self.by_distance()
        top = weights.topk(min(k, weights.numel()))
        return [(int(d), float(w)) for w, d in zip(top.values, top.indices, strict=True)]


@dataclass
class AttentionMaps:
    mean: Tensor  # [N, H, Dmax]: Figure 5
    terms: dict[str, Tensor] = field(default_factory=dict)  # "a", "b", "d" -> [N, H, Dmax]
    queries: int = 0  # queries averaged
    tgt_len: int = 0
    mem_len: int = 0
    segment: SegmentView | None = None

    def head_spans(self) -> Tensor:
        """[N, H] mean attended distance of each head."""
        d = torch.arange(self.mean.size(-1), dtype=self.mean.dtype)
        return (self.mean * d).sum(-1)

    def widest_heads(self, k: int = 3) -> list[tuple[int, int, float]]:
        """The k heads with the largest mean attended distance: (layer, head, distance)."""
        spans = self.head_spans()
        flat = spans.flatten()
        top = flat.topk(min(k, flat.numel())).indices.tolist()
        n_head = spans.size(1)
        return [(t // n_head, t % n_head, float(flat[t])) for t in top]


class _TermCapture:
    """Forward pre-hooks that recompute terms (a), (b), (d) of each layer's scores.

    The hook sees the layer's inputs, its attention's (h, mem, mask, pos, u, v), projects q, k and
    the position keys with the module's own weights, and keeps per-distance sums.
    """

    def __init__(self, model: TransformerXL, n_dist: int) -> None:
        self.model, self.n_dist = model, n_dist
        self.sums: dict[str, list[Tensor | None]] = {
            t: [None] * model.config.n_layer for t in "abd"
        }
        self.handles = [  # on the layer: it calls its attention's forward directly
            layer.register_forward_pre_hook(self._hook(n)) for n, layer in enumerate(model.layers)
        ]

    def _hook(self, n: int):
        def hook(layer: nn.Module, args):
            h, mem, mask, pos, u, v = args[:6]
            self._add(n, layer.attn, h, mem, mask, pos, u, v)

        return hook

    @torch.no_grad()
    def _add(self, n, attn, h, mem, mask, pos, u, v) -> None:
        inner = attn.n_head * attn.d_head
        x_cur = attn.norm(h) if attn.pre_lnorm else h
        q = attn._heads(F.linear(x_cur, attn.qkv.weight[:inner]))  # [B, H, L, Dh]
        x_all = x_cur
        if mem is not None and mem.size(1) > 0:
            x_all = torch.cat([attn.norm(mem) if attn.pre_lnorm else mem, x_cur], dim=1)
        k, _ = attn.project_kv(x_all)  # [B, H, K, Dh]
        rk = attn.position_keys(pos)  # [H, K+1, Dh]
        v = attn.v if hasattr(attn, "v") else v
        terms = {
            "a": q @ k.transpose(-1, -2),
            "b": rel_shift(q @ rk.transpose(-1, -2)),
            # (d) does not depend on the query: one row [H, K+1] shifted per query.
            "d": rel_shift(
                (v.reshape(v.size(0), 1, -1) @ rk.transpose(-1, -2)).expand(*q.shape[:-1], -1)
            ),
        }
        for name, score in terms.items():
            p = torch.softmax((score * attn.scale).masked_fill(~mask, float("-inf")), dim=-1)
            s = by_distance(p, self.n_dist).sum(dim=(0, 2))  # [H, Dist]
            prev = self.sums[name][n]
            self.sums[name][n] = s if prev is None else prev + s

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def attention_maps(
    model: TransformerXL,
    tokens: Sequence[int] | Tensor,
    *,
    tgt_len: int,
    mem_len: int,
    terms: bool = True,
    head: tuple[int, int] | None = None,
    position: int | None = None,
    full_memory_only: bool = True,
) -> AttentionMaps:
    """Average attention per head over relative distance, and optionally terms (a), (b), (d).

    tokens: the text as ids [T]. Segments of ``tgt_len`` with a memory of ``mem_len``.
    full_memory_only: average only segments whose memory is already full (as the paper's
        "average attention over the previous 640 tokens"), when the text has such segments.
    head, position: the (layer, head) and stream position for Figure 6; by default the widest
        head and the last query of the last segment averaged.
    """
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
    if ids.numel() < 2:
        raise ConfigError("the text must have at least 2 tokens")
    if tgt_len < 1 or mem_len < 0:
        raise ConfigError("tgt_len must be positive and mem_len non-negative")
    c = model.config
    if head is not None and not (0 <= head[0] < c.n_layer and 0 <= head[1] < c.n_head):
        raise ConfigError(
            f"no head {head[0]}:{head[1]} in a model of {c.n_layer} layers x {c.n_head} heads"
        )
    if position is not None and not 0 <= position < ids.numel():
        raise ConfigError(f"position {position} is outside the text's {ids.numel()} tokens")
    n_dist = mem_len + tgt_len
    with_terms = terms and c.attn_type == "xl"
    capture = _TermCapture(model, n_dist) if with_terms else None
    n_segments = -(-ids.numel() // tgt_len)
    first_full = -(-mem_len // tgt_len)  # segments before the memory holds mem_len states
    use_from = first_full if full_memory_only and first_full < n_segments else 0

    total = torch.zeros(c.n_layer, c.n_head, n_dist)
    term_totals = {t: torch.zeros(c.n_layer, c.n_head, n_dist) for t in "abd"}
    queries = 0
    seg_probs: list[tuple[int, Tensor]] = []  # (segment start, [N, H, L, K]) of the view
    extras: list[dict] = []

    lengths = Lengths.of(c, tgt_len=tgt_len, mem_len=mem_len, same_length=mem_len > 0)
    mems: list[Tensor] | None = None

    def step(ids, labels):
        """The model's layers, keeping each layer's attention probabilities (and the memory)."""
        nonlocal mems
        extras.clear()
        if capture is not None:  # only count the segments we average
            for t in "abd":
                capture.sums[t] = [None] * c.n_layer
        _, mems, _ = model.transform(
            ids, mems, lengths=lengths, attn_kwargs={"return_probs": True}, extras=extras
        )
        return SimpleNamespace(mems=mems, mem_mask=None)

    try:
        segments = stream_segments(model, ids, predict=False, step=step, lengths=lengths)
        for seg in segments:
            s, start, width = seg.index, seg.start, seg.input_ids.size(1)
            probs = torch.stack([e["probs"][0] for e in extras]).float().cpu()  # [N, H, L, K]
            want_view = position is not None and start <= position < start + width
            if s < use_from and not want_view:
                continue
            if s >= use_from:
                total += by_distance(probs, n_dist).sum(dim=2)
                queries += width
                if capture is not None:
                    for t in "abd":
                        term_totals[t] += torch.stack(capture.sums[t]).float().cpu()
            if want_view or (position is None and s >= use_from):
                seg_probs = [(start, probs)]
    finally:
        if capture is not None:
            capture.close()

    result = AttentionMaps(
        mean=total / max(queries, 1), queries=queries, tgt_len=tgt_len, mem_len=mem_len
    )
    if with_terms:
        result.terms = {t: term_totals[t] / max(queries, 1) for t in "abd"}
    layer, hd = head if head is not None else result.widest_heads(1)[0][:2]
    start, probs = seg_probs[-1]
    query = probs.size(2) - 1 if position is None else position - start
    result.segment = SegmentView(
        layer=layer,
        head=hd,
        segment_start=start,
        probs=probs[layer, hd],
        query=query,
        mem_len=probs.size(-1) - probs.size(2),
    )
    return result


def summary(maps: AttentionMaps, top: int = 5) -> dict:
    """JSON-ready figures: spans per head, the widest heads, and a few distances of each map."""
    spans = maps.head_spans()
    out = {
        "queries": maps.queries,
        "tgt_len": maps.tgt_len,
        "mem_len": maps.mem_len,
        "mean_distance_per_head": [[round(float(x), 3) for x in row] for row in spans],
        "widest_heads": [
            {"layer": n, "head": h, "mean_distance": round(d, 3)}
            for n, h, d in maps.widest_heads(top)
        ],
        "attention_at_distance_0_1_2_last": [
            [[round(float(x), 5) for x in (r[0], r[1], r[2], r[-1])] for r in layer]
            for layer in maps.mean
        ]
        if maps.mean.size(-1) >= 3
        else [],
    }
    for t, m in maps.terms.items():
        d = torch.arange(m.size(-1), dtype=m.dtype)
        out[f"term_{t}_mean_distance"] = round(float((m * d).sum(-1).mean()), 3)
    if maps.segment is not None:
        seg = maps.segment
        weights = seg.by_distance()
        d = torch.arange(weights.numel(), dtype=weights.dtype)
        out["figure6"] = {
            "layer": seg.layer,
            "head": seg.head,
            "segment_start": seg.segment_start,
            "query": seg.query,
            "position": seg.position,
            "mean_distance": round(float((weights * d).sum()), 3),
            "top_distances": [
                {"distance": dist, "weight": round(w, 5)} for dist, w in seg.top_distances(top)
            ],
        }
    return out


def format_table(maps: AttentionMaps, top: int = 5) -> str:
    lines = [
        f"Attention over relative distance (Appendix D): {maps.queries} queries, "
        f"segment {maps.tgt_len}, memory {maps.mem_len}",
        f"{'layer':>5} {'head':>4}  {'mean dist':>9}  {'p(d=0)':>7}  {'p(d=1)':>7}  "
        f"{'p(far half)':>11}",
    ]
    spans = maps.head_spans()
    half = maps.mean.size(-1) // 2
    for n, h, _ in maps.widest_heads(top):
        row = maps.mean[n, h]
        lines.append(
            f"{n:>5} {h:>4}  {float(spans[n, h]):>9.2f}  {float(row[0]):>7.4f}  "
            f"{float(row[1]) if row.numel() > 1 else 0.0:>7.4f}  {float(row[half:].sum()):>11.4f}"
        )
    lines.append(f"(the {min(top, spans.numel())} heads with the widest mean attended distance)")
    for t, m in maps.terms.items():
        d = torch.arange(m.size(-1), dtype=m.dtype)
        lines.append(
            f"term ({t}) alone: mean attended distance {float((m * d).sum(-1).mean()):.2f}"
        )
    if maps.segment is not None:
        seg = maps.segment
        weights = seg.by_distance()
        d = torch.arange(weights.numel(), dtype=weights.dtype)
        tops = ", ".join(f"{dist} ({w:.4f})" for dist, w in seg.top_distances(top))
        lines.append(
            f"head {seg.layer}:{seg.head} at position {seg.position} (Figure 6): mean attended "
            f"distance {float((weights * d).sum()):.2f}; most attended distances (weight): {tops}"
        )
    return "\n".join(lines)


# -- figures ----------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _span(grid: Tensor) -> int:
    """Columns up to the farthest distance any head can reach (same_length leaves a zero tail)."""
    nonzero = (grid.abs().amax(dim=tuple(range(grid.dim() - 1))) > 0).nonzero()
    return int(nonzero.max()) + 1 if nonzero.numel() else grid.size(-1)


def _heatmap(ax, grid: Tensor, title: str, n_head: int) -> None:
    grid = grid[..., : _span(grid)]
    image = ax.imshow(grid.numpy(), aspect="auto", cmap="Blues", interpolation="nearest")
    ax.set_title(title)
    ax.set_xlabel("relative distance")
    ax.set_ylabel(f"head (layer x {n_head} + head)")
    ax.figure.colorbar(image, ax=ax, fraction=0.04)


def plot_heads_by_distance(maps: AttentionMaps, path) -> None:
    """Figure 5: every head (row) against relative distance (column)."""
    plt = _plt()
    n, h, d = maps.mean.shape
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.12 * n * h + 1.5)))
    _heatmap(ax, maps.mean.reshape(n * h, d), "Average attention over relative distance", h)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_head_segment(maps: AttentionMaps, path) -> None:
    """Figure 6: one head's attention of every query of a segment, and of one query."""
    if maps.segment is None:
        return
    plt = _plt()
    view = maps.segment
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), height_ratios=[3, 1])
    image = top.imshow(view.probs.numpy(), aspect="auto", cmap="Blues", interpolation="nearest")
    top.axvline(view.mem_len - 0.5, color="red", lw=0.8)
    top.set_title(f"layer {view.layer} head {view.head}: segment at {view.segment_start}")
    top.set_xlabel("key (memory | current segment)")
    top.set_ylabel("query")
    fig.colorbar(image, ax=top, fraction=0.04)
    bottom.bar(range(view.probs.size(1)), view.probs[view.query].numpy(), width=1.0)
    bottom.set_xlabel(
        f"key, for query {view.query} (stream position {view.segment_start + view.query})"
    )
    bottom.set_ylabel("attention")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_terms(maps: AttentionMaps, path) -> None:
    """Figure 7: softmax of terms (a), (b) and (d) separately, heads against distance."""
    if not maps.terms:
        return
    plt = _plt()
    n, h, d = maps.mean.shape
    fig, axes = plt.subplots(1, 3, figsize=(15, max(2.5, 0.12 * n * h + 1.5)))
    for ax, t in zip(axes, "abd", strict=True):
        _heatmap(ax, maps.terms[t].reshape(n * h, d), f"term ({t})", h)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
