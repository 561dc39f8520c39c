"""``txlm train`` says what would surprise: a run that ends inside its warm-up, a corpus
prepared only at another level, the trainable parameters beside the total, the ``--init``
checkpoint a fine-tune's model is, a classifier's documents (not tokens) per second, its
init-valid accuracy and unknown share, a ``classes:`` dataset without ``--task classify``.

Real CLI runs (the warm fork runner) on a small text."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import pytest

from tests.helpers.classify import label_folders, tiny_lm
from tests.helpers.train import FAST, tiny_text
from txlm.training.metrics import ProgressReport

RUN = ["data.batch_size=4", "eval.eval_interval=0", "eval.sample_tokens=0",
       "eval.final_eval=false", *FAST]  # fmt: skip


def train(runner, cwd: Path, *argv: str, name: str = "io") -> tuple[int, str, str]:
    return runner.run(["train", *argv], cwd, cwd / name, {"TXLM_DATA_DIR": str(cwd / "data")})


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("surprises")
    tiny_text(root, n_chars=6000)
    return root


def test_a_run_that_ends_inside_its_warm_up_says_so(runner, work):
    rc, out, err = train(
        runner, work, "--preset", "debug", "--out", "runs/short", "--set",
        "data.dataset=text:tiny.txt",
        "optim.max_steps=3", "optim.warmup_steps=10", "optim.lr=1e-3", *RUN,
    )  # fmt: skip
    assert rc == 0, err
    notes = [line for line in out.splitlines() if line.startswith("note: optim.max_steps")]
    assert notes == [
        "note: optim.max_steps=3 ends inside the warm-up (optim.warmup_steps=10): the learning "
        "rate rises to 0.0003 only, never to optim.lr=0.001; set optim.warmup_steps below max_steps"
    ]
    rc, out, err = train(
        runner, work, "--preset", "debug", "--out", "runs/ok", "--set",
        "data.dataset=text:tiny.txt",
        "optim.max_steps=3", "optim.warmup_steps=2", *RUN, name="io2",
    )  # fmt: skip
    assert rc == 0, err
    assert "warm-up" not in out


def test_a_corpus_prepared_at_one_other_level_is_used_and_named(runner, work, tmp_path):
    (tmp_path / "notes.txt").write_text((work / "tiny.txt").read_text())
    data = tmp_path / "data"
    prep = runner.run(
        ["prepare", "text:notes.txt", "--level", "bpe", "--vocab-size", "300"], tmp_path,
        tmp_path / "io0", {"TXLM_DATA_DIR": str(data)},
    )  # fmt: skip
    assert prep[0] == 0, prep[2]
    rc, out, err = train(
        runner, tmp_path, "--preset", "debug", "--out", "runs/x", "--set",
        "data.dataset=text:notes.txt", "optim.max_steps=2", *RUN,
    )  # fmt: skip
    assert rc == 0, err
    assert (
        f"text:notes.txt: prepared at the bpe level only (in {data}): training at that level "
        "(data.level=char prepares the default instead)"
    ) in out
    assert "(bpe level, 300 symbols)" in out and not (data / "text-notes").exists()
    # two other levels and not the default: which one is meant is not guessed
    prep = runner.run(
        ["prepare", "text:notes.txt", "--level", "word"], tmp_path, tmp_path / "io1",
        {"TXLM_DATA_DIR": str(data)},
    )  # fmt: skip
    assert prep[0] == 0, prep[2]
    rc, out, err = train(
        runner, tmp_path, "--preset", "debug", "--out", "runs/y", "--set",
        "data.dataset=text:notes.txt", "optim.max_steps=2", *RUN, name="io2",
    )  # fmt: skip
    assert rc == 2 and err == (
        f"txlm: error: text:notes.txt is prepared in {data} at the levels word, bpe, not at its "
        "default char: choose one with data.level\n"
    )


def test_a_fine_tunes_header_names_its_init_and_the_trainable_parameters(runner, work):
    rc, out, err = train(
        runner, work, "--preset", "debug", "--out", "runs/base", "--set",
        "data.dataset=text:tiny.txt", "optim.max_steps=2", *RUN, name="io3",
    )  # fmt: skip
    assert rc == 0, err
    rc, out, err = train(
        runner, work, "--init", "runs/base/best", "--out", "runs/ft", "--set",
        "data.dataset=text:tiny.txt", "optim.max_steps=2", "optim.freeze=[embed,softmax]", *RUN,
        name="io4",
    )  # fmt: skip
    assert rc == 0, err
    header = out.splitlines()[0]
    base = (work / "runs" / "base" / "best").resolve()
    match = re.fullmatch(
        rf"txlm train: --init {re.escape(str(base))} on text:tiny\.txt \(char level, \d+ "
        r"symbols\), \d+\.\d\dM parameters \(([\d,]+) of ([\d,]+) trainable\), 1 process\(es\) "
        r"on cpu, out runs/ft",
        header,
    )
    assert match, header
    trainable, total = (int(g.replace(",", "")) for g in match.groups())
    from txlm.checkpoints.checkpoint import load

    model = load(work / "runs" / "ft" / "best")
    layers = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers."))
    assert total == model.num_parameters() and trainable < total
    assert trainable >= layers  # the layers train; embedding and softmax do not


def test_a_classifiers_log_counts_documents_and_its_accuracy_and_unknown_share(runner, tmp_path):
    tiny_lm(tmp_path / "lm", alphabet="abcdXY")
    docs = {
        "x": ["abcdX" * 4 for _ in range(6)],
        "y": ["dcbaY" * 4 for _ in range(6)],
    }
    label_folders(tmp_path / "docs", docs)
    rc, out, err = train(
        runner, tmp_path, "--init", "lm", "--task", "classify", "--preset", "debug", "--out",
        "runs/cls", "--set", "data.dataset=classes:docs", "optim.max_steps=2",
        *RUN, "run.progress=true", "run.progress_interval=1",
    )  # fmt: skip
    assert rc == 0, err
    init = [line for line in out.splitlines() if line.startswith("init valid:")]
    assert len(init) == 1 and re.fullmatch(
        r"init valid: loss \d+\.\d{4}, bits \d+\.\d{4}, accuracy \d\.\d{4} over 2 documents",
        init[0],
    ), init
    steps = [line for line in err.splitlines() if line.startswith("step ")]
    assert steps and all(" doc/s " in line and "tok/s" not in line for line in steps), err


def test_the_unknown_share_of_classes_documents(runner, tmp_path):
    """A vocabulary with <unk>: the share of each split's tokens it covers, as for a corpus."""
    from collections import Counter

    from txlm.checkpoints import checkpoint
    from txlm.config import PRESETS, ModelConfig
    from txlm.data.vocab import Vocab
    from txlm.model import TransformerXL

    vocab = Vocab.build_char(Counter("abcdXY"), unk=True)
    config = ModelConfig.from_dict({**PRESETS["debug"].model, "vocab_size": len(vocab)})
    extra = {"vocab_fingerprint": vocab.fingerprint}
    checkpoint.save(TransformerXL(config), tmp_path / "lm", vocab=vocab, extra_config=extra)
    # every document: 20 known symbols and 5 unknown (z): a share of 0.2 in every split
    docs = {"x": ["abcdXzzzzz" * 2 + "abcdX" for _ in range(6)],
            "y": ["dcbaYzzzzz" * 2 + "dcbaY" for _ in range(6)]}  # fmt: skip
    label_folders(tmp_path / "docs", docs)
    rc, out, err = train(
        runner, tmp_path, "--init", "lm", "--task", "classify", "--preset", "debug", "--out",
        "runs/cls", "--set", "data.dataset=classes:docs", "optim.max_steps=1", *RUN,
    )  # fmt: skip
    assert rc == 0, err
    unk = vocab.unk
    assert f"unknown symbols ({unk}) in the corpus: train 40.00%, valid 40.00%, test 40.00%" in out


