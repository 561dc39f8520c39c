"""The recall task as a prepared dataset: layout, copies, uniqueness, caching, bad names."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers.train import txlm
from txlm.data import StreamIterator, load_prepared, prepare_dataset
from txlm.data.recall import RecallSpec, copy_distances, generate, generate_pairs, parse_spec
from txlm.errors import DataError

SETTINGS = (
    "alphabet=128,span=6,min_dist=6,max_dist=120,train_max_dist=40,train=6000,valid=3000,test=3000"
)
SMALL = "recall:" + SETTINGS


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return prepare_dataset(SMALL, tmp_path_factory.mktemp("recall"), progress=False)


def test_layout_is_the_ordinary_prepared_one(small):
    expected = "recall-" + "-".join(x.replace("=", "") for x in SETTINGS.split(","))
    assert small.name == expected
    assert sorted(os.listdir(small)) == [
        "meta.json", "test.bin", "test.copy.bin", "train.bin", "train.copy.bin", "valid.bin",
        "valid.copy.bin", "vocab.json",
    ]  # fmt: skip
    corpus = load_prepared(small)
    assert corpus.level == "char" and corpus.metric == "bpc" and len(corpus.vocab) == 128
    assert corpus.vocab.unk is None
    for split, n in (("train", 6000), ("valid", 3000), ("test", 3000)):
        assert len(corpus.split(split)) == n
        assert corpus.doc_starts(split).tolist() == [0]
    # the ordinary iterator reads it
    batch = next(iter(StreamIterator(corpus.split("train"), 4, 16)))
    assert batch.input_ids.shape == (4, 16)
    assert json.loads((small / "meta.json").read_text())["corpus"]["spec"]["span"] == 6


@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_every_flagged_token_copies_its_source_and_is_the_only_match(small, split):
    corpus = load_prepared(small)
    tokens = np.asarray(corpus.split(split), dtype=np.int64)
    dist = np.asarray(copy_distances(small, split))
    copies = np.flatnonzero(dist)
    longest = 40 if split == "train" else 120
    assert len(copies) > 0.3 * len(tokens)
    assert dist.min() == 0 and dist[copies].min() >= 6
    # a copy waits only when others are due: its distance is the drawn one, rounded up to the
    # next span boundary, and rarely more
    assert np.mean(dist[copies] <= longest + 6) > 0.95
    assert np.array_equal(tokens[copies], tokens[copies - dist[copies]])
    # the token before a copy token occurs exactly once in the window back to its source:
    # looking it up there (and reading what followed) is unambiguous
    for t in copies[:400]:
        prev = tokens[t - 1]
        window = tokens[t - 1 - dist[t] : t - 1]
        assert np.flatnonzero(window == prev).tolist() == [0]
    # the first symbol of a recurrence is not flagged: nothing announces which span recurs
    starts = copies[dist[copies - 1] != dist[copies]]
    assert np.all(tokens[starts - 1] == tokens[starts - 1 - dist[starts]])


def _runs(dist: np.ndarray) -> list[tuple[int, int]]:
    """(distance, length) of each copy: a run of equal non-zero distances."""
    out, t = [], 0
    while t < len(dist):
        if dist[t]:
            u = t
            while u < len(dist) and dist[u] == dist[t]:
                u += 1
            out.append((int(dist[t]), u - t))
            t = u
        else:
            t += 1
    return out


def test_span_lengths_fixed_by_default_and_varied_on_request():
    fixed = _runs(generate(RecallSpec(alphabet=40, span=8, min_dist=8, max_dist=60), 5000,
                           np.random.default_rng(0))[1])  # fmt: skip
    # one length: every copy has span - 1 flagged tokens and lies a multiple of span back
    assert {n for _, n in fixed[:-1]} == {7} and {d % 8 for d, _ in fixed} == {0}
    spec = RecallSpec(alphabet=40, span=8, min_span=3, min_dist=8, max_dist=60)
    varied = _runs(generate(spec, 5000, np.random.default_rng(0))[1])
    assert {n for _, n in varied[:-1]} == set(range(2, 8))  # the last may be cut short
    assert len({d % 8 for d, _ in varied}) == 8


@pytest.mark.parametrize("longest", [40, 150])
def test_pairs_form_value_follows_its_key_query_and_the_pair_is_unique_in_view(longest):
    spec = RecallSpec(alphabet=120, keys=12, values=8, min_dist=2, max_dist=150)
    symbols, dist = generate_pairs(spec, 20_000, np.random.default_rng(0), max_dist=longest)
    n_pairs = 12 * 8
    query0, value0 = n_pairs, n_pairs + 12
    copies = np.flatnonzero(dist)
    assert len(copies) > 0.04 * len(symbols)
    assert dist[copies].min() == 2 and np.mean(dist[copies] <= longest + 2) > 0.95
    source = copies - dist[copies]
    # the copy is the value stored by its source pair, and the token before it is the query
    # of that pair's key; nothing else is flagged
    assert np.all(symbols[source] < n_pairs)
    assert np.array_equal(symbols[copies], value0 + symbols[source] % 8)
    assert np.array_equal(symbols[copies - 1], query0 + symbols[source] // 8)
    assert np.all((symbols[dist == 0] < value0) | (symbols[dist == 0] >= value0 + 8))
    # within the window a model is asked to reach (the fresh one, max_dist, plus d), the
    # query's key has exactly one pair: its own
    for t in copies[:2000]:
        key = symbols[t - 1] - query0
        lo = max(0, t - 1 - longest - dist[t])
        window = symbols[lo : t - 1]
        hits = np.flatnonzero((window < n_pairs) & (window // 8 == key))
        assert (lo + hits).tolist() == [source[np.searchsorted(copies, t)]]
    # every key and every value is used; filler fills the rest
    assert set(symbols[copies - 1] - query0) == set(range(12))
    assert set(symbols[copies] - value0) == set(range(8))
    assert symbols.max() == 119


def test_pairs_form_needs_a_filler_symbol():
    with pytest.raises(DataError, match="no filler"):
        parse_spec("recall:alphabet=98,keys=10,values=8,min_dist=2")
    assert parse_spec("recall:alphabet=99,keys=10,values=8,min_dist=2").alphabet == 99
    assert parse_spec("recall:alphabet=302,keys=32,values=8,min_dist=2").keys == 32


def test_deterministic_and_cached(tmp_path, small):
    again = prepare_dataset(SMALL, tmp_path, progress=False)
    for f in ("train.bin", "valid.copy.bin", "vocab.json"):
        assert (again / f).read_bytes() == (small / f).read_bytes()
    meta = again / "meta.json"
    before = meta.stat().st_mtime_ns
    assert prepare_dataset(SMALL, tmp_path, progress=False) == again
    assert meta.stat().st_mtime_ns == before
    other = prepare_dataset(SMALL + ",seed=1", tmp_path, progress=False)
    assert (other / "train.bin").read_bytes() != (again / "train.bin").read_bytes()


@pytest.mark.parametrize(
    "name, message",
    [
        ("recall:span=1", "span must be"),
        ("recall:alphabet=400", "alphabet must be"),
        ("recall:min_dist=4", "span <= min_dist"),
        ("recall:colour=3", "expected key=value"),
        ("recall:span=x", "must be an integer"),
        ("recall:train=100", "too short"),
    ],
)
def test_bad_names_are_one_line_errors_and_write_nothing(tmp_path, name, message):
    with pytest.raises(DataError, match=message):
        parse_spec(name)
    data = tmp_path / "data"
    r = txlm(["prepare", name, "--data-dir", str(data)], data, timeout=60)  # forked CLI
    assert r.returncode == 2 and r.stderr.startswith("txlm: error: recall:")
    assert len(r.stderr.strip().splitlines()) == 1
    assert not data.exists()


def test_copy_distances_refuses_other_datasets(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"dataset": "shakespeare", "splits": {}}))
    with pytest.raises(DataError, match="not a recall dataset"):
        copy_distances(tmp_path, "valid")
