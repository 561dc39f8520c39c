"""The classifier: padding it cannot see, reading with memory equal to one forward, what the
memory carries, where the gradient goes, constant memory on long documents, the metrics,
``txlm.classify`` and classifier checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import txlm
from tests.helpers.classify import save_classifier, tiny_lm
from txlm.classify.classifier import Classifier, ClassifierConfig
from txlm.classify.documents import pad_documents
from txlm.classify.evaluation import scores
from txlm.config import PRESETS, ModelConfig
from txlm.errors import CheckpointError
from txlm.model import TransformerXL

V = 12


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits on a shared machine
    yield
    torch.set_num_threads(threads)


def _body(seed: int = 0, **lengths) -> TransformerXL:
    shape = {**PRESETS["debug"].model, "vocab_size": V, "tgt_len": 8, "mem_len": 16, **lengths}
    torch.manual_seed(seed)
    return TransformerXL(ModelConfig.from_dict(shape))


def _classifier(pooling: str, seed: int = 0, grad_segments: int = 1, **lengths) -> Classifier:
    torch.manual_seed(seed)
    clf = Classifier(
        _body(seed, **lengths), ClassifierConfig(("a", "b", "c"), pooling, grad_segments)
    )
    return clf.eval()


def _docs(*lengths: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=n) for n in lengths]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_a_document_reads_the_same_alone_or_beside_longer_ones(pooling) -> None:
    clf = _classifier(pooling)
    docs = _docs(5, 61, 30, 8)
    with torch.no_grad():
        together = clf(*pad_documents(docs, 8)).log_probs
        for i, d in enumerate(docs):
            alone = clf(*pad_documents([d], 8)).log_probs[0]
            # other shapes (rows, padded width): the same numbers to float32 rounding
            torch.testing.assert_close(alone, together[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_segments_with_memory_equal_one_forward_over_the_document(pooling) -> None:
    """With the memory holding the whole past, reading 8 at a time is attention over the
    whole document: the classifier built with one segment as long as the document agrees."""
    docs = _docs(37, 64, 20)
    seg = _classifier(pooling, tgt_len=8, mem_len=64)
    whole = _classifier(pooling, tgt_len=64, mem_len=64)
    whole.load_state_dict(seg.state_dict())
    with torch.no_grad():
        a = seg(*pad_documents(docs, 8)).log_probs
        b = whole(*pad_documents(docs, 64)).log_probs
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # float32: other summation order


def test_the_last_state_sees_earlier_segments_only_through_the_memory() -> None:
    doc = _docs(40)[0]
    changed = doc.copy()
    changed[12] = (changed[12] + 1) % V  # the second of five segments
    for mem_len, same in ((0, True), (16, False)):
        clf = _classifier("last", mem_len=mem_len)
        with torch.no_grad():
            a = clf(*pad_documents([doc], 8)).log_probs
            b = clf(*pad_documents([changed], 8)).log_probs
        assert torch.equal(a, b) == same, mem_len


def test_the_gradient_reaches_only_the_last_k_segments() -> None:
    """Mean pooling over 4 segments: a symbol only in the first segment gets an embedding
    gradient when every segment keeps its graph (k=0), none when only the last does (k=1)."""
    doc = np.concatenate([np.full(8, 11), np.arange(24) % 10])  # symbol 11: first segment only
    ids, start = pad_documents([doc], 8)
    grads = {}
    for k in (0, 1, 2):
        clf = _classifier("mean", grad_segments=k).train()
        clf(ids, start, torch.tensor([1])).losses.sum().backward()
        grads[k] = clf.body.embed.layers[0].weight.grad
    assert grads[0][11].abs().sum() > 0
    assert grads[1][11].abs().sum() == 0 and grads[2][11].abs().sum() == 0
    assert grads[1][:10].abs().sum() > 0
    # the softmax's own tensors are frozen: nothing but the tied embedding reaches them
    clf = _classifier("mean")
    frozen = [n for n, p in clf.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith("body.softmax.") for n in frozen)


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 // 1024


def test_a_long_document_is_classified_in_constant_memory() -> None:
    """A document 1000 segments long (vs training documents of a few) is read with the
    resident memory of the process sampled inside the call: after 50 segments and at the
    end. Holding anything per segment (states, graphs) would add >= 1000 x 8 x 32 floats."""
    clf = _classifier("mean")
    doc = _docs(8000)[0]
    samples: list[int] = []
    calls = [0]

    def hook(module, inputs, output) -> None:
        calls[0] += 1
        if calls[0] in (50, 1000):
            samples.append(_rss_kib())

    handle = clf.body.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            clf(*pad_documents([doc], 8))
    finally:
        handle.remove()
    assert calls[0] == 1000 and len(samples) == 2
    per_segment_states = 1000 * 8 * 32 * 4 // 1024  # KiB: the last layer's states alone
    assert samples[1] - samples[0] < per_segment_states / 4, samples


def test_scores_on_a_hand_counted_case() -> None:
    truth = np.array([0, 0, 0, 1, 1, 2])
    pred = np.array([0, 1, 0, 1, 2, 2])
    r = scores(["a", "b", "c"], truth, pred)
    assert r["confusion"] == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert r["accuracy"] == 4 / 6
    a, b, c = (r["per_class"][k] for k in "abc")
    assert (a["precision"], a["recall"], a["support"]) == (1.0, 2 / 3, 3)
    assert (b["precision"], b["recall"]) == (0.5, 0.5)
    assert (c["precision"], c["recall"]) == (0.5, 1.0)
    assert a["f1"] == pytest.approx(0.8) and c["f1"] == pytest.approx(2 / 3)
    assert r["macro_f1"] == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
    never = scores(["a", "b"], np.array([0, 1]), np.array([0, 0]))
    assert never["per_class"]["b"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}


def test_classify_and_checkpoints(tmp_path) -> None:
    lm = tiny_lm(tmp_path / "lm")
    path = save_classifier(tmp_path / "clf", lm, pooling="last")
    clf = txlm.load_classifier(path)
    assert clf.labels == ("x", "y") and clf.classifier_config.pooling == "last"
    text = "abcXdefgh" * 5
    p = txlm.classify(clf, text)
    assert set(p.probs) == {"x", "y"} and p.probs[p.label] == max(p.probs.values())
    assert sum(p.probs.values()) == pytest.approx(1.0, abs=1e-6)  # float32 log-softmax
    assert txlm.classify(clf, clf.vocab.encode(text)) == p  # text or its ids: one computation
    # the weights came back: the body is the language model's, the head the saved one
    lm_model = txlm.load(lm)
    for name, t in lm_model.state_dict().items():
        assert torch.equal(clf.body.state_dict()[name], t), name
    with pytest.raises(CheckpointError, match="not a language model"):
        txlm.load(path)
    with pytest.raises(CheckpointError, match="not a classifier"):
        txlm.load_classifier(lm)
    with pytest.raises(CheckpointError, match="needs a classifier"):
        txlm.classify(lm_model, text)
