"""Streaming evaluation with memory (paper Sec. 3.2, "evaluation speed").

Legend: N tokens in the stream, B rows, R row length, L segment length, M memory length.

The split is one token stream. It is cut into B contiguous rows (row b predicts the tokens
b*R+1 .. (b+1)*R; the last row is padded with ignored labels), and each row is read segment by
segment with its memory carried across segments. Memory starts empty once per row: with B = 1
(the default of ``txlm eval``) only the first segment of the whole split lacks context, as in
the paper; with B rows, B segments do, a negligible difference on real splits that buys
batch-level throughput. Every token but the first is predicted exactly once.

Because the model's positions are relative, evaluation may use a longer memory (and segment)
than training: the lengths (txlm.model.lengths) are an argument of each call.

``stream_segments`` is the one loop that reads a stream segment by segment with memory;
``evaluate_tokens`` (validation, ``txlm eval``), ``txlm.score`` and the analysis tools are
built on it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from txlm.data import metrics as _metrics
from txlm.data.progress import Progress
from txlm.devices import autocast
from txlm.inference.kv_eval import CachedEvaluator
from txlm.inference.precision import narrowed
from txlm.model import TransformerXL
from txlm.model.lengths import Lengths
from txlm.model.modes import evaluating
from txlm.model.transformer import TransformerXLOutput

LN2 = math.log(2.0)


def metric_value(loss: float, metric: str, *, tokens_per_byte: float | None = None) -> float:
    """bits per character (char/byte), bits per byte (bpe; needs the text's tokens per
    byte), perplexity (word): ``txlm.data.metrics``."""
    return _metrics.metric_value(loss, metric, tokens_per_byte=tokens_per_byte)


def stream_rows(tokens: Tensor, batch_size: int) -> tuple[Tensor, Tensor]:
    """Cut a 1-D stream into ``batch_size`` contiguous rows of inputs and next-token labels.

    Returns ``(input_ids, labels)``, both [B, R], R = ceil((N - 1) / B), on the tokens'
    device; padding positions hold token 0 with label -100 (ignored). Padding only ever
    follows a row's real tokens, so causal attention keeps it from changing any scored
    position.
    """
    n = tokens.numel() - 1
    if n < 1:
        raise ValueError("a stream needs at least two tokens to predict one")
    batch_size = max(1, min(batch_size, n))
    row_len = math.ceil(n / batch_size)
    inputs = torch.zeros(batch_size, row_len, dtype=torch.long, device=tokens.device)
    labels = torch.full((batch_size, row_len), -100, dtype=torch.long, device=tokens.device)
    for b in range(batch_size):
        start = b * row_len
        stop = min(n, start + row_len)
        if stop <= start:
            continue
        inputs[b, : stop - start] = tokens[start:stop]
        labels[b, : stop - start] = tokens[start + 1 : stop + 1]
    return inputs, labels


@dataclass
class Segment:
    """One segment of a stream, after the model read it (see ``stream_segments``)."""

    index: int  # 0, 1, ... in reading order
    start: int  # column of the rows where the segment begins
    input_ids: Tensor  # [B, L] on the model's device
    labels: Tensor | None  # [B, L] next tokens (-100: ignored), None when not predicting
    tokens: int  # labelled positions in this segment (counted on the host)
    out: Any  # what the step returned: TransformerXLOutput by default


# (input_ids, labels) -> the segment's output; called on the segments of the same rows in
# order, it carries the memory from one to the next itself
Step = Callable[[Tensor, Tensor | None], Any]


def stream_segments(
    model: TransformerXL,
    tokens: Tensor | np.ndarray,
    *,
    lengths: Lengths | None = None,
    batch_size: int = 1,
    predict: bool = True,
    max_segments: int | None = None,
    precision: str = "fp32",
    kv_cache: bool = False,
    compile: bool = False,
    step: Step | None = None,
) -> Iterator[Segment]:
    """Read a 1-D token stream through ``model`` segment by segment, memory carried.

    The one streaming loop of txlm: evaluation, scoring, the ablation's evaluation, the
    evaluation-speed benchmark and the attention maps all iterate over it.

    ``lengths``: the segment and attention lengths (txlm.model.lengths; None: the model's;
    ``mem_len`` may exceed training's), passed to every forward.
    ``predict``: cut the stream into ``batch_size`` rows of inputs and next-token labels
    (``stream_rows``); False: the tokens themselves are the one row of inputs, no labels.
    Each segment runs in eval mode without autograd, and the model is back in its mode
    before the segment is handed out: nothing stays changed while the caller holds it.
    ``kv_cache``: keep the memory's projected keys and values (``CachedEvaluator``).
    ``precision``: "fp32"; "bf16" or "fp16" (autocast); "int8" (the layers' weights in int8,
    through the cache: txlm.inference.precision).
    ``compile``: run the segments under ``torch.compile`` (static shapes: the first segment,
    without memory, and a shorter last one add a graph).
    ``step``: a replacement for the model call (e.g. one that also collects attention),
    ``step(ids, labels)``, given the segments in order and carrying its own memory.
    """
    lengths = model.lengths if lengths is None else lengths
    device = next(model.parameters()).device
    stream = torch.as_tensor(np.asarray(tokens, dtype=np.int64) if isinstance(tokens, np.ndarray)
                             else tokens).long().view(-1)  # fmt: skip
    if predict:
        inputs, labels = stream_rows(stream, batch_size)
        # labelled positions up to each column, on the host (no device sync per segment) and
        # as a tensor: 8 bytes a column, where a Python list would take ~36
        counts = (labels != -100).sum(dim=0).cumsum(0)
    else:
        inputs, labels, counts = stream[None], None, None
    seg_len = lengths.tgt_len
    n_segments = math.ceil(inputs.size(1) / seg_len)
    if max_segments is not None:
        n_segments = min(n_segments, max_segments)
    if step is None:
        step = _model_step(model, lengths, kv_cache or precision == "int8", compile, precision)
    done = 0
    for index in range(n_segments):
        lo = index * seg_len
        hi = min(lo + seg_len, inputs.size(1))
        ids = inputs[:, lo:hi].to(device, non_blocking=True)
        lab = None if labels is None else labels[:, lo:hi].to(device, non_blocking=True)
        with evaluating(model), torch.no_grad(), autocast(device, precision):
            out = step(ids, lab)
        seen = 0 if counts is None else int(counts[hi - 1])
        yield Segment(index, lo, ids, lab, seen - done, out)
        done = seen


def _model_step(
    model: TransformerXL, lengths: Lengths, kv_cache: bool, compile: bool, precision: str
) -> Step:
    """The model call of ``stream_segments``: the key/value cache (the memory its keys and
    values; int8: over the model with int8 layers, txlm.inference.precision), or a plain
    forward carrying the hidden-state memory."""
    if kv_cache:
        net = narrowed(model, "int8") if precision == "int8" else model
        return CachedEvaluator(net, lengths=lengths, compile=compile)
    forward = torch.compile(model, dynamic=False) if compile else model
    mems: list[Tensor] | None = None
    mem_mask: Tensor | None = None

    def step(ids: Tensor, labels: Tensor | None) -> TransformerXLOutput:
        nonlocal mems, mem_mask
        out = forward(ids, mems=mems, labels=labels, mem_mask=mem_mask, lengths=lengths)
        mems, mem_mask = out.mems, out.mem_mask
        return out

    return step


def evaluate_tokens(
    model: TransformerXL,
    tokens: Tensor | np.ndarray,
    *,
    batch_size: int = 1,
    lengths: Lengths | None = None,
    max_steps: int | None = None,
    precision: str = "fp32",
    metric: str | None = None,
    tokens_per_byte: float | None = None,
    progress: bool = False,
    desc: str = "eval",
    kv_cache: bool = False,
    compile: bool = False,
    on_segment: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Mean next-token loss over a stream, memory carried across segments.

    ``lengths``: the attention lengths to read with (None: the model's, ``model.lengths``).
    Returns a dict: ``loss`` (nats per predicted token), ``tokens`` (predicted), ``segments``,
    ``seconds``, ``tokens_per_s``, the lengths used, and ``bpc``/``ppl`` when ``metric`` is
    given (``bpb`` needs ``tokens_per_byte`` of the stream's text and adds token ``ppl``).
    ``max_steps`` caps the number of segments (a quick validation); memory still starts
    empty only once per row. ``kv_cache`` keeps the memory's projected keys and values between
    segments instead of re-projecting them (``CachedEvaluator``: same numbers up to float
    rounding, faster with long memory). ``compile``: see ``stream_segments``.
    ``on_segment(done, total)`` hears each segment read (progress where no bar can be drawn).
    """
    used = model.lengths if lengths is None else lengths
    segments = stream_segments(
        model, tokens, lengths=used, batch_size=batch_size, max_segments=max_steps,
        precision=precision, kv_cache=kv_cache, compile=compile,
    )  # fmt: skip
    n = len(tokens) - 1
    rows = max(1, min(batch_size, n))
    total = math.ceil(math.ceil(n / rows) / used.tgt_len)
    if max_steps is not None:
        total = min(total, max_steps)
    # a bar on a terminal, a line per tenth in a log; nothing for a split read within a second
    bar = Progress(desc, total, unit="segments", enabled=progress)
    # Summed on the model's device: one host sync at the end, not one per segment.
    total_loss: Tensor | None = None
    count = n_segments = rows_used = 0
    start = time.perf_counter()
    try:
        for seg in segments:
            loss = seg.out.losses.double().sum()
            total_loss = loss if total_loss is None else total_loss + loss
            count += seg.tokens
            n_segments += 1
            rows_used = seg.input_ids.size(0)
            bar.update(1)
            if on_segment is not None:
                on_segment(n_segments, total)
    finally:
        bar.close()
    loss = (0.0 if total_loss is None else total_loss.item()) / max(count, 1)
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "loss": loss,
        "tokens": count,
        "segments": n_segments,
        "batch_size": rows_used,
        "tgt_len": used.tgt_len,
        "mem_len": used.mem_len,
        "clamp_len": used.clamp_len,
        "same_length": used.same_length,
        "seconds": seconds,
        "tokens_per_s": count / max(seconds, 1e-9),
    }
    if metric is not None:
        result["metric"] = metric
        result.update(_metrics.metrics(loss, metric, tokens_per_byte=tokens_per_byte))
    return result
