"""A tiny Hugging Face TransfoXL, saved as ``save_pretrained`` writes it."""

from __future__ import annotations

import warnings
from pathlib import Path

# A Hugging Face TransfoXL small enough to build in milliseconds, with everything the
# converter maps: an adaptive softmax with two tail clusters (div_val 2), untied r biases.
TINY_HF = dict(
    vocab_size=40,
    cutoffs=[10, 25],
    d_model=16,
    d_embed=16,
    n_head=2,
    d_head=8,
    d_inner=24,
    div_val=2,
    n_layer=2,
    mem_len=6,
    untie_r=True,
)


def save_tiny_hf(directory: Path, *, safe: bool = True, **overrides):
    """``TINY_HF`` (plus ``overrides``) with seed-0 weights, saved with ``save_pretrained``:
    model.safetensors, or the pickled pytorch_model.bin of older Hub repositories."""
    import torch
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notice for TransfoXL
        model = TransfoXLLMHeadModel(TransfoXLConfig(**{**TINY_HF, **overrides}))
    model.save_pretrained(directory, safe_serialization=safe)
    return model
