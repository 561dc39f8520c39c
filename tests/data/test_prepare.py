"""prepare / load_prepared: Shakespeare, the user's own text, caching, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.env import subprocess_env
from txlm.cli import main
from txlm.data import load_prepared, prepare_dataset, splits
from txlm.data.corpora import SHAKESPEARE_TEST, SHAKESPEARE_VALID, shakespeare_files
from txlm.errors import DataError


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> Path:
    return prepare_dataset("shakespeare", tmp_path_factory.mktemp("data"), progress=False)


def _read(p: Path) -> str:
    return p.read_bytes().decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n")


def test_shakespeare_layout_split_and_round_trip(shakespeare):
    assert sorted(os.listdir(shakespeare)) == [
        "meta.json",
        "test.bin",
        "train.bin",
        "valid.bin",
        "vocab.json",
    ]
    corpus = load_prepared(shakespeare)
    assert corpus.level == "char" and corpus.meta["metric"] == "bpc"
    assert corpus.meta["dtype"] == "uint8"
    files = shakespeare_files()
    assert len(files["train"]) == 38 and len(files["valid"]) == len(files["test"]) == 2
    assert corpus.meta["corpus"]["valid"] == list(SHAKESPEARE_VALID)
    assert corpus.meta["corpus"]["test"] == list(SHAKESPEARE_TEST)
    train = corpus.split("train")
    assert isinstance(train, np.memmap) and not train.flags.writeable
    texts = [_read(p) for p in files["train"]]
    # one document per work, at the offsets where each work begins
    starts = corpus.doc_starts("train")
    assert starts.tolist() == np.cumsum([0] + [len(t) for t in texts[:-1]]).tolist()
    assert corpus.vocab.decode(train[: len(texts[0])]) == texts[0]
    whole = corpus.vocab.encode_array("".join(texts))
    assert np.array_equal(train, whole) and corpus.vocab.unk_id not in set(np.unique(train))
    valid_text = "".join(_read(p) for p in files["valid"])
    assert len(corpus.split("valid")) == len(valid_text)
    assert corpus.meta["vocab_fingerprint"] == corpus.vocab.fingerprint
    # characters unseen in train (say, in a prompt) become <unk>
    assert corpus.vocab.encode("Ω")[0] == corpus.vocab.unk_id == len(corpus.vocab) - 1
    assert all(len(s["sha256"]) == 64 for s in corpus.meta["sources"])


def test_the_default_preset_counts_the_model_the_default_run_trains(shakespeare):
    """`txlm info` counts shakespeare-char at the vocabulary its corpus gives (the README's
    parameter count is that model's)."""
    from txlm.config import PRESETS

    assert PRESETS["shakespeare-char"].model["vocab_size"] == len(load_prepared(shakespeare).vocab)


def test_second_call_reuses_the_cache_and_force_rebuilds(shakespeare):
    meta = shakespeare / "meta.json"
    before = meta.stat().st_mtime_ns
    assert prepare_dataset("shakespeare", shakespeare.parent, progress=False) == shakespeare
    assert meta.stat().st_mtime_ns == before
    prepare_dataset("shakespeare", shakespeare.parent, progress=False, force=True)
    assert meta.stat().st_mtime_ns != before
    assert not [p for p in shakespeare.parent.iterdir() if p.name.startswith(".")]


def test_shakespeare_word_level(tmp_path):
    path = prepare_dataset("shakespeare", tmp_path, level="word", min_freq=2, progress=False)
    corpus = load_prepared(path)
    assert path.name == "shakespeare-word" and corpus.meta["metric"] == "ppl"
    assert corpus.vocab.symbols[:2] == ["<unk>", "<eos>"]
    assert corpus.meta["dtype"] == "uint16"
    text = corpus.vocab.decode(corpus.split("valid")[:200])
    assert text.count("\n") == int((corpus.split("valid")[:200] == corpus.vocab.eos_id).sum())


def test_user_folder_is_one_document_per_file(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    docs = [f"note number {i}\nwith some text é x{i}\n" for i in range(12)]
    for i, d in enumerate(docs):
        (folder / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    path = prepare_dataset(f"text:{folder}", tmp_path / "data", progress=False)
    c = load_prepared(path)
    assert path.name == "text-notes"
    assert c.vocab.decode(c.split("train")) == "".join(docs[:10])
    assert c.vocab.decode(c.split("valid")) == docs[10]
    assert c.vocab.decode(c.split("test")) == docs[11]
    assert len(c.doc_starts("train")) == 10
    w = load_prepared(prepare_dataset(f"text:{folder}", tmp_path / "data", level="word"))
    assert w.vocab.decode(w.split("train")) == "".join(docs[:10])
    assert w.vocab.decode(w.split("test")).endswith("<unk>\n")  # unseen words


def test_user_file_blank_line_documents_and_char_split(tmp_path):
    text = "".join(f"document {i}\nline two of {i}\n\n\n" for i in range(6)) * 20
    f = tmp_path / "book.txt"
    f.write_text(text, encoding="utf-8")
    c = load_prepared(prepare_dataset(f"text:{f}", tmp_path / "data", progress=False))
    whole = "".join(c.vocab.decode(c.split(s)) for s in ("train", "valid", "test"))
    assert whole == text  # nothing lost at the cuts
    train = c.vocab.decode(c.split("train"))
    assert len(train) == pytest.approx(0.9 * len(text), rel=0.02)
    # a document starts after every run of two or more blank lines
    expect = [0] + [i + 3 for i in range(len(train)) if train.startswith("\n\n\n", i)]
    assert c.doc_starts("train").tolist() == [e for e in expect if e < len(train)]


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main(["prepare", *argv, "--no-progress"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"", "is empty"),
        (b"abc\x00\x01\x02def", "binary"),
        (b"caf\xe9 au lait\n" * 50, "not UTF-8"),
        (b"tiny", "too short"),
        (b"   \n\n  ", "no text"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_keeps_earlier_data(tmp_path, capsys, content, message):
    f = tmp_path / "corpus.txt"
    f.write_text("a good corpus line\n" * 200, encoding="utf-8")
    data = tmp_path / "data"
    assert _cli(capsys, f"text:{f}", "--data-dir", str(data))[0] == 0
    before = {p.name: p.read_bytes() for p in (data / "text-corpus").iterdir()}
    if content is None:
        f.unlink()
    else:
        f.write_bytes(content)
    code, err = _cli(capsys, f"text:{f}", "--data-dir", str(data), "--force")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("txlm: error: ") and message in err
    after = {p.name: p.read_bytes() for p in (data / "text-corpus").iterdir()}
    assert after == before
    assert [p.name for p in data.iterdir()] == ["text-corpus"]  # no temp folder left behind


def test_unknown_dataset_and_level(capsys, tmp_path):
    code, err = _cli(capsys, "wt7", "--data-dir", str(tmp_path))
    assert code == 2 and "unknown dataset" in err
    code, err = _cli(capsys, "shakespeare", "--level", "byte", "--data-dir", str(tmp_path))
    assert code == 2 and "level" in err


def test_vocabulary_that_does_not_match_the_data(shakespeare, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shakespeare, copy)
    other = prepare_dataset("shakespeare", tmp_path / "w", level="word", progress=False)
    shutil.copy(other / "vocab.json", copy / "vocab.json")
    with pytest.raises(DataError, match="does not match the prepared data"):
        load_prepared(copy)
    (copy / "train.bin").write_bytes(b"xx")
    shutil.copy(shakespeare / "vocab.json", copy / "vocab.json")
    with pytest.raises(DataError, match="truncated"):
        load_prepared(copy).split("train")
    with pytest.raises(DataError, match=r"no meta\.json"):
        load_prepared(tmp_path)


def test_cli_subprocess_end_to_end(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world\n" * 300, encoding="utf-8")
    env = subprocess_env(tmp_path / "d")
    cmd = [sys.executable, "-m", "txlm", "prepare", f"text:{f}", "--json", "--no-progress"]
    ok = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout)
    assert summary["path"] == str(tmp_path / "d" / "text-t")
    bad = subprocess.run(
        [sys.executable, "-m", "txlm", "prepare", f"text:{tmp_path / 'nope.txt'}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert bad.stderr.startswith("txlm: error:")


def test_prepare_rebuilds_a_copy_whose_vocabulary_was_replaced(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("some text to prepare\n" * 100, encoding="utf-8")
    path = prepare_dataset(f"text:{f}", tmp_path / "d", progress=False)
    good = (path / "vocab.json").read_text()
    other = prepare_dataset("shakespeare", tmp_path / "s", progress=False)
    (path / "vocab.json").write_text((other / "vocab.json").read_text())
    with pytest.raises(DataError, match="does not match"):
        load_prepared(path)
    prepare_dataset(f"text:{f}", tmp_path / "d", progress=False)
    assert (path / "vocab.json").read_text() == good
    load_prepared(path)


def test_an_interrupted_prepare_leaves_the_earlier_copy_and_no_temp_folder(tmp_path, monkeypatch):
    f = tmp_path / "t.txt"
    f.write_text("first version\n" * 100, encoding="utf-8")
    path = prepare_dataset(f"text:{f}", tmp_path / "d", progress=False)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    f.write_text("second version\n" * 100, encoding="utf-8")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(splits, "encode_split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(f"text:{f}", tmp_path / "d", progress=False)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["text-t"]


def test_many_document_offsets_go_to_a_side_file(tmp_path, monkeypatch):
    f = tmp_path / "t.txt"
    f.write_text("".join(f"doc {i}\n\n\n" for i in range(40)), encoding="utf-8")
    inline = load_prepared(prepare_dataset(f"text:{f}", tmp_path / "a", progress=False))
    monkeypatch.setattr(splits, "INLINE_DOC_STARTS", 3)
    side = load_prepared(prepare_dataset(f"text:{f}", tmp_path / "b", progress=False))
    assert "doc_starts_file" in side.meta["splits"]["train"]
    assert (side.path / "train.docs.bin").is_file()
    for split in ("train", "valid", "test"):
        assert np.array_equal(side.doc_starts(split), inline.doc_starts(split))
    assert len(side.doc_starts("train")) == 36  # 40 documents, 2 valid, 2 test