def test_classes_without_task_classify_says_which_task(runner, tmp_path):
    rc, _, err = train(
        runner, tmp_path, "--preset", "debug", "--out", "runs/x", "--set",
        "data.dataset=classes:docs", *RUN,
    )  # fmt: skip
    assert rc == 2 and err == (
        "txlm: error: classes:docs is a classification dataset (a folder per label): train a "
        "classifier on it with txlm train --init CKPT --task classify\n"
    )


def test_the_progress_line_names_its_unit():
    out = io.StringIO()
    report = ProgressReport(
        enabled=True,
        total=2,
        initial=0,
        metric="bits",
        interval=1,
        stream=out,
        unit="doc",
        to_metric=lambda loss: loss / math.log(2),
    )
    report.update(1, loss=0.5, tokens=8.0, lr=1e-3, seconds=2.0, eta_s=2.0)
    assert out.getvalue() == "step 1/2  loss 0.5000  bits 0.7213  lr 0.001  4 doc/s  ETA 0:02\n"


def test_a_run_that_prepares_its_corpus_says_which_documents_it_skipped(runner, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(tiny_text(tmp_path, n_chars=4000).read_text())
    (tmp_path / "docs" / "b.txt").write_text("\n\n")
    rc, out, err = train(
        runner, tmp_path, "--preset", "debug", "--out", "runs/x", "--set",
        "data.dataset=text:docs", "optim.max_steps=1", *RUN,
    )  # fmt: skip
    assert rc == 0, err
    assert out.splitlines()[0] == "text:docs: skipped 1 empty document(s): b.txt"
