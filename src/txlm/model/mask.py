"""Who may attend to whom: the rectangular Transformer-XL mask and document boundaries.

Legend: B batch, L segment (query) length, M memory length, K = M + L keys.
Key j < M is a memory position, key M + t is current token t; query i sits at key index M + i.

Three rules combine (ARCHITECTURE.md contracts C2 and C7):
- causal and rectangular: query i sees every memory key and current keys up to itself;
- same_length (optional): query i sees only the mem_len most recent keys ending at itself;
- documents: a token that starts a new document, and every later token of its row, sees
  neither memory nor earlier tokens of the segment. Memory that holds an earlier document
  stays hidden in later segments too (``mem_valid``). Masking, not zeroing: a zero vector
  still takes attention weight.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(
    qlen: int, mlen: int, *, mem_len: int, same_length: bool, device: torch.device | None = None
) -> Tensor:
    """Bool [L, K]: True where query i may attend key j."""
    q = torch.arange(qlen, device=device)[:, None] + mlen
    j = torch.arange(qlen + mlen, device=device)[None, :]
    mask = j <= q
    if same_length:
        mask = mask & (j > q - mem_len)
    return mask


def document_starts(reset: Tensor, qlen: int) -> Tensor:
    """Normalise ``reset`` ([B] row flags or [B, L] token flags) to token flags [B, L]."""
    if reset.dim() == 2:
        if reset.size(1) != qlen:
            raise ValueError(f"reset has {reset.size(1)} token flags for a segment of {qlen}")
        return reset.bool()
    if reset.dim() != 1:
        raise ValueError(f"reset must be [B] or [B, L], got shape {tuple(reset.shape)}")
    starts = torch.zeros(reset.size(0), qlen, dtype=torch.bool, device=reset.device)
    starts[:, 0] = reset.bool()
    return starts


def attention_mask(
    qlen: int,
    mlen: int,
    *,
    mem_len: int,
    same_length: bool,
    reset: Tensor | None = None,
    mem_valid: Tensor | None = None,
    device: torch.device | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The mask for one segment and the validity of the memory it leaves behind.

    Returns ``(mask, next_mem_valid)``. Without ``reset`` and ``mem_valid`` the mask is the
    shared [L, K] causal mask and ``next_mem_valid`` is None (every position valid). Otherwise
    the mask is per row, [B, 1, L, K] (broadcast over heads), and ``next_mem_valid`` [B, M']
    (M' = min(mem_len, K), aligned with the trimmed memory) marks the positions that belong to
    the document still open at the segment's end.
    """
    base = causal_mask(qlen, mlen, mem_len=mem_len, same_length=same_length, device=device)
    if reset is None and mem_valid is None:
        return base, None

    batch = (reset if reset is not None else mem_valid).size(0)  # type: ignore[union-attr]
    if reset is None:
        starts = torch.zeros(batch, qlen, dtype=torch.bool, device=device)
    else:
        starts = document_starts(reset, qlen).to(device)
    if mem_valid is None:
        mem_valid = torch.ones(batch, mlen, dtype=torch.bool, device=device)
    if mem_valid.shape != (batch, mlen):
        raise ValueError(f"mem_valid must be [{batch}, {mlen}], got {tuple(mem_valid.shape)}")

    # doc[b, t]: how many documents started in this segment up to and including token t.
    # 0 means token t still belongs to the document that the memory continues.
    doc = starts.long().cumsum(1)  # [B, L]
    sees_mem = (doc[:, :, None] == 0) & mem_valid[:, None, :]  # [B, L, M]
    sees_cur = doc[:, :, None] == doc[:, None, :]  # [B, L, L]
    mask = torch.cat([sees_mem, sees_cur], dim=2) & base  # [B, L, K]

    open_doc = doc[:, -1:]  # the document the next segment continues
    keep = torch.cat([mem_valid & (open_doc == 0), doc == open_doc], dim=1)  # [B, K]
    next_valid = keep[:, keep.size(1) - min(mem_len, keep.size(1)) :]
    return mask[:, None], next_valid
