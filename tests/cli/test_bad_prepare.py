"""Bad input to `txlm prepare`: corpora that are empty, binary, not UTF-8, too short or
pickles; unknown datasets, levels and options.

Contract C24 (ARCHITECTURE.md): one ``txlm: error:`` line, exit 2, nothing on disk changed.
The runner and the assets are shared by every command's table: ``helpers/cli_table.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.helpers.cli_table import (
    EVIL,
    Case,
    both,
    check_pickle_never_runs,
    mkdir,
    run_case,
    write,
)
from tests.helpers.reliability import Runner, snapshot

CASES: list[Case] = [
    Case("prepare-empty-file", ["prepare", "text:empty.txt"], "empty", write("empty.txt", "")),
    Case(
        "prepare-binary",
        ["prepare", "text:blob.txt"],
        "binary",
        write("blob.txt", bytes(range(256)) * 8),
    ),
    Case(
        "prepare-non-utf8",
        ["prepare", "text:latin1.txt"],
        "utf-8",
        write("latin1.txt", "caf\u00e9 na\u00efve r\u00e9sum\u00e9\n".encode("latin-1") * 50),
    ),
    Case(
        "prepare-whitespace-only",
        ["prepare", "text:blank.txt"],
        "whitespace",
        write("blank.txt", " \n\t\n\n   \n"),
    ),
    Case(
        "prepare-too-short", ["prepare", "text:short.txt"], "too short", write("short.txt", "ab\n")
    ),
    Case(
        "prepare-pickle-as-corpus",
        ["prepare", "text:corpus.pkl"],
        "corpus.pkl",
        write("corpus.pkl", EVIL),
        pickle=True,
    ),
    Case("prepare-missing-file", ["prepare", "text:nope.txt"], "nope.txt"),
    Case("prepare-empty-folder", ["prepare", "text:folder"], "no .txt", mkdir("folder")),
    Case("prepare-no-path", ["prepare", "text:"], "needs a path"),
    Case("prepare-unknown-dataset", ["prepare", "wikitext-9000"], "unknown dataset"),
    Case("prepare-bad-level", ["prepare", "shakespeare", "--level", "morpheme"], "--level"),
    Case("prepare-unavailable-level", ["prepare", "shakespeare", "--level", "byte"], "byte"),
    Case(
        "prepare-min-freq-zero",
        ["prepare", "text:corpus.txt", "--level", "word", "--min-freq", "0"],
        "min_freq",
        uses=("corpus.txt",),
    ),
    Case(
        "prepare-max-vocab-negative",
        ["prepare", "text:corpus.txt", "--level", "word", "--max-vocab", "-5"],
        "max_vocab",
        uses=("corpus.txt",),
    ),
    Case(
        "prepare-bpe-vocab-below-byte-alphabet",
        ["prepare", "text:corpus.txt", "--level", "bpe", "--vocab-size", "200"],
        "byte alphabet",
        uses=("corpus.txt",),
    ),
    Case(
        "prepare-bpe-empty-corpus",
        ["prepare", "text:empty.txt", "--level", "bpe"],
        "empty",
        write("empty.txt", ""),
    ),
    Case(
        "prepare-bpe-one-character-corpus",
        ["prepare", "text:same.txt", "--level", "bpe"],
        "one character",
        write("same.txt", "a" * 1000),
    ),
    Case(
        "prepare-bpe-option-for-word-level",
        ["prepare", "text:corpus.txt", "--level", "word", "--vocab-size", "1000"],
        "--vocab-size",
        uses=("corpus.txt",),
    ),
    Case(
        "prepare-data-dir-under-file",
        ["prepare", "text:corpus.txt", "--data-dir", "blocker/data"],
        "blocker",
        both(write("blocker", "x")),
        uses=("corpus.txt",),
    ),
    Case(
        "prepare-data-dir-is-file",
        ["prepare", "text:corpus.txt", "--data-dir", "blocker"],
        "blocker",
        write("blocker", "x"),
        uses=("corpus.txt",),
    ),
    Case(
        "prepare-fresh-refused-leaves-no-data-dir",
        ["prepare", "text:blob.txt"],
        "binary",
        write("blob.txt", bytes(range(256)) * 8),
    ),
    Case("prepare-unknown-option", ["prepare", "--frobnicate"], "--frobnicate"),
    Case("prepare-non-integer-option", ["prepare", "text:x.txt", "--min-freq", "lots"], "min-freq"),
    # ---- a vocabulary size bounded before the tokenizer library sees it
    Case(
        "prepare-bpe-vocab-size-cannot-fit",
        ["prepare", "text:corpus.txt", "--level", "bpe", "--vocab-size", "1000000000000"],
        "--vocab-size",
        uses=("corpus.txt",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, assets, runner, tmp_path) -> None:
    run_case(case, assets, runner, tmp_path)


PICKLE_CASES = [c for c in CASES if c.pickle]


@pytest.mark.parametrize("case", PICKLE_CASES, ids=[c.id for c in PICKLE_CASES])
def test_crafted_pickle_never_runs(case: Case, assets, runner, tmp_path) -> None:
    check_pickle_never_runs(case, assets, runner, tmp_path)


def test_huge_single_line_corpus_is_handled(runner: Runner, tmp_path: Path) -> None:
    """Not bad input: a 2 MB corpus with no newline at all prepares (split inside the line),
    with bounded work, and only the dataset folder appears."""
    work, io_dir = tmp_path / "work", tmp_path / "io"
    work.mkdir()
    (work / "data").mkdir()
    rng = random.Random(0)
    (work / "one.txt").write_text("".join(rng.choice("abcdefgh ") for _ in range(2_000_000)))
    before = snapshot(work)
    argv = ["prepare", "text:one.txt", "--json", "--no-progress"]
    rc, out, err = runner.run(argv, work, io_dir, {"TXLM_DATA_DIR": str(work / "data")})
    assert rc == 0, err
    report = json.loads(out)
    assert sum(report["tokens"].values()) == 2_000_000
    assert all(n > 0 for n in report["tokens"].values())
    new = set(snapshot(work)) - set(before)
    assert all(p.startswith(str(work / "data" / "text-one")) for p in new), new
