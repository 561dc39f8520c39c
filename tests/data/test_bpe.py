"""Byte-level BPE vocabularies: round trips, ids, files and fingerprints, prepare, metrics."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.reliability import corpus_text
from txlm.data import Vocab, load_prepared, prepare_dataset
from txlm.data.bpe import suggest_cutoffs, token_counts, train_bpe
from txlm.data.metrics import metric_value
from txlm.data.vocab import EOS, BPEVocab, safe_pieces
from txlm.errors import DataError

pytest.importorskip("tokenizers")

TRAIN = corpus_text(300) + "Ünïcödé, naïve café — 日本語のテキスト ✓ 😀\n\ttabs\tand  spaces \n"


@functools.cache
def vocab() -> BPEVocab:
    return train_bpe([TRAIN], 400)


# Text with the characters that make tokenisation hard: whitespace runs, newlines,
# punctuation, letters of several scripts, emoji, control characters. (Surrogates cannot be
# UTF-8 and are not text.)
ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)
TRICKY = st.text(
    st.sampled_from(list(" \n\n\t\r.,'!?aZé日😀\u00a0\u2028\u180e\x1c<eos>")), max_size=300
)


@settings(max_examples=300, deadline=None)
@given(ANY_TEXT)
def test_any_unicode_text_decodes_back_to_itself(text):
    v = vocab()
    ids = v.encode(text)
    assert v.decode(ids) == text
    assert EOS not in [v.symbols[i] for i in ids]  # a literal "<eos>" stays five characters


@settings(max_examples=300, deadline=None)
@given(st.one_of(TRICKY, ANY_TEXT), st.integers(1, 40))
def test_encoding_in_pieces_gives_the_tokens_of_the_whole(text, size):
    """Long text is encoded in pieces (in parallel); the cuts must not change a token."""
    v = vocab()
    whole = v._tok.encode(text, add_special_tokens=False).ids
    pieces = safe_pieces(text, size)
    assert "".join(pieces) == text
    assert [i for p in pieces for i in v._tok.encode(p, add_special_tokens=False).ids] == whole
    assert v.encode(text) == whole


def test_eos_first_then_ids_by_train_count():
    v = vocab()
    assert v.eos == EOS and v.eos_id == 0 and v.doc_start_id == 0 and v.unk is None
    counts = token_counts(v, [TRAIN])
    assert counts[0] == 0  # text never encodes to <eos>
    rest = counts[1:]
    assert (np.diff(rest) <= 0).all()  # most frequent first: the adaptive softmax's head
    assert 257 < len(v) <= 400 and len(set(v.symbols)) == len(v)


def test_small_corpus_learns_fewer_tokens_than_asked():
    v = train_bpe(["abcabc abcabc xyz\n" * 3], 8192)
    assert 257 <= len(v) < 300  # merges seen once are not learnt
    assert v.decode(v.encode("abcabc xyz")) == "abcabc xyz"


def test_files_fingerprint_and_tampering(tmp_path):
    v = vocab()
    v.save(tmp_path / "vocab.json")
    assert {p.name for p in tmp_path.iterdir()} == {"vocab.json", "tokenizer.json"}
    loaded = Vocab.load(tmp_path / "vocab.json")
    assert isinstance(loaded, BPEVocab)
    assert loaded.fingerprint == v.fingerprint and loaded.symbols == v.symbols
    assert loaded.encode(TRAIN) == v.encode(TRAIN)
    # The tokenizer's own file: the tokenizers library reads it as it is.
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).decode(v.encode("café")) == "café"

    data = json.loads((tmp_path / "tokenizer.json").read_text())
    voc = data["model"]["vocab"]
    voc["a"], voc["e"] = voc["e"], voc["a"]  # a well-formed tokenizer that numbers differently
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"does not match vocab\.json"):
        Vocab.load(tmp_path / "vocab.json")
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"tokenizer\.json is missing"):
        Vocab.load(tmp_path / "vocab.json")
    with pytest.raises(DataError, match=r"Vocab\.load"):
        Vocab.from_json(v.to_json())


def test_merges_are_part_of_the_fingerprint():
    v = vocab()
    data = json.loads(v.tokenizer_json)
    data["model"]["merges"] = data["model"]["merges"][:-1]
    other = BPEVocab.from_tokenizer_json(json.dumps(data))
    assert other.symbols == v.symbols and other.fingerprint != v.fingerprint


@pytest.mark.parametrize(
    ("texts", "size", "message"),
    [
        ([TRAIN], 256, "byte alphabet"),
        ([""], 1000, "empty"),
        (["zzzzzzzz", "zz"], 1000, "one character"),
    ],
)
def test_bad_input(texts, size, message):
    with pytest.raises(DataError, match=message):
        train_bpe(texts, size)


def test_suggested_cutoffs_cover_the_train_tokens():
    counts = np.array([0] + [1000 // (i + 1) for i in range(4000)])
    cut = suggest_cutoffs(counts)
    sorted_counts = np.sort(counts)[::-1]
    assert len(cut) == 2 and cut[0] % 256 == 0 and cut[0] < cut[1] < len(counts)
    assert sorted_counts[: cut[0]].sum() >= 0.8 * counts.sum()
    assert sorted_counts[: cut[1]].sum() >= 0.95 * counts.sum()


# -- prepare ------------------------------------------------------------------------------


def _docs(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    lines = TRAIN.splitlines(keepends=True)
    for i in range(12):  # 12 documents: 10 train, 1 valid, 1 test
        (folder / f"{i:02d}.txt").write_text("".join(lines[i * 25 : (i + 1) * 25]) + f"№{i}\n")
    return folder


def test_prepare_bpe_corpus(tmp_path):
    folder = _docs(tmp_path)
    path = prepare_dataset(f"text:{folder}", tmp_path / "data", level="bpe", vocab_size=320)
    assert path.name == "text-docs-bpe"
    assert (path / "tokenizer.json").is_file()
    c = load_prepared(path)
    assert isinstance(c.vocab, BPEVocab) and c.metric == "bpb" and c.level == "bpe"
    assert c.meta["options"] == {"vocab_size": 320}
    files = sorted(folder.glob("*.txt"))
    train = np.asarray(c.split("train"))
    starts = c.doc_starts("train")
    assert len(starts) == 10 and (train[starts] == c.vocab.eos_id).all()  # <eos> opens each
    # The split decodes back to its documents exactly, <eos> at each start.
    expected = "".join(EOS + f.read_text() for f in files[:10])
    assert c.vocab.decode(train) == expected
    # ids numbered by their count in train.bin itself (written before the renumbering)
    assert (np.diff(np.bincount(train, minlength=len(c.vocab))[1:]) <= 0).all()
    info = c.meta["splits"]["train"]
    assert info["text_bytes"] == sum(len(f.read_bytes()) for f in files[:10])
    assert c.tokens_per_byte("train") == pytest.approx(info["tokens"] / info["text_bytes"])
    assert c.metric_value(1.0, "train") == pytest.approx(c.tokens_per_byte("train") / math.log(2))

    # Options not given: the existing copy is found as it is (what txlm train does) ...
    stamp = (path / "meta.json").stat().st_mtime_ns
    again = prepare_dataset(f"text:{folder}", tmp_path / "data", level="bpe")
    assert again == path and (path / "meta.json").stat().st_mtime_ns == stamp
    # ... a new size rebuilds it.
    prepare_dataset(f"text:{folder}", tmp_path / "data", level="bpe", vocab_size=300)
    assert len(load_prepared(path).vocab) == 300
    # An edited tokenizer.json makes the copy stale: prepare rebuilds, load refuses.
    shutil.copy(path / "tokenizer.json", tmp_path / "t.json")
    data = json.loads((path / "tokenizer.json").read_text())
    v = data["model"]["vocab"]
    v["a"], v["e"] = v["e"], v["a"]
    (path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match="does not match"):
        load_prepared(path)
    prepare_dataset(f"text:{folder}", tmp_path / "data", level="bpe")
    assert (
        load_prepared(path).vocab.fingerprint
        == json.loads((path / "meta.json").read_text())["vocab_fingerprint"]
    )


def test_bits_per_byte_equal_bits_per_character_on_ascii():
    """One byte per character: the same loss per byte reads the same at both levels."""
    # A char model's loss per token on ASCII text *is* its loss per byte.
    assert metric_value(0.9, "bpb", tokens_per_byte=1.0) == metric_value(0.9, "bpc")
    # Four bytes per token: a loss per token of 4 x 0.9 nats is 0.9 nats per byte.
    assert metric_value(3.6, "bpb", tokens_per_byte=0.25) == pytest.approx(0.9 / math.log(2))
    with pytest.raises(ValueError, match="tokens_per_byte"):
        metric_value(1.0, "bpb")


# -- word level: bounded vocabularies ------------------------------------------------------


def test_word_vocabulary_bounds_and_unk_counts(tmp_path):
    text = "".join(f"common{i % 3} rare{i} common{i % 3}\n" for i in range(60))
    (tmp_path / "w.txt").write_text(text)
    name = f"text:{tmp_path / 'w.txt'}"
    path = prepare_dataset(name, tmp_path / "d", level="word", max_vocab=5)
    c = load_prepared(path)
    assert c.vocab.symbols == ["<unk>", "<eos>", "common0", "common1", "common2"]
    for split in ("train", "valid", "test"):
        ids = np.asarray(c.split(split))
        # every rareN is seen once: each line holds exactly one <unk>
        assert c.unk_tokens(split) == int((ids == c.vocab.unk_id).sum())
        assert c.unk_tokens(split) == int((ids == c.vocab.eos_id).sum()) > 0
    assert c.meta["options"] == {"min_freq": 1, "max_vocab": 5}

    # Options not given are kept from the existing copy; max_vocab=0 lifts the cap.
    path = prepare_dataset(name, tmp_path / "d", level="word", min_freq=2)
    assert len(load_prepared(path).vocab) == 5
    path = prepare_dataset(name, tmp_path / "d", level="word", max_vocab=0)
    c = load_prepared(path)
    assert sorted(c.vocab.symbols[2:]) == ["common0", "common1", "common2"]
    assert c.meta["options"] == {"min_freq": 2, "max_vocab": None}
    with pytest.raises(DataError, match="--vocab-size is for --level bpe"):
        prepare_dataset(name, tmp_path / "d", level="word", vocab_size=1000)
    with pytest.raises(DataError, match="--max-vocab"):
        prepare_dataset(name, tmp_path / "d", level="word", max_vocab=2)


def test_throughput_benchmark_reports_the_three_levels(tmp_path):
    """benchmarks/data_throughput.py --sections tokenize: tokens/s for char, word and bpe
    on one corpus, and bytes per token that order as the levels must (char 1, bpe between)."""
    import subprocess
    import sys

    (tmp_path / "c.txt").write_text(TRAIN * 3)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "data_throughput.py"
    p = subprocess.run(
        [sys.executable, str(script), "--sections", "tokenize", "--corpus",
         str(tmp_path / "c.txt"), "--vocab-size", "300", "--out", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    levels = json.loads((tmp_path / "r.json").read_text())["tokenize"]["levels"]
    assert set(levels) == {"char", "word", "bpe"}
    assert all(v["encode_tokens_per_s"] > 0 for v in levels.values())
    bpt = {k: v["bytes_per_token"] for k, v in levels.items()}
    assert bpt["char"] < bpt["bpe"] < bpt["word"] and bpt["char"] == pytest.approx(
        len((TRAIN * 3).encode()) / len(TRAIN * 3), 1e-3
    )
