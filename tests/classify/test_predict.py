"""``txlm.classify.predict``: documents read in batches of similar length, each result put
back in its document's place; ``txlm classify FILE...`` gives each file its own label."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.classify import FILLER, save_classifier, tiny_lm
from tests.helpers.models import spread_weights
from txlm.checkpoints import checkpoint
from txlm.checkpoints.checkpoint import load_classifier
from txlm.classify.predict import predict


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits on a shared machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    """A classifier checkpoint with spread weights (documents far apart in their labels)."""
    root = tmp_path_factory.mktemp("predict")
    path = save_classifier(root / "clf", tiny_lm(root / "lm"), labels=("a", "b", "c"))
    model = load_classifier(path)
    torch.manual_seed(0)
    spread_weights(model, 0.3)
    config = checkpoint.Checkpoint.open(path).data
    extra = {k: v for k, v in config.items() if k not in ("format", "format_version", "model")}
    return checkpoint.save(model, path, vocab=model.vocab, extra_config=extra)


# Longest first, each of one symbol: documents the classifier tells apart (all three labels)
TEXTS = [symbol * n for symbol, n in zip(FILLER, [40, 33, 25, 18, 12, 7, 4, 2], strict=True)]


def test_results_come_back_in_the_order_the_documents_were_given(classifier) -> None:
    """Longest first, batched three by three: each row is that document's, as read alone (its
    batch's padding invisible: float32 agreement)."""
    model = load_classifier(classifier)
    docs = [model.vocab.encode(text) for text in TEXTS]
    together = predict(model, docs, batch_size=3)
    alone = torch.cat([predict(model, [d]) for d in docs])
    assert len(set(alone.argmax(-1).tolist())) == 3  # documents the test can tell apart
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


def test_classify_labels_each_file_given_longest_first(runner, classifier, tmp_path) -> None:
    """``txlm classify`` on files longest first: each line is its file's own prediction."""
    model = load_classifier(classifier)
    files = []
    for i, text in enumerate(TEXTS):
        (tmp_path / f"{i}.txt").write_text(text)
        files.append(f"{i}.txt")
    rc, out, err = runner.run(
        ["classify", str(classifier), *files, "--json", "--batch-size", "3"],
        tmp_path, tmp_path / "io", {},
    )  # fmt: skip
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [r["file"] for r in lines] == files
    alone = [predict(model, [model.vocab.encode(t)])[0].tolist() for t in TEXTS]
    labels = [model.labels[int(np.argmax(p))] for p in alone]
    assert len(set(labels)) == 3  # not one label for every file: the test can tell
    assert [r["label"] for r in lines] == labels
    for r, p in zip(lines, alone, strict=True):
        assert list(r["probs"].values()) == pytest.approx(p, abs=1e-5)


def test_a_classifier_read_with_padded_heads_classifies_as_the_plain_one(classifier) -> None:
    """The one weights reader stores a classifier's body padded as it does a language model
    (txlm.model.align, CUDA's default): the same probabilities within float32 rounding."""
    ckpt = checkpoint.Checkpoint.open(classifier)
    plain = ckpt.load_model(align_heads=False, task="classify")
    padded = ckpt.load_model(align_heads=True, task="classify")
    assert padded.body.stored.keys > plain.body.stored.keys  # stored otherwise (aligned keys)
    docs = [plain.vocab.encode(text) for text in TEXTS]
    torch.testing.assert_close(predict(padded, docs), predict(plain, docs), atol=1e-5, rtol=0)
