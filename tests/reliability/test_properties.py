"""Property-based tests (hypothesis): vocabulary round trips and stream-iterator invariants.

The data tests check chosen cases; these draw random corpora, batch sizes, segment lengths,
world sizes and resume points, and check the invariants Transformer-XL's recurrence relies on
(ARCHITECTURE.md, C8) for every draw. Tokens are ``arange(N)`` so that a token's value is its
position: any misplaced, repeated or skipped token shows as a wrong number.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from txlm.data import StreamIterator, Vocab
from txlm.errors import DataError

PROFILE = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

# -- vocabulary ------------------------------------------------------------------------------

# Text without surrogates (not encodable) and without \r (prepare normalises \r\n to \n).
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r"), max_size=200)


@PROFILE
@given(TEXT)
def test_char_vocab_round_trip(text: str) -> None:
    assume(text)
    vocab = Vocab.build_char(Counter(text), unk=True)
    ids = vocab.encode(text)
    assert len(ids) == len(text)  # one id per code point
    assert vocab.decode(ids) == text
    assert vocab.unk_id not in ids  # every character was seen


@PROFILE
@given(TEXT, TEXT)
def test_char_vocab_unknown_maps_to_unk(train: str, other: str) -> None:
    assume(train)
    vocab = Vocab.build_char(Counter(train), unk=True)
    ids = vocab.encode(other)
    assert len(ids) == len(other)
    for ch, i in zip(other, ids, strict=True):
        assert (i == vocab.unk_id) == (ch not in vocab)
    strict = Vocab.build_char(Counter(train), unk=False)
    if any(ch not in strict for ch in other):
        with pytest.raises(DataError):
            strict.encode(other)


@PROFILE
@given(st.binary(max_size=300))
def test_byte_vocab_round_trip_any_bytes(data: bytes) -> None:
    vocab = Vocab.byte_level()
    ids = vocab.encode_array(data)
    assert bytes(ids.astype(np.uint8).tolist()) == data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    assert vocab.decode(vocab.encode(text)) == text


WORD = st.text(st.characters(whitelist_categories=("L", "N", "P")), min_size=1, max_size=8)


@PROFILE
@given(st.lists(st.lists(WORD, max_size=8), min_size=1, max_size=10))
def test_word_vocab_round_trip_normalised_text(lines: list[list[str]]) -> None:
    # Normalised form: tokens joined by single spaces, every line ending in a newline.
    text = "".join(" ".join(words) + "\n" for words in lines)
    counts = Counter(w for words in lines for w in words)
    vocab = Vocab.build_word(counts)
    ids = vocab.encode(text)
    assert ids.count(vocab.eos_id) == len(lines)
    assert vocab.decode(ids) == text


@PROFILE
@given(
    st.sampled_from(["char", "word", "byte"]),
    st.lists(WORD, min_size=1, max_size=30, unique=True),
)
def test_vocab_json_round_trip(level: str, words: list[str]) -> None:
    if level == "byte":
        vocab = Vocab.byte_level()
    elif level == "char":
        vocab = Vocab.build_char(Counter("".join(words)))
    else:
        vocab = Vocab.build_word(Counter(words))
    again = Vocab.from_json(vocab.to_json())
    assert again.symbols == vocab.symbols
    assert (again.level, again.unk, again.eos, again.bos) == (
        vocab.level,
        vocab.unk,
        vocab.eos,
        vocab.bos,
    )
    assert again.fingerprint == vocab.fingerprint
    sample = " ".join(words) + "\n"
    assert again.encode(sample) == vocab.encode(sample)


@PROFILE
@given(st.lists(WORD, min_size=3, max_size=20, unique=True), st.data())
def test_vocab_json_tampering_is_refused(words: list[str], data: st.DataObject) -> None:
    vocab = Vocab.build_word(Counter(words))
    d = json.loads(vocab.to_json())
    i = data.draw(st.integers(0, len(d["symbols"]) - 2))
    d["symbols"][i], d["symbols"][i + 1] = d["symbols"][i + 1], d["symbols"][i]  # ids change
    with pytest.raises(DataError, match="fingerprint"):
        Vocab.from_json(json.dumps(d))


# -- stream iterators ------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> dict:
    world = draw(st.sampled_from([1, 2, 3, 4]))
    batch = world * draw(st.integers(1, 3))
    tgt = draw(st.integers(1, 12))
    segments = draw(st.integers(1, 6))
    extra = draw(st.integers(0, tgt * batch + batch))  # ragged tail and partial last segment
    n = batch * tgt * segments + 1 + extra
    varlen = draw(st.booleans())
    seed = draw(st.integers(0, 3))
    return dict(n=n, batch=batch, tgt=tgt, world=world, varlen=varlen, seed=seed)


def _batches(tokens: np.ndarray, lay: dict, *, rank: int = 0, world: int = 1, **kw):
    it = StreamIterator(
        tokens,
        lay["batch"],
        lay["tgt"],
        rank=rank,
        world_size=world,
        varlen=lay["varlen"],
        seed=lay["seed"],
        **kw,
    )
    return it, list(it)


@PROFILE
@given(layouts())
def test_stream_rows_are_contiguous_and_complete(lay: dict) -> None:
    tokens = np.arange(lay["n"], dtype=np.int64)
    it, batches = _batches(tokens, lay)
    assert len(batches) == len(it) >= 1
    S = (lay["n"] - 1) // lay["batch"]
    x = np.concatenate([b.input_ids.numpy() for b in batches], axis=1)
    y = np.concatenate([b.labels.numpy() for b in batches], axis=1)
    for r in range(lay["batch"]):
        # Row r is tokens [r*S, (r+1)*S): batch t+1 continues batch t, nothing skipped/repeated.
        np.testing.assert_array_equal(x[r], np.arange(r * S, (r + 1) * S))
        np.testing.assert_array_equal(y[r], x[r] + 1)  # labels: the next token, no shifting
    lengths = [b.input_ids.shape[1] for b in batches]
    assert all(1 <= n <= lay["tgt"] + (15 if lay["varlen"] else 0) for n in lengths)
    if not lay["varlen"]:
        assert lengths[:-1] == [lay["tgt"]] * (len(lengths) - 1)


@PROFILE
@given(layouts())
def test_stream_ranks_are_disjoint_contiguous_blocks(lay: dict) -> None:
    tokens = np.arange(lay["n"], dtype=np.int64)
    _, whole = _batches(tokens, lay)
    W = lay["world"]
    per_rank = [_batches(tokens, lay, rank=r, world=W)[1] for r in range(W)]
    assert all(len(p) == len(whole) for p in per_rank)  # no rank waits on a finished one
    for t, full in enumerate(whole):
        parts = [p[t].input_ids for p in per_rank]
        assert all(part.shape[0] == lay["batch"] // W for part in parts)
        # Rank r's rows are exactly rows [r*B/W, (r+1)*B/W) of the single-process batch.
        np.testing.assert_array_equal(np.concatenate([q.numpy() for q in parts]), full.input_ids)
        seen = np.concatenate([q.numpy().ravel() for q in parts])
        assert len(np.unique(seen)) == len(seen)  # disjoint


@PROFILE
@given(layouts(), st.data())
def test_stream_resume_yields_identical_batches(lay: dict, data: st.DataObject) -> None:
    tokens = np.arange(lay["n"], dtype=np.int64)
    _, full = _batches(tokens, lay)
    k = data.draw(st.integers(0, len(full)))
    first = StreamIterator(tokens, lay["batch"], lay["tgt"], varlen=lay["varlen"], seed=lay["seed"])
    gen = iter(first)
    for _ in range(k):
        next(gen)
    state = json.loads(json.dumps(first.state_dict()))  # it must survive JSON
    # Resume under another world size: the union of ranks continues exactly.
    W = lay["world"]
    rest = []
    for r in range(W):
        again = StreamIterator(
            tokens,
            lay["batch"],
            lay["tgt"],
            rank=r,
            world_size=W,
            varlen=lay["varlen"],
            seed=lay["seed"],
        )
        again.load_state_dict(state)
        rest.append(list(again) if k < len(full) else [])
    for t in range(k, len(full)):
        got = np.concatenate([rest[r][t - k].input_ids.numpy() for r in range(W)])
        np.testing.assert_array_equal(got, full[t].input_ids)
    assert all(len(r) == len(full) - k for r in rest)


@PROFILE
@given(layouts(), st.data())
def test_stream_reset_flags_mark_document_starts(lay: dict, data: st.DataObject) -> None:
    n = lay["n"]
    tokens = np.arange(n, dtype=np.int64)
    starts = sorted(set(data.draw(st.lists(st.integers(0, n - 1), max_size=12))) | {0})
    doc = np.asarray(starts, dtype=np.int64)
    _, batches = _batches(tokens, lay, doc_starts=doc, doc_mode="reset")
    is_start = np.zeros(n, dtype=bool)
    is_start[doc] = True
    for t, b in enumerate(batches):
        assert b.reset is not None and b.reset.shape == b.input_ids.shape
        expect = is_start[b.input_ids.numpy()]
        if t == 0:
            expect[:, 0] = True  # every row starts afresh in an epoch's first batch
        np.testing.assert_array_equal(b.reset.numpy(), expect)


@PROFILE
@given(
    st.integers(1, 40),
    st.integers(1, 6),
    st.integers(1, 12),
    st.integers(-2, 0),
)
def test_stream_bad_sizes_raise_data_error(n: int, batch: int, tgt: int, bad: int) -> None:
    tokens = np.arange(n, dtype=np.int64)
    for args in [(batch, bad), (bad, tgt)]:
        with pytest.raises(DataError):
            StreamIterator(tokens, *args)
    if (n - 1) // batch < tgt:
        with pytest.raises(DataError, match="too few"):
            StreamIterator(tokens, batch, tgt)
