"""Text as a vocabulary reads it: the one normalisation rule every encoder applies."""

from __future__ import annotations

from typing import Any


def normalize_text(text: str, options: dict[str, Any]) -> str:
    """``text`` as the tokenizer read it (options: ``txlm.checkpoints.convert.text_options``):
    lower-cased when it lower-cased its input, as TransfoXLTokenizer did (``str.lower`` of each
    line)."""
    return text.lower() if options.get("lower_case") else text
