"""``Checkpoint.open``: a checkpoint resolved once, its config.json parsed once, and every
later read (vocabulary, weights, lengths) from that one copy (ARCHITECTURE.md contract C40).

A concurrent save over NAME moves the opened copy aside and deletes it: a read after that
raises ``CheckpointError`` rather than mixing one copy's configuration with another's weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

import txlm
from txlm.checkpoints.checkpoint import CONFIG_FILE, VOCAB_FILE, WEIGHTS_FILE, Checkpoint, save
from txlm.config import ModelConfig
from txlm.data import Vocab
from txlm.errors import CheckpointError, ConfigError
from txlm.model import TransformerXL
from txlm.model.lengths import Lengths

CHARS = "abcdefghijklmnopqrstuvwxyz ,.:\n"
EVAL = {"eval_tgt_len": 12, "eval_mem_len": 40, "eval_clamp_len": 30, "same_length": True}


def _model(vocab: Vocab, seed: int) -> TransformerXL:
    torch.manual_seed(seed)
    return TransformerXL(ModelConfig.from_preset("debug", vocab_size=len(vocab)))


def _save(path: Path, seed: int = 0, *, train: dict | None = None) -> Path:
    vocab = Vocab.build_char(Counter(CHARS))
    extra = {"vocab_fingerprint": vocab.fingerprint}
    if train is not None:
        extra["train"] = train
    return save(_model(vocab, seed), path, vocab=vocab, extra_config=extra)


@pytest.fixture
def trained(tmp_path: Path) -> Path:
    """A checkpoint whose run recorded evaluation lengths (as `txlm train` writes them)."""
    return _save(tmp_path / "run" / "best", train={"eval": EVAL, "data": {"dataset": "x"}})


def _state(model: TransformerXL) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_members_of_a_trained_checkpoint(trained: Path) -> None:
    ckpt = Checkpoint.open(trained)
    assert ckpt.path == trained
    assert ckpt.data == json.loads((trained / CONFIG_FILE).read_text())
    assert ckpt.model_config == ModelConfig.from_dict(ckpt.data["model"])
    assert ckpt.train_config == {"eval": EVAL, "data": {"dataset": "x"}}
    assert ckpt.has_vocab
    vocab = ckpt.vocab()
    assert vocab.to_json() == (trained / VOCAB_FILE).read_text()
    assert ckpt.vocab() is vocab  # read once
    assert ckpt.vocab_fingerprint == vocab.fingerprint == ckpt.data["vocab_fingerprint"]
    digest = hashlib.sha256((trained / WEIGHTS_FILE).read_bytes()).hexdigest()
    assert ckpt.weights_sha256() == digest


def test_load_model_gives_the_saved_weights_in_eval_mode(trained: Path) -> None:
    ckpt = Checkpoint.open(trained)
    want = _state(_model(ckpt.vocab(), seed=0))
    first, second = ckpt.load_model(), ckpt.load_model("cpu", align_heads=False)
    assert first is not second  # a new model each call
    for model in (first, second):
        assert not model.training
        got = model.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)  # a round trip: bit for bit
    # txlm.load and txlm.load_vocab are the same reads
    assert all(torch.equal(txlm.load(trained).state_dict()[k], want[k]) for k in want)
    assert txlm.load_vocab(trained).fingerprint == ckpt.vocab().fingerprint


def test_lengths_are_the_runs_evaluation_lengths_with_the_callers_overrides(trained) -> None:
    ckpt = Checkpoint.open(trained)
    assert txlm.Lengths is Lengths  # public: the type every length argument takes
    assert ckpt.lengths() == Lengths(tgt_len=12, mem_len=40, clamp_len=30, same_length=True)
    assert ckpt.lengths(mem_len=7, same_length=False) == Lengths(12, 7, 30, False)
    assert ckpt.lengths(tgt_len=5, clamp_len=-1) == Lengths(5, 40, -1, True)
    with pytest.raises(ConfigError, match="same_length needs mem_len"):
        ckpt.lengths(mem_len=0)  # the caller's value: a ConfigError, like any bad flag


def test_lengths_without_a_run_are_the_models(tmp_path: Path) -> None:
    ckpt = Checkpoint.open(_save(tmp_path / "plain"))
    assert ckpt.train_config is None
    assert ckpt.lengths() == Lengths.of(ckpt.model_config)
    assert ckpt.lengths(mem_len=3) == Lengths.of(ckpt.model_config, mem_len=3)


def test_recorded_lengths_that_cannot_be_used_are_refused_at_open(tmp_path: Path) -> None:
    path = _save(tmp_path / "bad", train={"eval": {"eval_tgt_len": 0}})
    with pytest.raises(CheckpointError, match=r"config\.json: train\.eval: tgt_len") as info:
        Checkpoint.open(path)
    assert "\n" not in str(info.value)


def test_vocabulary_absent_foreign_or_of_another_size(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt")
    (path / VOCAB_FILE).rename(tmp_path / "vocab.json")
    ckpt = Checkpoint.open(path)
    assert not ckpt.has_vocab
    with pytest.raises(CheckpointError, match=r"has no vocab\.json"):
        ckpt.vocab()
    ckpt.load_model()  # the weights need no vocabulary
    # another vocabulary of the same size: the fingerprint config.json records tells
    other = Vocab.build_char(Counter("ABCDEFGHIJKLMNOPQRSTUVWXYZ;!?-\t"))
    assert len(other) == ckpt.model_config.vocab_size
    other.save(path / VOCAB_FILE)
    with pytest.raises(CheckpointError, match=r"does not match the checkpoint's config\.json"):
        Checkpoint.open(path).vocab()
    # a vocabulary of another size, with no fingerprint recorded to catch it first
    data = json.loads((path / CONFIG_FILE).read_text())
    del data["vocab_fingerprint"]
    (path / CONFIG_FILE).write_text(json.dumps(data))
    Vocab.build_char(Counter("abc")).save(path / VOCAB_FILE)
    with pytest.raises(CheckpointError, match="symbols but the model"):
        Checkpoint.open(path).vocab()


def test_config_json_is_not_read_again_after_open(trained: Path) -> None:
    """Everything config.json says is taken at open: a config.json overwritten in place
    afterwards changes nothing that the opened checkpoint gives."""
    ckpt = Checkpoint.open(trained)
    (trained / CONFIG_FILE).write_text("not json")
    assert ckpt.lengths().mem_len == 40
    assert ckpt.vocab().fingerprint == ckpt.data["vocab_fingerprint"]
    assert ckpt.load_model().config == ckpt.model_config
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Checkpoint.open(trained)


def test_old_copy_after_an_interrupted_swap_is_the_one_read(tmp_path: Path) -> None:
    """NAME.old (a crash between the swap's renames) is resolved once, at open: when the new
    copy then appears at NAME, the opened checkpoint still reads the old one whole."""
    name = tmp_path / "best"
    old = tmp_path / "best.old"
    _save(name, seed=0).rename(old)  # the state a crash between the renames leaves
    ckpt = Checkpoint.open(name)
    assert ckpt.path == old
    want = _state(ckpt.load_model())
    _save(tmp_path / "newer", seed=1).rename(name)  # the second rename of the swap
    got = ckpt.load_model().state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert ckpt.weights_sha256() == hashlib.sha256((old / WEIGHTS_FILE).read_bytes()).hexdigest()
    assert Checkpoint.open(name).path == name  # a new open sees the new copy


@pytest.mark.parametrize("read", ["vocab", "load_model", "weights_sha256"])
def test_a_save_over_the_opened_copy_is_refused_not_mixed(tmp_path: Path, read: str) -> None:
    """A run saves a new checkpoint over NAME between open and a read: the read raises
    CheckpointError (one line, 'open it again'), never the new copy's file."""
    name = _save(tmp_path / "best", seed=0)
    opened = hashlib.sha256((name / WEIGHTS_FILE).read_bytes()).hexdigest()
    ckpt = Checkpoint.open(name)
    _save(name, seed=1)  # atomic: NAME -> NAME.old, new -> NAME, NAME.old removed
    with pytest.raises(CheckpointError, match=r"replaced after it was opened.*open it again"):
        getattr(ckpt, read)()
    assert Checkpoint.open(name).weights_sha256() != opened  # the new copy is another


@pytest.mark.parametrize(
    ("read", "reader"), [("vocab", "Vocab.load"), ("load_model", "load_model")]
)
def test_a_save_during_a_read_is_caught_after_it(tmp_path, monkeypatch, read, reader) -> None:
    """The save lands after the check before the read: the reader then reads the new copy's
    file, and the check after the read refuses what it read."""
    import txlm.checkpoints.checkpoint as module

    name = _save(tmp_path / "best", seed=0)
    ckpt = Checkpoint.open(name)
    owner, attr = (module.Vocab, "load") if reader == "Vocab.load" else (module, "load_model")
    real = getattr(owner, attr)

    def save_then_read(*args, **kwargs):
        _save(name, seed=1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, save_then_read)
    with pytest.raises(CheckpointError, match="replaced after it was opened"):
        getattr(ckpt, read)()
    assert "vocab" not in ckpt._cache


def test_a_checkpoint_moved_away_after_open_is_refused(tmp_path: Path) -> None:
    name = _save(tmp_path / "best")
    ckpt = Checkpoint.open(name)
    os.rename(name, tmp_path / "elsewhere")
    for read in (ckpt.vocab, ckpt.load_model, ckpt.weights_sha256):
        with pytest.raises(CheckpointError, match="moved or replaced"):
            read()


def test_a_hub_name_that_is_no_folder_says_how_to_convert_it(tmp_path, monkeypatch) -> None:
    """Offline and not converted yet: one line naming the way to convert a local copy."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TXLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    for call in (txlm.load, txlm.load_vocab, Checkpoint.open):
        with pytest.raises(CheckpointError) as info:
            call("transfo-xl/transfo-xl-wt103")
        msg = str(info.value)
        assert "\n" not in msg
        assert "txlm convert --from hf DIR --out " in msg
    with pytest.raises(CheckpointError) as info:
        txlm.load(tmp_path / "a" / "b" / "c")  # a path of three parts: no Hub name
    assert "convert" not in str(info.value)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> Path:
    """A checkpoint of a run on a prepared text corpus, as `txlm train` leaves it."""
    from tests.helpers.reliability import corpus_text
    from txlm.data import load_prepared, prepare_dataset

    root = tmp_path_factory.mktemp("opens")
    (root / "corpus.txt").write_text(corpus_text(60))
    name = f"text:{root / 'corpus.txt'}"
    corpus = load_prepared(prepare_dataset(name, root / "data", progress=False))
    train = {"data": {"dataset": name, "data_dir": str(root / "data")}, "eval": EVAL}
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig.from_preset("debug", vocab_size=len(corpus.vocab)))
    extra = {"vocab_fingerprint": corpus.vocab.fingerprint, "train": train}
    return save(model, root / "run" / "best", vocab=corpus.vocab, extra_config=extra)


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "{ckpt}", "--split", "valid", "--max-steps", "2", "--json"],
        ["eval", "{ckpt}", "--file", "{text}", "--json"],
        ["generate", "{ckpt}", "--prompt", "The", "--max-new-tokens", "3", "--seed", "0"],
        ["info", "{ckpt}", "--json"],
    ],
    ids=["eval-split", "eval-file", "generate", "info"],
)
def test_each_command_opens_config_json_once(text_run: Path, tmp_path: Path, argv, runner) -> None:
    """Each command opens its checkpoint's config.json once (counted by an audit hook in a
    forked `python -m txlm`: tests/helpers/reliability_cli_runner.py)."""
    text = tmp_path / "notes.txt"
    text.write_text("The cat sat on the mat.\n" * 4)
    count = tmp_path / "count"
    args = [a.format(ckpt=text_run, text=text) for a in argv]
    env = {"COUNT_OPENS_OF": str(text_run / CONFIG_FILE), "COUNT_OUT": str(count)}
    rc, out, err = runner.run(args, tmp_path, tmp_path / "io", env)
    assert rc == 0, err
    assert out.strip()  # the command did its work
    assert count.read_text() == "1"


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory) -> Path:
    """A classifier checkpoint whose run names its ``classes:DIR`` dataset (given splits)."""
    from tests.helpers.classify import marker_documents, save_classifier, tiny_lm

    root = tmp_path_factory.mktemp("classifier-opens")
    marker_documents(root / "ds", {"train": 4, "valid": 2, "test": 2})
    train = {"data": {"dataset": f"classes:{root / 'ds'}"}, "run": {"seed": 0}}
    return save_classifier(root / "run" / "best", tiny_lm(root / "lm"), train=train)


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "{ckpt}", "--split", "valid", "--json"],
        ["classify", "{ckpt}", "{doc}", "--json"],
        ["info", "{ckpt}", "--json"],
    ],
    ids=["eval", "classify", "info"],
)
def test_a_classifiers_commands_open_config_json_once(
    classifier_run: Path, tmp_path: Path, argv, runner
) -> None:
    """A classifier's checkpoint is read as a language model's: opened once by the command,
    its model built from that copy (no second open by a classifier loader)."""
    count = tmp_path / "count"
    doc = classifier_run.parent.parent / "ds" / "test" / "x" / "000.txt"
    args = [a.format(ckpt=classifier_run, doc=doc) for a in argv]
    env = {"COUNT_OPENS_OF": str(classifier_run / CONFIG_FILE), "COUNT_OUT": str(count)}
    rc, out, err = runner.run(args, tmp_path, tmp_path / "io", env)
    assert rc == 0, err
    assert json.loads(out.splitlines()[0])  # the command did its work
    assert count.read_text() == "1"
