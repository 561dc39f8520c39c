"""``-`` is standard input: for ``txlm classify``, ``txlm generate --prompt-file`` and
``txlm eval --file``, reading text from a pipe gives what reading the same text from a file
gives."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from tests.helpers.classify import save_classifier, tiny_lm
from tests.helpers.env import subprocess_env
from txlm.cli import main

TEXT = "abcXdefgh" * 6


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("stdin")
    lm = tiny_lm(root / "lm")
    save_classifier(root / "cls", lm)
    (root / "doc.txt").write_text(TEXT)  # no newline: the vocabulary has none
    return root


def run(monkeypatch, capsys, argv: list[str], stdin: bytes = b"") -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_classify_reads_a_document_from_standard_input(ckpts, monkeypatch, capsys):
    args = ["classify", str(ckpts / "cls"), "--json", "--threads", "1"]
    code, from_file, err = run(monkeypatch, capsys, [*args, str(ckpts / "doc.txt")])
    assert code == 0, err
    code, from_pipe, err = run(monkeypatch, capsys, [*args, "-"], TEXT.encode())
    assert code == 0, err
    file_record, pipe_record = json.loads(from_file), json.loads(from_pipe)
    assert pipe_record["file"] == "-"
    assert pipe_record["probs"] == file_record["probs"]  # same document, same computation


def test_classify_takes_standard_input_once(ckpts, monkeypatch, capsys):
    code, out, err = run(monkeypatch, capsys, ["classify", str(ckpts / "cls"), "-", "-"])
    assert code == 2 and out == ""
    assert err == "txlm: error: - (standard input) can be one document only: name it once\n"


def test_an_empty_standard_input_is_an_empty_document(ckpts, monkeypatch, capsys):
    code, _, err = run(monkeypatch, capsys, ["classify", str(ckpts / "cls"), "-"], b"   ")
    assert code == 2 and err == "txlm: error: document - is empty\n"


def test_eval_file_scores_standard_input_as_the_file(ckpts, monkeypatch, capsys):
    args = ["eval", str(ckpts / "lm"), "--json", "--threads", "1", "--file"]
    code, from_file, err = run(monkeypatch, capsys, [*args, str(ckpts / "doc.txt")])
    assert code == 0, err
    code, from_pipe, err = run(monkeypatch, capsys, [*args, "-"], TEXT.encode())
    assert code == 0, err
    a, b = json.loads(from_file), json.loads(from_pipe)
    assert b["file"] == "-" and b["tokens"] == a["tokens"] > 0 and b["loss"] == a["loss"]


def test_generate_reads_its_prompt_file_from_standard_input(ckpts, monkeypatch, capsys):
    args = ["generate", str(ckpts / "lm"), "--max-new-tokens", "8", "--seed", "3", "--threads",
            "1", "--prompt-file"]  # fmt: skip
    code, from_file, err = run(monkeypatch, capsys, [*args, str(ckpts / "doc.txt")])
    assert code == 0, err
    code, from_pipe, err = run(monkeypatch, capsys, [*args, "-"], TEXT.encode())
    assert code == 0, err
    assert from_pipe == from_file and TEXT.strip() in from_pipe


def test_classify_in_a_real_pipe(ckpts):
    """Standard input of a real process (not a replaced sys.stdin)."""
    result = subprocess.run(
        [sys.executable, "-m", "txlm", "classify", str(ckpts / "cls"), "-", "--json"],
        input=TEXT, capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["file"] == "-"
