"""Vocabulary contracts: exact round trips where the level allows, JSON, fingerprints."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txlm.data import Vocab
from txlm.errors import DataError


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1, max_size=300))
def test_char_round_trip_is_exact(text):
    vocab = Vocab.build_char(Counter(text))
    assert vocab.decode(vocab.encode(text)) == text


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=300))
def test_byte_round_trip_is_exact(data):
    vocab = Vocab.byte_level()
    ids = vocab.encode(data)
    assert bytes(ids) == data and len(vocab) == 256


words = st.text(alphabet="abcxyz<>_", min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(words, max_size=8), min_size=1, max_size=10))
def test_word_round_trip_of_normalised_text(lines):
    text = "".join(" ".join(line) + "\n" for line in lines)
    vocab = Vocab.build_word(Counter(text.split()))
    ids = vocab.encode(text)
    assert ids.count(vocab.eos_id) == len(lines)
    assert vocab.decode(ids) == text


def test_unknowns_map_to_unk_or_fail_clearly():
    vocab = Vocab.build_char(Counter("abc"))
    assert vocab.encode("abz") == [0, 1, vocab.unk_id]
    strict = Vocab.build_char(Counter("abc"), unk=False)
    assert strict.unk_id is None
    with pytest.raises(DataError, match="not in the vocabulary"):
        strict.encode("z")
    w = Vocab.build_word(Counter({"a": 3, "b": 1}), min_freq=2)
    assert w.encode("a b\n") == [w.id_of("a"), w.unk_id, w.eos_id]


def test_word_vocab_order_min_freq_and_max_size():
    counts = Counter({"the": 10, "a": 10, "cat": 3, "dog": 1})
    v = Vocab.build_word(counts)
    assert v.symbols == ["<unk>", "<eos>", "a", "the", "cat", "dog"]
    assert Vocab.build_word(counts, min_freq=2).symbols[-1] == "cat"
    assert len(Vocab.build_word(counts, max_size=4)) == 4


def test_json_round_trip_and_fingerprint(tmp_path):
    v = Vocab.build_word(Counter(["x", "y", "z", "y"]))
    again = Vocab.from_json(v.to_json())
    assert again.symbols == v.symbols and again.fingerprint == v.fingerprint
    assert (again.unk_id, again.eos_id) == (v.unk_id, v.eos_id)
    v.save(tmp_path / "vocab.json")
    assert Vocab.load(tmp_path / "vocab.json").fingerprint == v.fingerprint
    # the fingerprint depends on symbol order, so a reordered vocabulary is detected
    other = Vocab(list(reversed(v.symbols)), "word", unk="<unk>", eos="<eos>")
    assert other.fingerprint != v.fingerprint
    assert v.fingerprint == Vocab.from_json(v.to_json()).fingerprint  # stable


def test_tampered_or_foreign_json_is_refused(tmp_path):
    v = Vocab.build_char(Counter("abc"))
    text = v.to_json().replace('"a"', '"q"')
    with pytest.raises(DataError, match="fingerprint"):
        Vocab.from_json(text)
    with pytest.raises(DataError, match="not a txlm vocabulary"):
        Vocab.from_json('{"symbols": []}')
    with pytest.raises(DataError, match="not valid JSON"):
        Vocab.from_json("{")
    with pytest.raises(DataError, match="not found"):
        Vocab.load(tmp_path / "missing.json")


def test_bos_lines_for_sentence_corpora():
    v = Vocab(["<S>", "</S>", "<UNK>", "hi", "there"], "word", unk="<UNK>", eos="</S>", bos="<S>")
    ids, starts = v.encode_lines("hi there\nthere\n")
    assert ids == [0, 3, 4, 1, 0, 4, 1] and starts == [0, 4]
    assert v.decode(ids) == "hi there\nthere\n"


def test_dtype_is_the_smallest_that_fits():
    assert Vocab.byte_level().dtype.name == "uint8"
    assert Vocab([str(i) for i in range(257)], "word").dtype.name == "uint16"
    assert Vocab([str(i) for i in range(70000)], "word").dtype.name == "uint32"
