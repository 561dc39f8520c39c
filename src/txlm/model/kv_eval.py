"""Evaluation that keeps each layer's memory keys and values instead of re-projecting them.

Legend: B batch, L segment length, M memory length (<= mem_len), H heads, Dh head dim,
D model dim, N layers.

Why. Transformer-XL's memory holds each layer's *input* hidden states; every forward projects
all M + L of them to keys and values (``RelativeAttention.project_kv``), although the M memory
positions were projected already, as current positions, one segment earlier. With fixed
weights and no dropout (evaluation) those projections are the same numbers, so this runner
keeps them: per layer the keys and values [B, H, M, Dh] of the memory positions, trimmed to
the newest ``mem_len`` exactly as ``update_memory`` trims the hidden states (Tail_M), and each
segment projects only its L new positions. That saves 4 M D (H Dh) FLOPs per layer and row,
half the key/value work at M = L and 80% at M = 4L (mem 512, segment 128).

The results equal ``model(...)`` segment by segment up to float rounding (the same products,
blocked differently by the matmul): tests/test_perf_kv_eval.py. Masks, reset rows, mem_mask,
same_length and clamp_len all go through the model's own ``transform``; only the memory's
key/value projection is skipped. Opt-in, for inference only: training needs the projections
in the autograd graph, and dropout would make them differ.

    runner = CachedEvaluator(model)             # model.eval()
    for batch in stream:
        out = runner(batch.input_ids, labels=batch.labels, reset=batch.reset)
"""

from __future__ import annotations

import torch
from torch import Tensor

from txlm.model.transformer import TransformerXL, TransformerXLOutput


class CachedEvaluator:
    """Runs consecutive segments of the same rows through ``model``, carrying the memory
    (hidden states, their validity mask, and the projected keys/values)."""

    def __init__(self, model: TransformerXL) -> None:
        self.model = model
        self.reset_state()

    def reset_state(self) -> None:
        """Forget the memory: the next segment starts every row from scratch."""
        self.mems: list[Tensor] | None = None
        self.mem_mask: Tensor | None = None
        self.kv: list[tuple[Tensor, Tensor]] | None = None

    @torch.no_grad()
    def __call__(
        self, input_ids: Tensor, labels: Tensor | None = None, reset: Tensor | None = None
    ) -> TransformerXLOutput:
        """Like ``model(input_ids, mems, reset, labels, mem_mask)`` with the carried memory."""
        model = self.model
        if model.training:
            raise RuntimeError("CachedEvaluator needs model.eval(): dropout changes projections")
        extras: list[dict] = []
        hidden, mems, mem_mask = model.transform(
            input_ids,
            self.mems,
            reset,
            self.mem_mask,
            attn_kwargs={"return_kv": True},
            extras=extras,
            past_kv=self.kv,
        )
        # Tail_M of [past; current], exactly as update_memory trims the hidden states.
        keep = mems[0].size(1)
        kv = []
        for n, e in enumerate(extras):
            k, v = e["k"], e["v"]
            if self.kv is not None and self.mems is not None and self.mems[0].size(1) > 0:
                k = torch.cat([self.kv[n][0], k], dim=2)
                v = torch.cat([self.kv[n][1], v], dim=2)
            kv.append((k[:, :, k.size(2) - keep :], v[:, :, v.size(2) - keep :]))
        self.mems, self.mem_mask, self.kv = mems, mem_mask, kv

        return model.output(hidden, mems, mem_mask, labels)
