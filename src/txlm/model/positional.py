"""Positional encodings.

Dimension legend: K key length (memory + current), D model dim, H heads, Dh head dim.

Relative distances follow the original code's layout: a segment whose keys span K positions
needs the distances K-1, K-2, ..., 0 (the farthest memory key first). We add one more, the
distance -1, so that the relative shift in attention.py can be a strided view with no
overlapping elements (see ``rel_shift``); that column only ever lands on masked entries.
"""

from __future__ import annotations

import torch
from torch import Tensor


def inverse_frequencies(d_model: int, device: torch.device | None = None) -> Tensor:
    """1 / 10000^(2k/D) for k = 0 .. D/2 - 1 (Vaswani et al. 2017, Sec. 3.5)."""
    return 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0, device=device) / d_model))


def sinusoid(positions: Tensor, d_model: int) -> Tensor:
    """[P] float positions -> [P, D] encodings, sines then cosines (not interleaved).

    The concatenated layout is the paper's code's, so converted weights see the same R.
    """
    angles = torch.outer(positions.float(), inverse_frequencies(d_model, positions.device))
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def relative_distances(klen: int, clamp_len: int, device: torch.device | None = None) -> Tensor:
    """Distances K-1, ..., 0, -1 ([K+1] float), clamped to ``clamp_len`` when it is > 0.

    Clamping (Sec. 4.1's evaluation lengths) lets a model trained on short attention spans
    attend farther at evaluation: every distance beyond clamp_len reuses its encoding.
    """
    dist = torch.arange(klen - 1, -2, -1, device=device, dtype=torch.float32)
    if clamp_len > 0:
        dist = dist.clamp(max=clamp_len)
    return dist
