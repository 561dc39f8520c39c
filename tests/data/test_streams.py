"""Stream iterator contracts: continuity, sharding, resume, document flags, varlen, lm1b."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from txlm.data import SentenceStreamIterator, StreamIterator
from txlm.errors import DataError


def positions(n: int) -> np.ndarray:
    """A corpus whose token ids are their own offsets, so every batch shows where it came from."""
    return np.arange(n, dtype=np.int64)


def collect(it, n=None):
    out = []
    for b in it:
        out.append(b)
        if n is not None and len(out) == n:
            break
    return out


def test_rows_are_contiguous_and_labels_are_the_next_token():
    tokens = positions(1001)
    it = StreamIterator(tokens, batch_size=4, tgt_len=7)
    row_len = (1001 - 1) // 4
    batches = collect(it)
    assert len(batches) == len(it) == -(-row_len // 7)
    x = torch.cat([b.input_ids for b in batches], dim=1)
    y = torch.cat([b.labels for b in batches], dim=1)
    for r in range(4):
        expect = torch.arange(r * row_len, (r + 1) * row_len)
        assert torch.equal(x[r], expect)  # batch t+1 of row r continues batch t of row r
        assert torch.equal(y[r], expect + 1)
    assert all(b.input_ids.dtype == torch.int64 and b.reset is None for b in batches)
    # every token except the first and the (N-1) % B tail is a label exactly once
    assert y.numel() == 4 * row_len


def test_memmap_input_and_small_dtypes(tmp_path):
    f = tmp_path / "t.bin"
    np.arange(500, dtype=np.uint16).tofile(f)
    mm = np.memmap(f, dtype=np.uint16, mode="r")
    b = next(iter(StreamIterator(mm, 2, 10)))
    assert b.input_ids.dtype == torch.int64
    assert b.input_ids[1, 0].item() == (500 - 1) // 2


@pytest.mark.parametrize("varlen", [False, True])
def test_sharding_equivalence_across_world_sizes(varlen):
    tokens = positions(5000)
    single = collect(StreamIterator(tokens, 8, 16, varlen=varlen, seed=3))
    for world in (2, 4, 8):
        shards = [
            collect(StreamIterator(tokens, 8, 16, rank=r, world_size=world, varlen=varlen, seed=3))
            for r in range(world)
        ]
        assert all(len(s) == len(single) for s in shards)  # no rank ever waits for another
        for t, whole in enumerate(single):
            stacked = torch.cat([s[t].input_ids for s in shards])
            assert torch.equal(stacked, whole.input_ids)
            assert torch.equal(torch.cat([s[t].labels for s in shards]), whole.labels)


def test_ranks_get_disjoint_contiguous_row_blocks():
    tokens = positions(4097)
    firsts = [next(iter(StreamIterator(tokens, 8, 4, rank=r, world_size=4))) for r in range(4)]
    starts = [b.input_ids[:, 0].tolist() for b in firsts]
    assert starts == [[0, 512], [1024, 1536], [2048, 2560], [3072, 3584]]


def test_batch_must_divide_over_ranks():
    with pytest.raises(DataError, match="does not divide"):
        StreamIterator(positions(100), 3, 4, rank=0, world_size=2)


def test_split_too_short_for_one_segment():
    with pytest.raises(DataError, match="too few"):
        StreamIterator(positions(40), 4, 10)
    StreamIterator(positions(41), 4, 10)  # exactly enough


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("doc_mode", ["continue", "reset"])
def test_resume_mid_epoch_yields_the_same_batches(varlen, doc_mode):
    tokens = positions(3000)
    docs = np.array([0, 17, 400, 401, 1500, 2999])
    kw = dict(doc_starts=docs, doc_mode=doc_mode, varlen=varlen, seed=11)
    ref_it = StreamIterator(tokens, 4, 9, **kw)
    ref = collect(ref_it) + collect(ref_it)  # two epochs
    it = StreamIterator(tokens, 4, 9, **kw)
    got = collect(it, 30)
    state = json.loads(json.dumps(it.state_dict()))  # JSON-serialisable
    resumed = StreamIterator(tokens, 4, 9, **kw)
    resumed.load_state_dict(state)
    got += collect(resumed)  # rest of epoch 0
    got += collect(resumed)  # epoch 1
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert (a.reset is None) == (b.reset is None)
        if a.reset is not None:
            assert torch.equal(a.reset, b.reset)
        assert (a.epoch, a.index) == (b.epoch, b.index)


def test_resume_with_another_world_size():
    tokens = positions(4000)
    it = StreamIterator(tokens, 4, 10, world_size=1)
    collect(it, 13)
    state = it.state_dict()
    rest_single = collect(it)
    halves = []
    for r in range(2):
        shard = StreamIterator(tokens, 4, 10, rank=r, world_size=2)
        shard.load_state_dict(state)
        halves.append(collect(shard))
    for t, whole in enumerate(rest_single):
        assert torch.equal(torch.cat([h[t].input_ids for h in halves]), whole.input_ids)


def test_state_from_another_layout_is_refused():
    it = StreamIterator(positions(1000), 4, 10)
    state = it.state_dict()
    other = StreamIterator(positions(1000), 4, 12)
    with pytest.raises(DataError, match="tgt_len"):
        other.load_state_dict(state)


def test_reset_flags_exactly_at_document_starts():
    n = 2000
    rng = np.random.default_rng(0)
    docs = np.unique(np.concatenate([[0], rng.choice(n, 40, replace=False)]))
    it = StreamIterator(positions(n), 4, 13, doc_starts=docs, doc_mode="reset")
    doc_set = set(docs.tolist())
    for b in it:
        assert b.reset is not None and b.reset.dtype == torch.bool
        assert b.reset.shape == b.input_ids.shape
        for r in range(b.input_ids.shape[0]):
            for t in range(b.input_ids.shape[1]):
                pos = int(b.input_ids[r, t])
                expect = pos in doc_set or (b.index == 0 and t == 0)
                assert bool(b.reset[r, t]) == expect, (b.index, r, t, pos)


def test_reset_mode_needs_doc_starts():
    with pytest.raises(DataError, match="doc_starts"):
        StreamIterator(positions(100), 2, 4, doc_mode="reset")
    with pytest.raises(DataError, match="increasing"):
        StreamIterator(positions(100), 2, 4, doc_starts=np.array([0, 5, 5]), doc_mode="reset")


def test_varlen_lengths_vary_and_depend_only_on_seed_and_epoch():
    tokens = positions(20000)
    a = StreamIterator(tokens, 2, 40, varlen=True, seed=1)
    b = StreamIterator(tokens, 2, 40, varlen=True, seed=1)
    la = [x.input_ids.shape[1] for x in a]
    lb = [x.input_ids.shape[1] for x in b]
    assert la == lb and len(set(la)) > 3
    assert max(la) <= 40 + 15 and min(la[:-1]) >= 5
    la2 = [x.input_ids.shape[1] for x in a]  # epoch 1: a fresh schedule
    assert la2 != la
    x = torch.cat([bb.input_ids for bb in StreamIterator(tokens, 2, 40, varlen=True)], dim=1)
    assert torch.equal(x[0], torch.arange((20000 - 1) // 2))  # still one continuous row


def test_epochs_advance_and_set_epoch():
    it = StreamIterator(positions(500), 2, 50)
    e0 = [b.epoch for b in it]
    e1 = [b.epoch for b in it]
    assert set(e0) == {0} and set(e1) == {1}
    it.set_epoch(5)
    assert next(iter(it)).epoch == 5


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(50, 3000),
    world=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 4),
    tgt=st.integers(1, 24),
    varlen=st.booleans(),
)
def test_stream_invariants(n, world, per_rank, tgt, varlen):
    batch = world * per_rank
    if (n - 1) // batch < tgt:
        with pytest.raises(DataError):
            StreamIterator(positions(n), batch, tgt)
        return
    rows = []
    for r in range(world):
        it = StreamIterator(positions(n), batch, tgt, rank=r, world_size=world, varlen=varlen)
        bs = collect(it)
        rows.append(torch.cat([b.input_ids for b in bs], dim=1))
        for b in bs:
            assert torch.equal(b.labels, b.input_ids + 1)
    x = torch.cat(rows)
    s = (n - 1) // batch
    assert torch.equal(x, torch.arange(batch * s).reshape(batch, s))


# --- lm1b sentence streams --------------------------------------------------------------


def sentence_corpus(n_sent: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sentence i is [1000*i, 1000*i+1, ...]: every token names its sentence and offset."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, 12, n_sent)
    tokens = np.concatenate([1000 * i + np.arange(k) for i, k in enumerate(lens)])
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return tokens.astype(np.int64), starts.astype(np.int64)


def test_sentence_rows_stream_whole_shuffled_sentences():
    tokens, starts = sentence_corpus(400)
    it = SentenceStreamIterator(tokens, 4, 8, doc_starts=starts, doc_mode="reset", seed=5)
    batches = collect(it)
    x = torch.cat([b.input_ids for b in batches], dim=1)
    y = torch.cat([b.labels for b in batches], dim=1)
    flags = torch.cat([b.reset for b in batches], dim=1)
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the row's next token
    seen = set()
    for r in range(4):
        row = x[r].tolist()
        # reset flags exactly where a sentence begins (offset 0), plus the row's first token
        for t, tok in enumerate(row):
            assert bool(flags[r, t]) == (tok % 1000 == 0 or t == 0)
        # sentences are whole and in order inside: offsets count up from 0 within each run
        sents = [tok // 1000 for tok in row]
        for t in range(1, len(row)):
            if sents[t] == sents[t - 1]:
                assert row[t] == row[t - 1] + 1
            else:
                assert row[t] % 1000 == 0
        seen.update(sents)
    assert len(seen) > 300
    # a fresh order next epoch, reproducible from the seed
    again = SentenceStreamIterator(tokens, 4, 8, doc_starts=starts, seed=5)
    assert torch.equal(next(iter(again)).input_ids, batches[0].input_ids)
    next_epoch = collect(it)
    assert not torch.equal(next_epoch[0].input_ids, batches[0].input_ids)


def test_sentence_streams_shard_and_resume():
    tokens, starts = sentence_corpus(600, seed=1)
    kw = dict(doc_starts=starts, doc_mode="reset", seed=2)
    whole = collect(SentenceStreamIterator(tokens, 4, 6, **kw))
    halves = [
        collect(SentenceStreamIterator(tokens, 4, 6, rank=r, world_size=2, **kw)) for r in range(2)
    ]
    for t, b in enumerate(whole):
        assert torch.equal(torch.cat([h[t].input_ids for h in halves]), b.input_ids)
        assert torch.equal(torch.cat([h[t].reset for h in halves]), b.reset)
    it = SentenceStreamIterator(tokens, 4, 6, **kw)
    ref = collect(it) + collect(it)
    it2 = SentenceStreamIterator(tokens, 4, 6, **kw)
    got = collect(it2, 7)
    res = SentenceStreamIterator(tokens, 4, 6, **kw)
    res.load_state_dict(it2.state_dict())
    got += collect(res) + collect(res)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(got, ref, strict=True))


def test_sentence_stream_needs_sentences():
    tokens, starts = sentence_corpus(3)
    with pytest.raises(DataError, match="too few"):
        SentenceStreamIterator(tokens, 4, 2, doc_starts=starts)
    with pytest.raises(DataError, match="doc_starts"):
        SentenceStreamIterator(tokens, 1, 2)


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(200, 2000),
    n_docs=st.integers(1, 30),
    world=st.sampled_from([1, 2, 4]),
    tgt=st.integers(2, 16),
    varlen=st.booleans(),
    data=st.data(),
)
def test_reset_flags_property(n, n_docs, world, tgt, varlen, data):
    docs = np.unique([0, *data.draw(st.lists(st.integers(1, n - 1), max_size=n_docs))])
    batch = 2 * world
    kw = dict(doc_starts=docs, doc_mode="reset", varlen=varlen, seed=7)
    whole = collect(StreamIterator(positions(n), batch, tgt, **kw))
    doc_set = set(docs.tolist())
    for b in whole:
        expect = torch.tensor([[int(p) in doc_set for p in row] for row in b.input_ids.tolist()])
        if b.index == 0:
            expect[:, 0] = True
        assert torch.equal(b.reset, expect)
    shards = [
        collect(StreamIterator(positions(n), batch, tgt, rank=r, world_size=world, **kw))
        for r in range(world)
    ]
    for t, b in enumerate(whole):
        assert torch.equal(torch.cat([s[t].reset for s in shards]), b.reset)


def test_batches_land_on_the_requested_device_and_the_corpus_is_not_copied():
    tokens = positions(1000)
    it = StreamIterator(tokens, 2, 10, device=torch.device("cpu"))
    assert it.tokens is tokens  # the split is referenced, never copied or moved
    b = next(iter(it))
    assert b.input_ids.device.type == "cpu"
    assert b.input_ids.is_contiguous() and b.labels.is_contiguous()
