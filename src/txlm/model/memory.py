"""Segment-level recurrence: the per-layer memory (paper Sec. 3.2).

Legend: B batch, M memory length, L segment length, D model dim.

``mems[n]`` holds layer n's *input* hidden states for the newest ``mem_len`` positions of the
row's stream. Memory is context, not a trainable past: it is detached (stop-gradient, SG in
Eq. 1), so the backward graph of a segment never reaches earlier segments.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def update_memory(mems: list[Tensor] | None, hiddens: list[Tensor], mem_len: int) -> list[Tensor]:
    """M_{tau+1}^n = Tail_M([SG(M_tau^n); H_tau^n]) for every layer n."""
    new = []
    for n, h in enumerate(hiddens):
        old = None if mems is None else mems[n]
        cat = h if old is None or old.size(1) == 0 else torch.cat([old.to(h.dtype), h], dim=1)
        keep = min(mem_len, cat.size(1))
        # contiguous: the same strides whether or not there was memory before (a compiled
        # model guards on strides: a view of the concatenation would compile a third graph),
        # and the concatenation is not kept alive by its tail
        new.append(cat[:, cat.size(1) - keep :].detach().contiguous())
    return new
