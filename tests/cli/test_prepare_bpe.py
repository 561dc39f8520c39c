"""A bpe corpus end to end through the CLI: prepare, train, then generate / eval --file /
eval from the checkpoint alone, whose tokenizer.json travels with it. Word-level <unk>
counts reach prepare's and eval's output."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from tests.helpers.train import FAST, tiny_text, txlm

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.slow  # a few CLI runs, training included

UNICODE_TAIL = "Ünïcödé naïve — 日本語 ✓ 😀\n\tend  \n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe-run")
    text = tiny_text(root, n_chars=12000)
    text.write_text(text.read_text() + UNICODE_TAIL * 3)
    data = root / "data"
    p = txlm(["prepare", f"text:{text}", "--level", "bpe", "--vocab-size", "400", "--json"], data)
    assert p.returncode == 0, p.stderr
    prepared = json.loads(p.stdout)
    t = txlm(
        [
            "train", "--preset", "debug", "--out", str(root / "run"), "--set",
            f"data.dataset=text:{text}", "data.level=bpe", "data.batch_size=4",
            "optim.max_steps=6", "eval.eval_interval=3", "eval.sample_tokens=5", *FAST,
        ],
        data,
    )  # fmt: skip
    assert t.returncode == 0, t.stderr
    # The checkpoint must stand alone: the prepared data goes away.
    shutil.rmtree(data / "text-tiny-bpe")
    return root, text, prepared, t.stdout


def test_prepare_reports_bpe(run):
    _, _, prepared, _ = run
    assert prepared["level"] == "bpe" and prepared["metric"] == "bpb"
    assert 257 < prepared["vocab_size"] <= 400
    assert prepared["bytes_per_token"]["train"] > 1.5  # subwords: several bytes per token
    assert "unk_tokens" not in prepared  # bytes: nothing is unknown


def test_checkpoint_carries_its_tokenizer(run):
    root, _, prepared, stdout = run
    best = root / "run" / "best"
    assert (best / "tokenizer.json").is_file() and (best / "vocab.json").is_file()
    config = json.loads((best / "config.json").read_text())
    assert config["dataset"]["metric"] == "bpb"
    from txlm.checkpoints.checkpoint import load_vocab

    vocab = load_vocab(best)
    assert config["vocab_fingerprint"] == vocab.fingerprint
    assert len(vocab) == prepared["vocab_size"] == config["model"]["vocab_size"]
    assert "bpb" in stdout  # training reports bits per byte
    valid = [json.loads(x) for x in (root / "run/metrics.jsonl").read_text().splitlines()]
    valid = [r for r in valid if r["split"] == "valid"]
    assert valid and all(0 < r["bpb"] < 16 for r in valid)


def test_generate_from_the_checkpoint_decodes_text(run):
    root, _, _, _ = run
    prompt = "Ünïcödé 😀 The"
    g = txlm(
        ["generate", str(root / "run/best"), "--prompt", prompt, "--max-new-tokens", "12",
         "--seed", "0", "--json"],
        root,
    )  # fmt: skip
    assert g.returncode == 0, g.stderr
    out = json.loads(g.stdout)
    from txlm.checkpoints.checkpoint import load_vocab

    vocab = load_vocab(root / "run/best")
    ids = vocab.encode(prompt)
    assert out["prompt_tokens"] == [len(ids)]
    assert vocab.decode(ids) == prompt
    assert out["samples"][0] == vocab.decode(ids + out["sample_ids"][0])[len(prompt) :]
    # The same seed in text mode prints the prompt, then the same continuation.
    g2 = txlm(
        ["generate", str(root / "run/best"), "--prompt", prompt, "--max-new-tokens", "12",
         "--seed", "0"],
        root,
    )  # fmt: skip
    assert g2.returncode == 0 and g2.stdout.startswith(prompt + out["samples"][0])


def test_eval_file_reports_bits_per_byte(run):
    root, text, _, _ = run
    e = txlm(["eval", str(root / "run/best"), "--file", str(text), "--json"], root)
    assert e.returncode == 0, e.stderr
    r = json.loads(e.stdout)
    n_bytes = len(text.read_bytes())
    assert r["metric"] == "bpb" and r["text_bytes"] == n_bytes and r["unk_tokens"] == 0
    # bits per byte = the loss summed over every token of the file, per byte
    assert r["bpb"] == pytest.approx(r["loss"] * r["tokens"] / n_bytes / math.log(2))
    assert r["ppl"] == pytest.approx(math.exp(r["loss"]))
    # <eos> opens the file as it opened every training document: all its tokens are scored
    from txlm.checkpoints.checkpoint import load_vocab

    assert r["tokens"] == len(load_vocab(root / "run/best").encode(text.read_text()))
    # The same number through txlm.score with the checkpoint's model and vocabulary.
    from txlm import load
    from txlm.inference.score import score

    model, vocab = load(root / "run/best"), load_vocab(root / "run/best")
    ids = torch.tensor([vocab.eos_id, *vocab.encode(text.read_text())])
    logp = score(model, ids, tgt_len=r["tgt_len"], mem_len=r["mem_len"])
    assert float(-logp.double().sum()) / n_bytes / math.log(2) == pytest.approx(r["bpb"], 1e-6)
    plain = txlm(["eval", str(root / "run/best"), "--file", str(text)], root)
    assert "(bits per byte), token ppl" in plain.stdout


def test_word_level_unk_counts_in_prepare_and_eval(tmp_path):
    text = tiny_text(tmp_path, n_chars=12000)
    data = tmp_path / "data"
    p = txlm(["prepare", f"text:{text}", "--level", "word", "--max-vocab", "60"], data)
    assert p.returncode == 0, p.stderr
    assert "<unk> tokens: train " in p.stdout
    p = txlm(["prepare", f"text:{text}", "--level", "word", "--json"], data)
    summary = json.loads(p.stdout)
    assert summary["vocab_size"] == 60 and summary["options"]["max_vocab"] == 60
    from txlm.data import load_prepared

    corpus = load_prepared(summary["path"])
    test_ids = np.asarray(corpus.split("test"))
    unk_test = int((test_ids == corpus.vocab.unk_id).sum())
    assert summary["unk_tokens"]["test"] == unk_test > 0
    t = txlm(
        ["train", "--preset", "debug", "--out", str(tmp_path / "run"), "--set",
         f"data.dataset=text:{text}", "data.level=word", "data.batch_size=4",
         "optim.max_steps=2", "eval.eval_interval=0", "eval.final_eval=false",
         "eval.sample_tokens=0", *FAST],
        data,
    )  # fmt: skip
    assert t.returncode == 0, t.stderr
    assert len(load_prepared(summary["path"]).vocab) == 60  # train found the bounded copy
    e = txlm(["eval", str(tmp_path / "run/best"), "--split", "test", "--json"], data)
    assert e.returncode == 0, e.stderr
    assert json.loads(e.stdout)["unk_tokens"] == unk_test
    e = txlm(["eval", str(tmp_path / "run/best"), "--split", "test"], data)
    assert f"<unk> {unk_test:,} tokens in the split" in e.stdout
