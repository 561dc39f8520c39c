"""The sample printed when a run ends (paper App. E: top-k sampling with memory)."""

from __future__ import annotations

from typing import Any

from txlm.errors import TxlmError
from txlm.inference.generate import generate
from txlm.inference.prompts import encode_prompt, start_token
from txlm.model import TransformerXL
from txlm.model.lengths import Lengths


def sample_text(
    model: TransformerXL,
    vocab: Any,
    prompt: str,
    n_tokens: int,
    *,
    top_k: int = 40,
    seed: int = 0,
    lengths: Lengths | None = None,
) -> str:
    """``prompt`` and ``n_tokens`` sampled after it, from ``txlm.generate`` with ``lengths``
    (None: the model's) and the prompt read as `txlm generate` reads it: with the lengths it
    reads with, the same seed gives the same text there."""
    try:
        ids = encode_prompt(vocab, prompt)[0] if prompt else []
    except TxlmError:  # a prompt the vocabulary cannot spell: sample unconditioned
        ids, prompt = [], ""
    start = start_token(vocab)
    start_id = None if ids else (start if start is not None else 0)
    (new,) = generate(
        model, ids, max_new_tokens=n_tokens, top_k=top_k, seed=seed, start_id=start_id,
        lengths=lengths, vocab=vocab,
    )  # fmt: skip
    return vocab.decode(ids + list(new))
