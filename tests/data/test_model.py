"""Document modes through the real model: after a boundary, a reset row computes exactly what
the new document computes alone; in continue mode memory flows across (the paper's setting)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from txlm.config import ModelConfig
from txlm.data import SentenceStreamIterator, StreamIterator
from txlm.model import TransformerXL

V = 64
ROW = 60  # tokens per row; memory is longer, so every earlier token of a row stays visible


@pytest.fixture(scope="module")
def model() -> TransformerXL:
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("debug", vocab_size=V, mem_len=ROW + 8)
    return TransformerXL(cfg).eval()


def stream_log_probs(model, it) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the iterator the way a trainer does, carrying memory and its mask."""
    mems, mem_mask, xs, outs = None, None, [], []
    with torch.no_grad():
        for b in it:
            out = model(b.input_ids, mems=mems, reset=b.reset, mem_mask=mem_mask)
            mems, mem_mask = out.mems, out.mem_mask
            xs.append(b.input_ids)
            outs.append(out.log_probs)
    return torch.cat(xs, dim=1), torch.cat(outs, dim=1)


def alone(model, ids: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.int64)[None]).log_probs[0]


@pytest.mark.parametrize("varlen", [False, True])
def test_reset_rows_match_each_document_run_alone(model, varlen):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, 2 * ROW + 1)
    docs = np.array([0, 13, 30, 47, 66, 75, 100])
    it = StreamIterator(tokens, 2, 8, doc_starts=docs, doc_mode="reset", varlen=varlen, seed=4)
    x, logp = stream_log_probs(model, it)
    checked = 0
    for r in range(2):
        lo, hi = r * ROW, (r + 1) * ROW
        cuts = sorted({lo, *[d for d in docs.tolist() if lo < d < hi], hi})
        for a, b in itertools.pairwise(cuts):
            ref = alone(model, tokens[a:b])
            got = logp[r, a - lo : b - lo]
            assert torch.equal(x[r, a - lo : b - lo], torch.as_tensor(tokens[a:b]))
            torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
            checked += b - a
    assert checked == 2 * ROW


def test_continue_mode_carries_context_across_documents(model):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, V, 2 * ROW + 1)
    _x, logp = stream_log_probs(model, StreamIterator(tokens, 2, 8))
    # the document starting at 30 sees the text before it, so it differs from running alone
    assert not torch.allclose(logp[0, 30:40], alone(model, tokens[30:40]), atol=1e-6)
    # and the whole row equals one long run: memory holds the true preceding text
    torch.testing.assert_close(logp[0], alone(model, tokens[:ROW]), rtol=0, atol=2e-5)


def test_sentence_streams_reset_at_every_sentence(model):
    rng = np.random.default_rng(3)
    lens = rng.integers(3, 12, 40)
    tokens = rng.integers(0, V, int(lens.sum()))
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    it = SentenceStreamIterator(tokens, 2, 7, doc_starts=starts, doc_mode="reset", seed=0)
    x, logp = stream_log_probs(model, it)
    # the flags of the same epoch, from a fresh iterator
    fresh = SentenceStreamIterator(tokens, 2, 7, doc_starts=starts, doc_mode="reset", seed=0)
    reset = torch.cat([b.reset for b in fresh], dim=1)
    for r in range(2):
        cuts = [*reset[r].nonzero().flatten().tolist(), x.shape[1]]
        for a, b in itertools.pairwise(cuts):
            ref = alone(model, x[r, a:b].numpy())
            torch.testing.assert_close(logp[r, a:b], ref, rtol=0, atol=2e-5)
