"""Commands find a checkpoint's prepared corpus, or prepare it again only when that gives the
checkpoint's vocabulary, saying where; ``txlm prepare`` says when it reused a copy. Real CLI
runs on a small text."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.reliability import snapshot
from tests.helpers.train import FAST, tiny_text, txlm

pytestmark = pytest.mark.slow  # CLI runs, two short trainings included


def _train(root, text, level, data, *extra):
    t = txlm(
        ["train", "--preset", "debug", "--out", str(root / f"run-{level}"), "--set",
         f"data.dataset=text:{text}", f"data.level={level}", "data.batch_size=4",
         "optim.max_steps=2", "eval.eval_interval=2", "eval.max_eval_steps=1",
         "eval.sample_tokens=0", *FAST, *extra],
        data,
    )  # fmt: skip
    assert t.returncode == 0, t.stderr
    return root / f"run-{level}" / "best"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two checkpoints whose corpora were prepared under ``elsewhere`` (TXLM_DATA_DIR): a char
    level one (prepared again, it comes out the same) and a word level one prepared with
    --max-vocab 60 (prepared again with the defaults, it does not)."""
    root = tmp_path_factory.mktemp("open-corpus")
    text = tiny_text(root, n_chars=8000)
    elsewhere = root / "elsewhere"
    p = txlm(["prepare", f"text:{text}", "--level", "word", "--max-vocab", "60"], elsewhere)
    assert p.returncode == 0, p.stderr
    char, word = _train(root, text, "char", elsewhere), _train(root, text, "word", elsewhere)
    for ckpt in (char, word):  # not configured, but recorded where it was prepared
        config = json.loads((ckpt / "config.json").read_text())
        assert config["train"]["data"]["data_dir"] is None
        assert config["dataset"]["data_dir"] == str(elsewhere.resolve())
    return root, text, elsewhere, char, word


def _eval(ckpt, data, *extra):
    return txlm(["eval", str(ckpt), "--max-steps", "2", *extra], data)


def test_the_recorded_data_folder_is_read_when_the_current_one_lacks_the_corpus(runs, tmp_path):
    _, _, elsewhere, char, _ = runs
    empty = tmp_path / "data"  # $TXLM_DATA_DIR of this call: nothing prepared there
    e = _eval(char, empty, "--json")
    assert e.returncode == 0 and e.stderr == ""  # found where it was prepared: nothing to say
    assert not empty.exists()
    there = _eval(char, elsewhere, "--json")
    assert there.returncode == 0 and there.stderr == ""
    assert json.loads(e.stdout)["loss"] == json.loads(there.stdout)["loss"]


def test_a_corpus_prepared_elsewhere_is_prepared_again_only_when_it_is_the_same(runs, tmp_path):
    _, _, elsewhere, char, _ = runs
    empty = tmp_path / "data"  # the data directory eval is pointed at: nothing prepared there
    e = _eval(char, empty, "--json", "--data-dir", str(empty))
    assert e.returncode == 0, e.stderr
    # it says where it prepared the copy, and that it is the checkpoint's vocabulary
    assert f"prepared it in {empty / 'text-tiny'}" in e.stderr
    assert "vocabulary (fingerprint" in e.stderr
    assert (empty / "text-tiny" / "meta.json").is_file()
    there = _eval(char, elsewhere, "--json")
    assert there.returncode == 0 and there.stderr == ""  # found: nothing to say
    assert json.loads(e.stdout)["loss"] == json.loads(there.stdout)["loss"]
    again = _eval(char, empty, "--json", "--data-dir", str(empty))  # a copy there: reused
    assert again.returncode == 0 and again.stderr == ""


def test_another_preparation_is_not_built_over_and_the_error_names_data_dir(runs, tmp_path):
    _, _, elsewhere, _, word = runs
    empty = tmp_path / "data"
    empty.mkdir()
    before = snapshot(empty)
    e = _eval(word, empty, "--data-dir", str(empty))
    lines = e.stderr.splitlines()
    assert e.returncode == 2 and len(lines) == 1 and lines[0].startswith("txlm: error: ")
    assert "--data-dir" in lines[0] and str(empty) in lines[0] and "Traceback" not in e.stderr
    # the copy it made with the default options (another vocabulary) is gone again
    assert snapshot(empty) == before
    ok = _eval(word, empty, "--data-dir", str(elsewhere))
    assert ok.returncode == 0, ok.stderr


def test_a_copy_with_another_vocabulary_is_refused_before_anything_is_rebuilt(runs, tmp_path):
    _, text, _, _, word = runs
    other = tmp_path / "data"
    p = txlm(["prepare", f"text:{text}", "--level", "word", "--max-vocab", "40"], other)
    assert p.returncode == 0, p.stderr
    before = snapshot(other)
    e = _eval(word, other)
    assert e.returncode == 2 and len(e.stderr.splitlines()) == 1
    assert "holds another preparation" in e.stderr and "--data-dir" in e.stderr
    assert snapshot(other) == before


def test_prepare_says_when_it_reused_a_copy(tmp_path):
    text = tiny_text(tmp_path, n_chars=4000)
    data = tmp_path / "data"
    first = txlm(["prepare", f"text:{text}", "--json"], data)
    assert first.returncode == 0 and json.loads(first.stdout)["reused"] is False
    second = txlm(["prepare", f"text:{text}"], data)
    assert second.returncode == 0
    assert second.stdout.splitlines()[0] == (
        f"{data / 'text-tiny'}: an up-to-date copy was there, reused it (--force rebuilds)"
    )
    assert json.loads(txlm(["prepare", f"text:{text}", "--json"], data).stdout)["reused"]
    forced = txlm(["prepare", f"text:{text}", "--force", "--json"], data)
    assert json.loads(forced.stdout)["reused"] is False
    text.write_text(text.read_text() + "a changed line\n")  # another input: built again
    changed = txlm(["prepare", f"text:{text}"], data)
    assert changed.returncode == 0 and "reused" not in changed.stdout
    shutil.rmtree(data)
