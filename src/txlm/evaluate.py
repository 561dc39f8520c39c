"""Streaming evaluation with memory (paper Sec. 3.2, "evaluation speed").

Legend: N tokens in the stream, B rows, R row length, L segment length, M memory length.

The split is one token stream. It is cut into B contiguous rows (row b predicts the tokens
b*R+1 .. (b+1)*R; the last row is padded with ignored labels), and each row is read segment by
segment with its memory carried across segments. Memory starts empty once per row: with B = 1
(the default of ``txlm eval``) only the first segment of the whole split lacks context, as in
the paper; with B rows, B segments do, a negligible difference on real splits that buys
batch-level throughput. Every token but the first is predicted exactly once.

Because the model's positions are relative, evaluation may use a longer memory (and segment)
than training: ``mem_len`` and friends override the model's lengths for this call only.

``evaluate_tokens`` works on any 1-D token array, so scoring a user's file (``txlm.score``)
and the training loop's validation use the same code.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from txlm.data import metrics as _metrics
from txlm.model import TransformerXL
from txlm.model.kv_eval import CachedEvaluator

LN2 = math.log(2.0)


def metric_value(loss: float, metric: str, *, tokens_per_byte: float | None = None) -> float:
    """bits per character (char/byte), bits per byte (bpe; needs the text's tokens per
    byte), perplexity (word): ``txlm.data.metrics``."""
    return _metrics.metric_value(loss, metric, tokens_per_byte=tokens_per_byte)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision: bf16 autocast on CPU and GPU, fp16 on GPU; fp32 runs plain."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def stream_rows(tokens: Tensor, batch_size: int) -> tuple[Tensor, Tensor]:
    """Cut a 1-D stream into ``batch_size`` contiguous rows of inputs and next-token labels.

    Returns ``(input_ids, labels)``, both [B, R], R = ceil((N - 1) / B); padding positions
    hold token 0 with label -100 (ignored). Padding only ever follows a row's real tokens,
    so causal attention keeps it from changing any scored position.
    """
    n = tokens.numel() - 1
    if n < 1:
        raise ValueError("a stream needs at least two tokens to predict one")
    batch_size = max(1, min(batch_size, n))
    row_len = math.ceil(n / batch_size)
    inputs = torch.zeros(batch_size, row_len, dtype=torch.long)
    labels = torch.full((batch_size, row_len), -100, dtype=torch.long)
    for b in range(batch_size):
        start = b * row_len
        stop = min(n, start + row_len)
        if stop <= start:
            continue
        inputs[b, : stop - start] = tokens[start:stop]
        labels[b, : stop - start] = tokens[start + 1 : stop + 1]
    return inputs, labels


@torch.no_grad()
def evaluate_tokens(
    model: TransformerXL,
    tokens: Tensor | np.ndarray,
    *,
    batch_size: int = 1,
    tgt_len: int | None = None,
    mem_len: int | None = None,
    clamp_len: int | None = None,
    same_length: bool | None = None,
    max_steps: int | None = None,
    precision: str = "fp32",
    metric: str | None = None,
    tokens_per_byte: float | None = None,
    progress: bool = False,
    desc: str = "eval",
    kv_cache: bool = False,
    compile: bool = False,
) -> dict[str, Any]:
    """Mean next-token loss over a stream, memory carried across segments.

    Returns a dict: ``loss`` (nats per predicted token), ``tokens`` (predicted), ``segments``,
    ``seconds``, ``tokens_per_s``, the lengths used, and ``bpc``/``ppl`` when ``metric`` is
    given (``bpb`` needs ``tokens_per_byte`` of the stream's text and adds token ``ppl``).
    ``max_steps`` caps the number of segments (a quick validation); memory still starts
    empty only once per row. ``kv_cache`` keeps the memory's projected keys and values between
    segments instead of re-projecting them (``CachedEvaluator``: same numbers up to float
    rounding, faster with long memory). ``compile``: run the segments under ``torch.compile``
    (static shapes: the first segment, without memory, and a shorter last one add a graph).
    """
    device = next(model.parameters()).device
    stream = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    inputs, labels = stream_rows(stream.view(-1), batch_size)

    saved_config, was_training = model.config, model.training
    model.set_lengths(
        tgt_len=tgt_len, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length
    )
    c = model.config
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    segments = 0
    n_segments = math.ceil(inputs.size(1) / c.tgt_len)
    if max_steps is not None:
        n_segments = min(n_segments, max_steps)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n_segments, desc=desc, unit="seg", leave=False, dynamic_ncols=True)
    start = time.perf_counter()
    try:
        mems: list[Tensor] | None = None
        mem_mask: Tensor | None = None
        runner = CachedEvaluator(model, compile=compile) if kv_cache else None
        forward = torch.compile(model, dynamic=False) if compile and not kv_cache else model
        for seg in range(n_segments):
            lo = seg * c.tgt_len
            ids = inputs[:, lo : lo + c.tgt_len].to(device, non_blocking=True)
            lab = labels[:, lo : lo + c.tgt_len].to(device, non_blocking=True)
            with autocast(device, precision):
                if runner is not None:
                    out = runner(ids, labels=lab)
                else:
                    out = forward(ids, mems=mems, labels=lab, mem_mask=mem_mask)
            mems, mem_mask = out.mems, out.mem_mask
            assert out.losses is not None
            total += out.losses.double().sum().cpu()
            n = int((lab != -100).sum())
            count += n
            segments += 1
            if bar is not None:
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(
                    loss=f"{total.item() / max(count, 1):.4f}", tok_s=f"{count / elapsed:.0f}"
                )
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        model.config = saved_config
        model.train(was_training)
    seconds = time.perf_counter() - start
    loss = total.item() / max(count, 1)
    result: dict[str, Any] = {
        "loss": loss,
        "tokens": count,
        "segments": segments,
        "batch_size": inputs.size(0),
        "tgt_len": c.tgt_len,
        "mem_len": c.mem_len,
        "clamp_len": c.clamp_len,
        "same_length": c.same_length,
        "seconds": seconds,
        "tokens_per_s": count / max(seconds, 1e-9),
    }
    if metric is not None:
        result["metric"] = metric
        result.update(_metrics.metrics(loss, metric, tokens_per_byte=tokens_per_byte))
    return result


# The name the design notes use; both are the same function.
evaluate = evaluate_tokens
