"""Classification data: ``classes:DIR`` (labels, the seeded stratified split, given split
folders, bad datasets) and the length-bucketed document batches (every document once an
epoch, little padding, exact resume, ranks' rows)."""

from __future__ import annotations

import json
import string
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.classify import label_folders, marker_documents
from txlm.classify.classes import open_classes
from txlm.classify.documents import DocumentBatches
from txlm.data.vocab import Vocab
from txlm.errors import DataError

VOCAB = Vocab.build_char(Counter(string.ascii_letters + string.digits + " \n"), unk=True)


def _folders(tmp_path: Path, n: dict[str, int]) -> Path:
    docs = {
        label: [f"{label} doc {i} " + "ab" * (i + 1) for i in range(k)] for label, k in n.items()
    }
    return label_folders(tmp_path / "ds", docs)


def test_labels_are_sorted_folder_names_and_the_split_is_stratified(tmp_path) -> None:
    root = _folders(tmp_path, {"zeta": 20, "alpha": 10, "mid": 30})
    data = open_classes(f"classes:{root}", VOCAB, seed=3, valid_fraction=0.1, test_fraction=0.2)
    assert data.labels == ["alpha", "mid", "zeta"]
    per = {s: Counter(data.split(s).labels.tolist()) for s in ("train", "valid", "test")}
    # each label's share: test 20%, valid 10% of its own documents (rounded), train the rest
    assert per["test"] == {0: 2, 1: 6, 2: 4}
    assert per["valid"] == {0: 1, 1: 3, 2: 2}
    assert per["train"] == {0: 7, 1: 21, 2: 14}
    files = [f for s in ("train", "valid", "test") for f in data.split(s).files]
    assert sorted(files) == sorted(p.relative_to(root).as_posix() for p in root.rglob("*.txt"))
    # label ids follow the folders: a document of mid/ has label 1
    for s in ("train", "valid", "test"):
        d = data.split(s)
        assert [data.labels[i] for i in d.labels] == [f.split("/")[0] for f in d.files]
        # encoded with the given vocabulary
        assert VOCAB.decode(d.docs[0]) == (root / d.files[0]).read_text()


def test_the_split_is_a_function_of_the_seed_and_is_recorded(tmp_path) -> None:
    root = _folders(tmp_path, {"a": 12, "b": 12})
    one = open_classes(f"classes:{root}", VOCAB, seed=1)
    again = open_classes(f"classes:{root}", VOCAB, seed=1)
    other = open_classes(f"classes:{root}", VOCAB, seed=2)
    assert one.meta == again.meta
    assert one.meta["files"]["test"] != other.meta["files"]["test"]
    assert one.meta["split"] == {"given": False, "seed": 1, "valid_fraction": 0.1,
                                 "test_fraction": 0.1}  # fmt: skip
    written = one.record(tmp_path / "data")
    assert written.parent.parent == tmp_path / "data" / "classes"
    assert json.loads(written.read_text()) == one.meta


def test_split_folders_are_used_as_given(tmp_path) -> None:
    root = marker_documents(tmp_path / "ds", {"train": 3, "valid": 2, "test": 1})
    data = open_classes(f"classes:{root}", VOCAB, seed=5)
    assert data.meta["split"] == {"given": True}
    assert [len(data.split(s)) for s in ("train", "valid", "test")] == [6, 4, 2]
    assert all(f.startswith("valid/") for f in data.split("valid").files)


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda r: label_folders(r, {"only": ["a", "b", "c"]}), "at least two label folders"),
        (lambda r: (label_folders(r, {"a": ["x"] * 3}), (r / "b").mkdir()), "holds no .txt"),
        (lambda r: label_folders(r, {"a": ["x"] * 3, "b": ["y", "", "z"]}), "is empty"),
        (lambda r: label_folders(r, {"a": ["x"] * 3, "b": ["y", "  \n", "z"]}), "is empty"),
        (
            lambda r: (
                label_folders(r, {"a": ["x"] * 3, "b": ["y"] * 3}),
                (r / "b" / "001.txt").write_bytes(b"\xff\xfe\x00bad"),
            ),
            "not UTF-8",
        ),
        (
            lambda r: (
                label_folders(r, {"a": ["x"] * 3, "b": ["y"] * 3}),
                (r / "b" / "001.txt").unlink(),
                (r / "b" / "001.txt").mkdir(),  # a name that cannot be read as a file
            ),
            "cannot read document",
        ),
        (lambda r: label_folders(r, {"a": ["x"], "b": ["y"]}), "valid split holds no"),
    ],
    ids=["one-label", "empty-folder", "empty-doc", "blank-doc", "not-utf8", "unreadable", "tiny"],
)
def test_a_bad_dataset_is_one_data_error(tmp_path, build, needle) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    build(root)
    with pytest.raises(DataError, match=needle):
        open_classes(f"classes:{root}", VOCAB)


