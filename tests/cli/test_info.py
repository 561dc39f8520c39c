"""``txlm info CKPT``: a short summary a person reads (what it is, model, vocabulary,
lengths, training, task); ``--json``: the whole record, one object."""

from __future__ import annotations

import json
from collections import Counter

from tests.helpers.classify import save_classifier, tiny_lm
from txlm.checkpoints import checkpoint
from txlm.cli import main
from txlm.config import PRESETS, ModelConfig
from txlm.data.vocab import Vocab
from txlm.model import TransformerXL


def info(capsys, *argv: str) -> str:
    assert main(["info", *argv]) == 0
    return capsys.readouterr().out


def test_a_fine_tuned_language_model_in_a_few_lines(tmp_path, capsys):
    vocab = Vocab.build_char(Counter("abcdefgh"), unk=True)
    config = ModelConfig.from_dict({**PRESETS["debug"].model, "vocab_size": len(vocab)})
    extra = {
        "vocab_fingerprint": vocab.fingerprint,
        "train": {"optim": {"max_steps": 300}, "data": {"dataset": "text:sonnets.txt"},
                  "eval": {"eval_mem_len": 64}},
        "checkpoint": {"kind": "best", "step": 250, "best_valid_loss": 1.23456},
        "dataset": {"name": "text:sonnets.txt", "path": "/data/text-sonnets"},
        "init": {"path": "/runs/base/best"},
    }  # fmt: skip
    model = TransformerXL(config)
    ckpt = checkpoint.save(model, tmp_path / "best", vocab=vocab, extra_config=extra)
    out = info(capsys, str(ckpt))
    c = config
    assert out.splitlines() == [
        f"{ckpt}: a language model, {model.num_parameters():,} parameters",
        f"  model: {c.n_layer} layers, d_model {c.d_model}, {c.n_head}x{c.d_head} heads, "
        f"d_inner {c.d_inner}, xl attention, full softmax",
        f"  vocabulary: char, {len(vocab)} symbols (fingerprint {vocab.fingerprint})",
        f"  lengths: trained tgt_len {c.tgt_len}, mem_len {c.mem_len}; evaluated tgt_len "
        f"{c.tgt_len}, mem_len 64, clamp_len {c.clamp_len}, same_length {c.same_length}",
        "  training: step 250 of 300 on text:sonnets.txt, best valid loss 1.2346 (prepared "
        "/data/text-sonnets)",
        "  fine-tuned from: /runs/base/best",
        "  task: language model",
        "  (--json: the whole record)",
    ]
    record = json.loads(info(capsys, str(ckpt), "--json"))
    assert record["params"] == model.num_parameters() and record["init"] == extra["init"]
    assert record["model"] == config.to_dict() and record["checkpoint"]["step"] == 250


def test_a_classifier_and_a_bare_model(tmp_path, capsys):
    lm = tiny_lm(tmp_path / "lm")
    cls = save_classifier(tmp_path / "cls", lm, labels=("poem", "prose"))
    lines = info(capsys, str(cls)).splitlines()
    assert lines[0].startswith(f"{cls}: a classifier, ")
    assert "  task: classify into poem, prose; pooling mean" in lines
    bare = checkpoint.save(TransformerXL(ModelConfig.from_preset("debug")), tmp_path / "bare")
    lines = info(capsys, str(bare)).splitlines()
    assert "  vocabulary: none saved (" in lines[2] and len(lines) == 6
