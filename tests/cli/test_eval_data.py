"""A checkpoint finds its own data: ``txlm eval CKPT`` reads the prepared corpus its
config.json names, with the checkpoint's vocabulary, from the directory it was trained in and
from any other (a trained run, one fine-tuned with ``--init``, a converted model fine-tuned,
a classifier); and evaluating never rewrites a preparation: a changed source is refused in
one line naming ``txlm prepare ... --force``, every prepared file byte for byte as it was.

Runs go through the warm fork runner (``python -m txlm`` without an interpreter start-up
each) in a user's folder with relative paths and the default ``./data``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from tests.helpers.classify import label_folders, tiny_lm
from tests.helpers.hf import save_tiny_hf
from tests.helpers.train import FAST, tiny_text

RUN = [
    "data.batch_size=4", "eval.eval_interval=0", "eval.sample_tokens=0", "eval.final_eval=false",
    "optim.max_steps=2", *FAST,
]  # fmt: skip
WORDS = ["the", "of", "and", "to", "a", "in", "is", "was", "he", "for", "it", "with"]
SYMBOLS = ["<eos>", "<unk>", *WORDS, *(f"w{i}" for i in range(40 - 2 - len(WORDS)))]


def txlm(runner, cwd: Path, *argv: str) -> tuple[int, str, str]:
    io = cwd / f"io-{hashlib.sha256(repr(argv).encode()).hexdigest()[:8]}"
    return runner.run(list(argv), cwd, io, {})


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def work(runner, tmp_path_factory) -> Path:
    """A user's folder: a corpus folder and three runs on it, relative paths, ./data."""
    root = tmp_path_factory.mktemp("user")
    play = tiny_text(root, n_chars=8000).read_text()
    (root / "tiny.txt").unlink()
    (root / "my_texts").mkdir()
    half = len(play) // 2
    (root / "my_texts" / "a.txt").write_text(play[:half])
    (root / "my_texts" / "b.txt").write_text(play[half:])
    rng = random.Random(0)
    verses = ["the cat sat on the mat", "a dog ran to the log", "my hat is on the cat"]
    (root / "sonnets.txt").write_text("\n".join(rng.choice(verses) for _ in range(300)) + "\n")
    # a converted word-level model (legacy vocab.bin, lower-casing) and a corpus in its words
    save_tiny_hf(root / "hf", safe=False)
    legacy = {
        "idx2sym": SYMBOLS, "sym2idx": OrderedDict((s, i) for i, s in enumerate(SYMBOLS)),
        "special": ["<eos>"], "lower_case": True, "delimiter": None,
    }  # fmt: skip
    torch.save(legacy, root / "hf" / "vocab.bin", _use_new_zipfile_serialization=False)
    lines = (" ".join(rng.choice(WORDS) for _ in range(6)).capitalize() for _ in range(300))
    (root / "words.txt").write_text("\n".join(lines) + "\n")
    steps = [
        ("train", "--preset", "debug", "--out", "runs/mine", "--set",
         "data.dataset=text:my_texts", *RUN),
        ("train", "--init", "runs/mine/best", "--out", "runs/sonnets", "--set",
         "data.dataset=text:sonnets.txt", *RUN),
        ("convert", "--from", "hf", "hf", "--out", "runs/conv"),
        ("train", "--init", "runs/conv", "--out", "runs/conv-mine", "--set",
         "data.dataset=text:words.txt", "data.tgt_len=16", *RUN),
    ]  # fmt: skip
    for argv in steps:
        rc, out, err = txlm(runner, root, *argv)
        assert rc == 0, f"{argv}: {err}{out}"
    return root


RUNS = ["mine", "sonnets", "conv-mine"]


def evaluate(runner, cwd: Path, ckpt: str | Path, *extra: str) -> dict:
    rc, out, err = txlm(runner, cwd, "eval", str(ckpt), "--split", "valid", "--json", *extra)
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("run", RUNS)
def test_eval_reads_the_corpus_the_checkpoint_names_from_here_and_elsewhere(
    runner, work, tmp_path, run
):
    config = json.loads((work / "runs" / run / "best" / "config.json").read_text())
    record = config["dataset"]
    assert Path(record["path"]).is_dir() and Path(record["path"]).is_absolute()
    assert Path(record["path"]).parent == (work / "data").resolve()
    assert record["given_vocab"] is (run != "mine")
    assert record["lower_case"] is (run == "conv-mine")
    here = evaluate(runner, work, f"runs/{run}/best")
    before = tree_hashes(work / "data")
    elsewhere = evaluate(runner, tmp_path, (work / "runs" / run / "best").resolve())
    assert elsewhere["loss"] == here["loss"] and elsewhere["tokens"] == here["tokens"] > 0
    assert not (tmp_path / "data").exists()  # nothing prepared beside the other directory
    assert tree_hashes(work / "data") == before


