"""Bad input to `txlm classify`: a language model for a classifier, documents that are empty,
not UTF-8, missing or hold symbols the vocabulary lacks, a damaged classifier section.

Contract C24 (ARCHITECTURE.md): one ``txlm: error:`` line, exit 2, nothing on disk changed.
The runner is shared by every command's table (``helpers/cli_table.py``); these cases build their
checkpoints in their own working directory (``_classify_helpers``), not from the assets.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.classify import save_classifier, tiny_lm
from tests.helpers.cli_table import Case, both, edit_json, run_case, write


def _classifier(work: Path) -> None:
    save_classifier(work / "clf", tiny_lm(work / "lm"))


def _doc(name: str = "doc.txt", data: bytes | str = "abcXabcd") -> object:
    return write(name, data)


CASES: list[Case] = [
    Case(
        "classify-language-model",
        ["classify", "lm", "doc.txt"],
        "is a language model, not a classifier",
        both(lambda w: tiny_lm(w / "lm"), _doc()),
    ),
    Case("classify-missing-checkpoint", ["classify", "nope", "doc.txt"], "nope", _doc()),
    Case(
        "classify-empty-document",
        ["classify", "clf", "doc.txt", "empty.txt"],
        "empty.txt is empty",
        both(_classifier, _doc(), _doc("empty.txt", "")),
    ),
    Case(
        "classify-not-utf8",
        ["classify", "clf", "bin.txt"],
        "not UTF-8",
        both(_classifier, _doc("bin.txt", b"\xff\xfe\x00\x81")),
    ),
    Case(
        "classify-missing-document",
        ["classify", "clf", "doc.txt", "gone.txt"],
        "cannot read document",
        both(_classifier, _doc()),
    ),
    Case(
        "classify-symbol-not-in-vocabulary",
        ["classify", "clf", "doc.txt"],
        "not in the vocabulary",
        both(_classifier, _doc(data="abc?")),
    ),
    Case(
        "classify-bad-batch-size",
        ["classify", "clf", "doc.txt", "--batch-size", "0"],
        "--batch-size",
        both(_classifier, _doc()),
    ),
    Case(
        "classify-one-label-section",
        ["classify", "clf", "doc.txt"],
        "two or more distinct labels",
        both(
            _classifier,
            _doc(),
            edit_json("clf/config.json", lambda d: d["classifier"].__setitem__("labels", ["x"])),
        ),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, runner, tmp_path) -> None:
    run_case(case, tmp_path / "no-assets", runner, tmp_path)
