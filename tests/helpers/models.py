"""Models that look trained, for tests of a model path."""

from __future__ import annotations

import torch

NORM_STD = 0.2  # a trained LayerNorm's gains spread about 1, its biases about 0


def draw_norms(model, std: float = NORM_STD):
    """Every LayerNorm's weight drawn from N(1, std) and its bias from N(0, std) (the global
    generator), in place; the model back. A fresh model's norms are ones and zeros, under
    which a path that applies one norm's parameters in place of another's computes the same
    numbers."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, std)
    return model


def spread_weights(model, std: float, *, norms: bool = False):
    """Every weight but the LayerNorms' drawn from N(0, std) (from the global generator), in
    place; the model back. Far from a fresh model's near-uniform outputs, so decoding tests
    reach every token class and sampling differences show. ``norms``: the LayerNorms drawn
    too (``draw_norms``; ``debug_model`` always draws them); off by default for the tests
    whose prompts and rows were picked for the draws without them (which token classes a
    draw reaches)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    return draw_norms(model) if norms else model


def debug_model(seed: int = 0, *, dtype=None, std: float | None = None, **overrides):
    """The debug preset with ``overrides``, from seed ``seed``, in eval mode; ``dtype``: the
    model converted to it once built (under the default dtype). ``std``: every weight but the
    LayerNorms' drawn from N(0, std) (``spread_weights``); else as initialised, but with the
    zero-initialised ones (u, v, biases) drawn from N(0, 0.3), so every score term matters.
    The LayerNorms are drawn either way (``draw_norms``): no parameter keeps a trivial value."""
    from txlm.config import ModelConfig
    from txlm.model import TransformerXL

    torch.manual_seed(seed)
    model = TransformerXL(ModelConfig.from_preset("debug", **overrides))
    if dtype is not None:
        model = model.to(dtype)
    model.eval()
    if std is not None:
        return spread_weights(model, std, norms=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and p.dim() <= 2 and p.abs().sum() == 0:
                p.normal_(0, 0.3)
    return draw_norms(model)