# -- batches ----------------------------------------------------------------------------------
def _documents(n: int = 50, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 120, size=n)
    from txlm.classify.classes import Documents

    docs = [rng.integers(1, 10, size=int(k)) for k in lengths]
    return Documents(docs, rng.integers(0, 3, size=n), [f"{i}.txt" for i in range(n)])


def _real(batch) -> list[list[int]]:
    """Each row's document (its ids from ``start`` on)."""
    return [row[s:].tolist() for row, s in zip(batch.input_ids, batch.start.tolist(), strict=True)]


def test_an_epoch_holds_every_document_right_aligned_with_little_padding() -> None:
    docs = _documents()
    batches = DocumentBatches(docs, batch_size=8, tgt_len=16, seed=0, pool=4)
    seen: Counter = Counter()
    padded = 0
    for batch in batches:
        assert batch.input_ids.size(1) % 16 == 0
        rows = _real(batch)
        # a row's width is its batch's longest document rounded up to a segment
        assert batch.input_ids.size(1) == -(-max(map(len, rows)) // 16) * 16
        padded += int(batch.start.sum())
        for ids, label in zip(rows, batch.labels.tolist(), strict=True):
            i = next(j for j, d in enumerate(docs.docs) if d.tolist() == ids)
            assert docs.labels[i] == label
            seen[i] += 1
    # 50 documents in batches of 8: 56 rows, the first 6 of the epoch's order repeated
    assert len(seen) == 50 and sum(seen.values()) == 56 and max(seen.values()) == 2
    # length buckets: less padding than the same rows in batches of the raw shuffled order
    order = np.resize(np.random.default_rng([0, 0]).permutation(50), 56).reshape(-1, 8)
    lengths = docs.lengths()
    unsorted = sum(int((-(-lengths[b].max() // 16) * 16 - lengths[b]).sum()) for b in order)
    assert padded < 0.6 * unsorted


def test_a_resumed_iterator_yields_the_same_batches_across_epochs() -> None:
    docs = _documents(20)
    straight = DocumentBatches(docs, batch_size=4, tgt_len=8, seed=7)
    ref = [b for _ in range(3) for b in straight]  # three epochs of 5 batches
    paused = DocumentBatches(docs, batch_size=4, tgt_len=8, seed=7)
    it = iter(paused)
    first = [next(it) for _ in range(5)]
    it = iter(paused)  # the next epoch
    first += [next(it), next(it)]
    state = json.loads(json.dumps(paused.state_dict()))
    resumed = DocumentBatches(docs, batch_size=4, tgt_len=8, seed=7)
    resumed.load_state_dict(state)
    rest = [b for b in resumed] + [b for b in resumed]
    got = first + rest
    assert len(got) == len(ref) == 15
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.start, b.start)
        assert torch.equal(a.labels, b.labels) and (a.epoch, a.index) == (b.epoch, b.index)
    assert ref[0].epoch == 0 and ref[-1].epoch == 2
    other = DocumentBatches(docs, batch_size=2, tgt_len=8, seed=7)
    with pytest.raises(DataError, match="batch_size"):
        other.load_state_dict(state)


def test_ranks_take_contiguous_rows_of_the_global_batch() -> None:
    docs = _documents(30)
    whole = list(DocumentBatches(docs, batch_size=6, tgt_len=8, seed=1))
    parts = [list(DocumentBatches(docs, batch_size=6, tgt_len=8, seed=1, rank=r, world_size=3))
             for r in range(3)]  # fmt: skip
    for i, batch in enumerate(whole):
        rows = [ids for r in range(3) for ids in _real(parts[r][i])]
        assert rows == _real(batch)
        labels = torch.cat([parts[r][i].labels for r in range(3)])
        assert torch.equal(labels, batch.labels)
