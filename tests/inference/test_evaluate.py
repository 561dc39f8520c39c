"""Streaming evaluation: row layout, memory carried across segments, longer eval memory."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from txlm.config import ModelConfig
from txlm.inference.evaluate import evaluate_tokens, metric_value, stream_rows
from txlm.model import TransformerXL
from txlm.model.lengths import Lengths


def _model(**kw) -> TransformerXL:
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset(
        "debug", **{"vocab_size": 20, "dropout": 0.0, "init_std": 0.3, **kw}
    )
    return TransformerXL(cfg).eval()


def test_stream_rows_golden():
    inputs, labels = stream_rows(torch.arange(10), 3)
    # 9 predictions over 3 rows of 3: row b predicts tokens 3b+1 .. 3b+3.
    assert inputs.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert labels.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    inputs, labels = stream_rows(torch.arange(9), 3)  # 8 predictions: the last row padded
    assert inputs.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 0]]
    assert labels.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, -100]]


def _full_loss(model: TransformerXL, tokens: np.ndarray) -> float:
    """One forward over the whole stream, no memory: the reference."""
    x = torch.as_tensor(tokens[:-1], dtype=torch.long)[None]
    y = torch.as_tensor(tokens[1:], dtype=torch.long)[None]
    with torch.no_grad():
        return model(x, labels=y).loss.item()


def test_memory_carries_context_across_segments():
    model = _model(mem_len=16)
    tokens = np.random.default_rng(0).integers(0, 20, size=49)
    reference = _full_loss(model, tokens)
    # Segments of 8 with memory covering the whole past: identical to one long forward.
    r = evaluate_tokens(model, tokens, lengths=Lengths(8, 48))
    assert r["tokens"] == 48 and r["segments"] == 6
    assert r["loss"] == pytest.approx(reference, abs=1e-5)
    # Without memory each segment starts cold: a different number.
    cold = evaluate_tokens(model, tokens, lengths=Lengths(8, 0))
    assert abs(cold["loss"] - reference) > 1e-4
    # The model's own lengths are restored afterwards.
    assert model.config.mem_len == 16 and model.config.tgt_len == 16


def test_rows_are_independent_streams():
    model = _model()
    tokens = np.random.default_rng(1).integers(0, 20, size=41)
    both = evaluate_tokens(model, tokens, batch_size=2, lengths=Lengths(8, 32))
    first = evaluate_tokens(model, tokens[:21], lengths=Lengths(8, 32))
    second = evaluate_tokens(model, tokens[20:], lengths=Lengths(8, 32))
    assert both["tokens"] == first["tokens"] + second["tokens"] == 40
    expected = (first["loss"] * 20 + second["loss"] * 20) / 40
    assert both["loss"] == pytest.approx(expected, abs=1e-5)


def test_max_steps_and_metric_and_training_flag():
    model = _model()
    model.train()
    tokens = np.arange(100) % 20
    r = evaluate_tokens(
        model, tokens, lengths=model.lengths.replace(tgt_len=10), max_steps=3, metric="bpc"
    )
    assert r["segments"] == 3 and r["tokens"] == 30
    assert r["bpc"] == pytest.approx(r["loss"] / math.log(2))
    assert model.training  # restored
    assert metric_value(math.log(50.0), "ppl") == pytest.approx(50.0)


def test_stream_segments_cover_the_stream_once_and_change_nothing_between_segments():
    from txlm.inference.evaluate import stream_segments

    model = _model(mem_len=16)
    model.train()
    tokens = torch.arange(30) % 20
    lengths = model.lengths.replace(tgt_len=4, mem_len=8)
    segs = list(stream_segments(model, tokens, lengths=lengths, batch_size=2))
    # 29 predictions in 2 rows of 15 (the last padded): segments of 4, 4, 4, 3 columns
    assert [(s.index, s.start, s.input_ids.shape[1]) for s in segs] == [
        (0, 0, 4), (1, 4, 4), (2, 8, 4), (3, 12, 3)
    ]  # fmt: skip
    assert [s.tokens for s in segs] == [8, 8, 8, 5]
    assert segs[1].out.mems[0].shape == (2, 8, 32)  # memory carried, mem_len 8
    assert segs[0].labels[1, 0] == tokens[16]  # row 1 starts at token 15, predicts 16
    # predict=False: the tokens themselves are one row, nothing labelled
    raw = list(stream_segments(model, tokens, predict=False, lengths=lengths.replace(tgt_len=16)))
    assert [s.input_ids.shape for s in raw] == [(1, 16), (1, 14)] and raw[0].labels is None
    # while the caller holds a segment (or drops the iterator) the model is as it was
    before = model.config
    it = stream_segments(model, tokens, lengths=lengths.replace(mem_len=64, same_length=True))
    seg = next(it)
    assert seg.out.mems[0].size(1) == 4  # the lengths of the call: memory up to 64
    assert model.config == before and model.lengths.mem_len == 16 and model.training
    del it
    assert model.config == before and model.training