def test_a_changed_source_is_refused_and_its_preparation_left_byte_for_byte(runner, work):
    before = tree_hashes(work / "data")
    extra = work / "my_texts" / "c.txt"
    extra.write_text("ROMEO: a new scene, added after the run.\n")
    try:
        rc, out, err = txlm(runner, work, "eval", "runs/mine/best", "--split", "test")
        assert rc == 2 and out == ""
        assert err.count("\n") == 1 and err.startswith("txlm: error:"), err
        assert "changed since it was prepared" in err
        assert "txlm prepare text:" in err and "--force" in err
        assert tree_hashes(work / "data") == before
        # a fine-tune of it is evaluated on its own corpus, which did not change
        evaluate(runner, work, "runs/sonnets/best")
    finally:
        extra.unlink()
    evaluate(runner, work, "runs/mine/best")  # the source as it was: read again
    assert tree_hashes(work / "data") == before


def test_train_too_leaves_a_changed_preparation_as_it_is(runner, work):
    before = tree_hashes(work / "data")
    extra = work / "my_texts" / "c.txt"
    extra.write_text("JULIET: another scene.\n")
    try:
        rc, _, err = txlm(
            runner, work, "train", "--preset", "debug", "--out", "runs/again", "--set",
            "data.dataset=text:my_texts", *RUN,
        )  # fmt: skip
        assert rc == 2 and err.count("\n") == 1 and "--force" in err, err
        assert tree_hashes(work / "data") == before and not (work / "runs" / "again").exists()
    finally:
        extra.unlink()


def test_data_dir_overrides_the_recorded_folder(runner, work, tmp_path):
    """--data-dir: the corpus prepared (or found) there, not the recorded one."""
    ckpt = (work / "runs" / "mine" / "best").resolve()
    other = tmp_path / "elsewhere-data"
    got = evaluate(runner, tmp_path, ckpt, "--data-dir", str(other))
    assert (other / "text-my_texts" / "meta.json").is_file()
    assert got["loss"] == evaluate(runner, work, "runs/mine/best")["loss"]


def test_a_classifier_reads_its_documents_from_any_directory(runner, tmp_path):
    work = tmp_path / "user"
    work.mkdir()
    tiny_lm(work / "lm")
    rng = random.Random(0)
    docs = {
        label: ["".join(rng.choice("abcdefgh") for _ in range(20)) + mark for _ in range(6)]
        for label, mark in (("x", "X"), ("y", "Y"))
    }
    label_folders(work / "my_docs", docs)
    rc, _, err = txlm(
        runner, work, "train", "--init", "lm", "--task", "classify", "--preset", "debug",
        "--out", "runs/cls", "--set", "data.dataset=classes:my_docs", *RUN,
    )  # fmt: skip
    assert rc == 0, err
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    ckpt = str((work / "runs" / "cls" / "best").resolve())
    rc, out, err = txlm(runner, elsewhere, "eval", ckpt, "--split", "valid", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["documents"] == 2 and 0 <= result["accuracy"] <= 1


def test_a_fine_tune_that_records_only_the_folder_name_is_read_with_its_vocabulary(runner, work):
    """A checkpoint whose config.json names its prepared folder but not its paths (written
    before they were recorded): the folder's name says the corpus is in the checkpoint's
    vocabulary, read from the working directory."""
    import shutil

    old = work / "runs" / "sonnets-old"
    shutil.copytree(work / "runs" / "sonnets", old)
    config_file = old / "best" / "config.json"
    config = json.loads(config_file.read_text())
    for key in ("source", "data_dir", "path", "given_vocab", "lower_case"):
        config["dataset"].pop(key)
    config_file.write_text(json.dumps(config))
    got = evaluate(runner, work, "runs/sonnets-old/best")
    assert got["loss"] == evaluate(runner, work, "runs/sonnets/best")["loss"]
