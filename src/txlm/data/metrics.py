"""What a loss means for a level: bits per character, bits per byte, or perplexity.

The model's loss is the mean negative log-likelihood per token, in nats. Its readable form
depends on what a token is:

* ``bpc`` (char and byte levels): bits per character (per byte for byte level, the enwik8
  convention), loss / ln 2;
* ``ppl`` (word level): perplexity per word, exp(loss);
* ``bpb`` (bpe): bits per UTF-8 byte of the text, loss / ln 2 x tokens / bytes. A subword
  token spans several bytes, and how many depends on the vocabulary, so bits per token or
  token perplexity do not compare across vocabulary sizes or levels; bits per byte do (a
  char-level bpc on ASCII text is the same number). Token perplexity is reported beside it.

``tokens / bytes`` is the ratio of the text being scored: prepare records each split's
UTF-8 size (``text_bytes`` in meta.json), ``txlm eval --file`` measures the file.
"""

from __future__ import annotations

import math

LN2 = math.log(2.0)

METRIC_OF_LEVEL = {"char": "bpc", "byte": "bpc", "word": "ppl", "bpe": "bpb"}
DESCRIPTION = {
    "bpc": "bits per character",
    "bpb": "bits per byte",
    "ppl": "perplexity per token",
}


def metric_for_level(level: str) -> str:
    return METRIC_OF_LEVEL[level]


def metric_value(loss: float, metric: str, *, tokens_per_byte: float | None = None) -> float:
    """``loss`` (nats per token) as ``metric``; ``bpb`` needs the text's tokens per byte."""
    if metric == "bpc":
        return loss / LN2
    if metric == "ppl":
        return math.exp(min(loss, 700.0))
    if metric == "bpb":
        if tokens_per_byte is None:
            raise ValueError("bits per byte need the text's tokens_per_byte")
        return loss / LN2 * tokens_per_byte
    raise ValueError(f"unknown metric {metric!r} (bpc, bpb or ppl)")


def metrics(loss: float, metric: str, *, tokens_per_byte: float | None = None) -> dict:
    """``{metric: value}``, plus token perplexity next to bits per byte."""
    out = {metric: metric_value(loss, metric, tokens_per_byte=tokens_per_byte)}
    if metric == "bpb":
        out["ppl"] = metric_value(loss, "ppl")
        out["tokens_per_byte"] = tokens_per_byte
    return out


def describe(metric: str) -> str:
    return DESCRIPTION.get(metric, metric)
