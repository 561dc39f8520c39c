"""Evaluation that keeps each layer's memory keys and values instead of re-projecting them.

Legend: B batch, L segment length, M memory length (<= mem_len), H heads, Dh head dim,
D model dim, N layers.

Why. Transformer-XL's memory holds each layer's *input* hidden states; a forward over that
memory projects all M + L of them to keys and values (the layer's one key/value product over
the memory and the segment joined), although the M memory
positions were projected already, as current positions, one segment earlier. With fixed
weights and no dropout (evaluation) those projections are the same numbers, so this runner
keeps them: per layer the keys and values [B, H, M, Dh] of the memory positions, trimmed to
the newest ``mem_len`` exactly as ``update_memory`` trims the hidden states (Tail_M), and each
segment projects only its L new positions. That saves 4 M D (H Dh) FLOPs per layer and row,
half the key/value work at M = L and 80% at M = 4L (mem 512, segment 128).

The results equal ``model(...)`` segment by segment up to float rounding (the same products,
blocked differently by the matmul): tests/inference/test_kv_eval.py. It is the model's own
``transform`` with a ``KVCache`` (txlm.model.cache), the same one generation decodes with.
The cache is the memory: no hidden states are kept (``out.mems`` is empty; ``cache.window``
and ``cache.memory_valid`` show what it holds). Opt-in, for inference only: training needs the
projections in the autograd graph, and dropout would make them differ.

    runner = CachedEvaluator(model)             # model.eval()
    for batch in stream:
        out = runner(batch.input_ids, labels=batch.labels, reset=batch.reset)
"""

from __future__ import annotations

import torch
from torch import Tensor

from txlm.model.cache import KVCache
from txlm.model.lengths import Lengths
from txlm.model.transformer import TransformerXL, TransformerXLOutput


class CachedEvaluator:
    """Runs consecutive segments of the same rows through ``model``, carrying the memory as
    the cache of projected keys and values (with their positions and document ids)."""

    def __init__(
        self, model: TransformerXL, *, lengths: Lengths | None = None, compile: bool | str = False
    ) -> None:
        """``lengths``: the attention lengths (None: the model's); ``compile``: run
        ``transform`` under torch.compile (a string names the backend); shapes are static,
        so every full segment after the first reuses one graph."""
        self.model = model
        self.lengths = model.lengths if lengths is None else lengths
        self._transform = model.transform
        if compile:
            backend = compile if isinstance(compile, str) else "inductor"
            self._transform = torch.compile(model.transform, dynamic=False, backend=backend)
        self.reset_state()

    def reset_state(self) -> None:
        """Forget the memory: the next segment starts every row from scratch."""
        self.cache: KVCache | None = None

    @torch.no_grad()
    def __call__(
        self, input_ids: Tensor, labels: Tensor | None = None, reset: Tensor | None = None
    ) -> TransformerXLOutput:
        """Like ``model(input_ids, mems, reset=reset, labels=labels, mem_mask=mem_mask)`` with
        the carried memory (rows [B] and positions as in the previous call)."""
        model = self.model
        if model.training:
            raise RuntimeError("CachedEvaluator needs model.eval(): dropout changes projections")
        if self.cache is None or self.cache.batch != input_ids.size(0):
            self.cache = model.new_cache(
                input_ids.size(0),
                max(input_ids.size(1), self.lengths.tgt_len),
                lengths=self.lengths,
            )
        hidden, mems, mem_mask = self._transform(input_ids, reset=reset, cache=self.cache)
        return model.output(hidden, mems, mem_mask, labels)
