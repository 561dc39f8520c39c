"""Models that look trained, for tests of a model path."""

from __future__ import annotations

import torch


def spread_weights(model, std: float):
    """Every weight but the LayerNorms' drawn from N(0, std) (from the global generator), in
    place; the model back. Far from a fresh model's near-uniform outputs, so decoding tests
    reach every token class and sampling differences show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    return model


def debug_model(seed: int = 0, *, dtype=None, std: float | None = None, **overrides):
    """The debug preset with ``overrides``, from seed ``seed``, in eval mode; ``dtype``: the
    model converted to it once built (under the default dtype). ``std``: every weight but the
    LayerNorms' drawn from N(0, std) (``spread_weights``); else as initialised, but with the
    zero-initialised ones (u, v, biases) drawn from N(0, 0.3), so every score term matters."""
    from txlm.config import ModelConfig
    from txlm.model import TransformerXL

    torch.manual_seed(seed)
    model = TransformerXL(ModelConfig.from_preset("debug", **overrides))
    if dtype is not None:
        model = model.to(dtype)
    model.eval()
    if std is not None:
        return spread_weights(model, std)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() <= 2 and p.abs().sum() == 0:
                p.normal_(0, 0.3)
    return model
