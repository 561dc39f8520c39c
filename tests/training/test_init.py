"""``txlm train --init CKPT``: fine-tuning a checkpoint on another corpus (contract C38).

``python -m txlm`` runs (forked by the warm runner: the same code path as a process of its
own) on small real data: a char checkpoint trained here for a few steps, and a tiny
transformers TransfoXL with a word vocabulary in the published format (a legacy
``vocab.bin``), converted. Each fine-tuned run must learn (valid on the new corpus below
``init_valid``, measured the same way before the first step), keep the checkpoint's
vocabulary, start fresh and record where it started; killed and resumed, it ends equal to
an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.env import REPO
from tests.helpers.hf import save_tiny_hf
from tests.helpers.train import FAST, tiny_text

RUN = [
    "data.batch_size=4",
    "eval.eval_interval=0",
    "eval.sample_tokens=0",
    "run.log_interval=1",
    *FAST,
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _txlm(runner, argv: list[str], data_dir: Path, **env: str) -> tuple[int, str, str]:
    """``python -m txlm ARGV``, forked by the warm runner (the same code path as a process
    of its own, without the interpreter's and torch's start-up)."""
    io_dir = Path(tempfile.mkdtemp(prefix="io-", dir=data_dir.parent))
    return runner.run(argv, REPO, io_dir, {"TXLM_DATA_DIR": str(data_dir), **env})


def _train(runner, args: list[str], data_dir: Path) -> dict:
    rc, out, err = _txlm(runner, ["train", "--preset", "debug", *args, "--json"], data_dir)
    assert rc == 0, err
    return json.loads(out.splitlines()[-1])


def _rhymes(path: Path, lines: int = 400, seed: int = 0) -> Path:
    """A corpus unlike the play: a few short lines over and over, in the play's letters."""
    rng = random.Random(seed)
    verses = ["the cat sat on the mat", "a dog ran to the log", "my hat is on the cat"]
    path.write_text("\n".join(rng.choice(verses) for _ in range(lines)) + "\n")
    return path


@pytest.fixture(scope="module")
def char_base(tmp_path_factory, runner) -> tuple[Path, Path, object]:
    """A char checkpoint: the debug preset, 20 steps on the start of Hamlet."""
    root = tmp_path_factory.mktemp("char")
    text = tiny_text(root)
    data = root / "data"
    _train(
        runner,
        [
            "--set", f"data.dataset=text:{text}", "optim.max_steps=20", "optim.lr=3e-3",
            "eval.final_eval=false", *RUN, "--out", str(root / "base"),
        ],
        data,
    )  # fmt: skip
    return root, data, runner


def _finetune(base, out: str, *extra: str, steps: int = 30) -> dict:
    root, data, runner = base
    corpus = _rhymes(root / "rhymes.txt")
    return _train(
        runner,
        [
            "--init", str(root / "base" / "best"),
            "--set", f"data.dataset=text:{corpus}", f"optim.max_steps={steps}",
            "optim.lr=3e-3", "run.save_interval=1", *RUN, *extra, "--out", str(root / out),
        ],
        data,
    )  # fmt: skip


def test_a_char_checkpoint_fine_tuned_learns_and_keeps_its_vocabulary(char_base):
    root, data, _ = char_base
    base = root / "base" / "best"
    summary = _finetune(char_base, "ft", "model.dropout=0.0")
    results = json.loads((root / "ft" / "results.json").read_text())
    assert results["init_valid"] == summary["init_valid"]

    # learned: the same split, measured the same way, before and after
    before, after = results["init_valid"], results["valid"]
    assert before["tokens"] == after["tokens"] and before["split"] == after["split"] == "valid"
    assert after["bpc"] < before["bpc"] - 0.3, (before["bpc"], after["bpc"])

    # the checkpoint's vocabulary, file for file, and the corpus encoded with it
    base_config = json.loads((base / "config.json").read_text())
    for kind in ("best", "last"):
        assert (root / "ft" / kind / "vocab.json").read_bytes() == (
            base / "vocab.json"
        ).read_bytes()
    ft_config = json.loads((root / "ft" / "last" / "config.json").read_text())
    assert ft_config["vocab_fingerprint"] == base_config["vocab_fingerprint"]
    prepared = data / ft_config["dataset"]["prepared"]
    assert f"vocab-{base_config['vocab_fingerprint']}" in prepared.name
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["vocab_fingerprint"] == base_config["vocab_fingerprint"]
    # ... and never the copy with the corpus's own vocabulary (another alphabet's ids)
    assert not (data / "text-rhymes").exists()

    # the model is the checkpoint's, with the one setting a trained model lets change
    assert ft_config["model"] == {**base_config["model"], "dropout": 0.0}

    # where it started: in the saved configuration and results.json
    record = {"path": str(base.resolve()), "weights_sha256": _sha256(base / "model.safetensors")}
    assert {k: results["init"][k] for k in record} == record
    assert {k: ft_config["init"][k] for k in record} == record
    assert ft_config["train"]["init"] == str(base.resolve())

    # fresh: counters from 0 (the base's 20 steps are not carried), the schedule's warm-up
    state = json.loads((root / "ft" / "last" / "trainer_state.json").read_text())
    assert state["step"] == 30 and results["step"] == 30
    rows = [json.loads(r) for r in (root / "ft" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, 31))
    assert next(r for r in rows if r["split"] == "init_valid")["loss"] == before["loss"]
    # a char vocabulary with <unk>: the rhymes' letters are all the play's
    assert results["unknown_share"] == {"train": 0.0, "valid": 0.0, "test": 0.0}


def test_a_killed_fine_tuning_run_resumes_bit_for_bit(char_base):
    """Killed after step 7 (the fault seam), resumed from `last`: the same weights, Adam
    moments and init_valid as a run that was never interrupted (the same computation)."""
    root, data, runner = char_base
    straight = _finetune(char_base, "straight", steps=12)
    corpus = root / "rhymes.txt"
    argv = [
        "train", "--preset", "debug", "--init", str(root / "base" / "best"),
        "--set", f"data.dataset=text:{corpus}", "optim.max_steps=12", "optim.lr=3e-3",
        "run.save_interval=1", *RUN, "--out", str(root / "killed"),
    ]  # fmt: skip
    rc, _, err = _txlm(runner, argv, data, TXLM_FAULT="step:7:kill")
    assert rc == -9, err
    state = json.loads((root / "killed" / "last" / "trainer_state.json").read_text())
    assert state["step"] == 6  # `last` as saved after step 6; step 7 was lost with the process
    rc, out, err = _txlm(
        runner, ["train", "--resume", str(root / "killed" / "last"), "--json"], data
    )
    assert rc == 0, err
    resumed = json.loads(out.splitlines()[-1])
    assert resumed["step"] == straight["step"] == 12
    # measured once by the killed process and carried in `last` (its timing aside)
    same = ("loss", "bpc", "tokens", "segments", "tgt_len", "mem_len")
    assert {k: resumed["init_valid"][k] for k in same} == {
        k: straight["init_valid"][k] for k in same
    }
    assert resumed["init"] == straight["init"]
    for name in ("model.safetensors", "optimizer.safetensors"):
        a = load_file(str(root / "straight" / "last" / name))
        b = load_file(str(root / "killed" / "last" / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key} differs after kill/resume"


# -- a converted word-level checkpoint ------------------------------------------------------

WORDS = [
    "the", "of", "and", "to", "a", "in", "is", "was", "he", "for", "it", "with", "as", "his",
    "on", "be", "at", "by", "had", "not", "are", "but", "from", "or", "have", "an", "they",
    "which", "one", "you", "were", "her", "all", "she", "there", "would", "their", "we",
]  # fmt: skip
SYMBOLS = ["<eos>", "<unk>", *WORDS]  # 40: TINY_HF's vocab_size


def _word_corpus(path: Path, lines: int = 600, seed: int = 1) -> tuple[Path, str]:
    """Capitalised lines (the tokenizer lower-cases), mostly the vocabulary's words, few
    of them frequent, and now and then a word it lacks."""
    rng = random.Random(seed)
    common, rare = WORDS[:6], WORDS[6:]
    out = []
    for _ in range(lines):
        words = [
            rng.choice(["zebra", "quasar"])
            if rng.random() < 0.05
            else rng.choice(common if rng.random() < 0.8 else rare)
            for _ in range(rng.randint(4, 9))
        ]
        out.append(" ".join([words[0].capitalize(), *words[1:]]))
    text = "\n".join(out) + "\n"
    path.write_text(text)
    return path, text


def test_a_converted_word_checkpoint_fine_tuned_learns_and_reports_its_unknown_share(
    tmp_path, runner
):
    hf = tmp_path / "hf"
    save_tiny_hf(hf, safe=False)
    legacy = {
        "idx2sym": SYMBOLS,
        "sym2idx": OrderedDict((s, i) for i, s in enumerate(SYMBOLS)),
        "special": ["<eos>"],
        "lower_case": True,
        "delimiter": None,
    }
    torch.save(legacy, hf / "vocab.bin", _use_new_zipfile_serialization=False)  # published form
    data = tmp_path / "data"
    rc, _, err = _txlm(
        runner, ["convert", "--from", "hf", str(hf), "--out", str(tmp_path / "tx")], data
    )
    assert rc == 0, err
    corpus, text = _word_corpus(tmp_path / "words.txt")

    rc, out, err = _txlm(
        runner,
        [
            "train", "--init", str(tmp_path / "tx"),
            "--set", f"data.dataset=text:{corpus}", "optim.max_steps=40", "optim.lr=1e-2",
            "data.tgt_len=16", "model.mem_len=16", "eval.final_max_tokens=100000", *RUN,
            "--out", str(tmp_path / "ft"),
        ],
        data,
    )  # fmt: skip
    assert rc == 0, err
    results = json.loads((tmp_path / "ft" / "results.json").read_text())
    assert results["valid"]["ppl"] < results["init_valid"]["ppl"] * 0.92, (
        results["init_valid"]["ppl"],
        results["valid"]["ppl"],
    )
    assert results["init"]["text"] == {"lower_case": True}

    # The unknown share, counted here from the text: text: splits cut 90/5/5 at line starts;
    # each line is its words and an <eos>, and (lower-cased) only zebra and quasar are unknown.
    ft_config = json.loads((tmp_path / "ft" / "last" / "config.json").read_text())
    meta = json.loads((data / ft_config["dataset"]["prepared"] / "meta.json").read_text())
    train_tokens = meta["splits"]["train"]["tokens"]
    lines = text.splitlines()
    tokens = unknown = 0
    for line in lines:
        if tokens >= train_tokens:
            break
        words = line.lower().split()
        tokens += len(words) + 1
        unknown += sum(w not in SYMBOLS for w in words)
    assert tokens == train_tokens
    assert results["unknown_share"]["train"] == unknown / train_tokens
    assert 0.02 < results["unknown_share"]["train"] < 0.08  # about 5% of the words
    assert set(results["unknown_share"]) == {"train", "valid", "test"}
    assert "unknown symbols (<unk>) in the corpus: train" in out

    # the converted vocabulary, kept; and the fine-tuned model generates with it
    assert (tmp_path / "ft" / "best" / "vocab.json").read_bytes() == (
        tmp_path / "tx" / "vocab.json"
    ).read_bytes()
    rc, out, err = _txlm(
        runner,
        ["generate", str(tmp_path / "ft" / "best"), "--prompt", "The Of", "--max-new-tokens",
         "8", "--seed", "0"],
        data,
    )  # fmt: skip
    assert rc == 0, err
    # the prompt lower-cased as the converted tokenizer did (its record carried by the run):
    # no <unk> in it
    assert "not in the vocabulary" not in err, err
    assert all(w in SYMBOLS for w in out.split()[2:]), out


# -- optim.freeze ---------------------------------------------------------------------------


def test_frozen_parameters_stay_the_checkpoints_and_hold_no_adam_state(char_base):
    root, _, _ = char_base
    _finetune(char_base, "frozen", "optim.freeze=[embed]", steps=6)
    base = load_file(str(root / "base" / "best" / "model.safetensors"))
    tuned = load_file(str(root / "frozen" / "last" / "model.safetensors"))
    frozen = [k for k in base if k.startswith("embed.")]
    assert frozen
    for key in base:  # copied, never stepped: the very values
        assert torch.equal(base[key], tuned[key]) == (key in frozen), key
    # Adam's state exists for the trained parameters only
    from txlm.checkpoints.checkpoint import Checkpoint
    from txlm.model import TransformerXL

    with torch.device("meta"):
        model = TransformerXL(Checkpoint.open(root / "frozen" / "last").model_config)
    names = [n for n, _ in model.named_parameters()]
    moments = load_file(str(root / "frozen" / "last" / "optimizer.safetensors"))
    stepped = {names[int(k.split(".")[0])] for k in moments}
    assert stepped == {n for n in names if not n.startswith("embed.")}


def test_the_resource_check_counts_no_gradients_or_moments_for_frozen_parameters(
    tmp_path, monkeypatch
):
    from tests.helpers.train import tiny_config
    from txlm import resources
    from txlm.training import Trainer

    seen: list[dict[str, int]] = []
    real_check = resources.check

    def spy(needs, device, *, doing):
        seen.append({n.what: n.nbytes for n in needs})
        real_check(needs, device, doing=doing)

    monkeypatch.setattr(resources, "check", spy)
    common = ["optim.max_steps=1", "run.tensorboard=false", "run.progress=false"]
    plain = Trainer(tiny_config(tmp_path, *common), tmp_path / "a", echo=False)
    frozen = Trainer(
        tiny_config(tmp_path, *common, "optim.freeze=[embed, layers.0]"), tmp_path / "b",
        echo=False,
    )  # fmt: skip
    kept = {id(p): p for n, p in frozen.model.named_parameters() if not p.requires_grad}
    n_frozen = sum(p.numel() for p in kept.values())
    embed_and_first = {
        id(p): p
        for n, p in plain.model.named_parameters(remove_duplicate=False)
        if n.startswith(("embed.", "layers.0."))
    }
    assert n_frozen == sum(p.numel() for p in embed_and_first.values()) > 0
    what = "gradients and Adam's moments"
    # fp32: a gradient and two moments, 4 bytes each, per trained parameter
    assert seen[0][what] - seen[1][what] == 12 * n_frozen
    assert {k: v for k, v in seen[0].items() if k != what} == {
        k: v for k, v in seen[1].items() if k != what
    }


def test_a_corpus_encoded_with_a_given_vocabulary_never_shares_a_folder_with_its_own(tmp_path):
    """The corpus's own copy, a copy encoded with a checkpoint's vocabulary, and the own copy
    of a file whose name spells that copy's name: three folders, each with its vocabulary."""
    from txlm.data import load_prepared, open_corpus
    from txlm.data.vocab import Vocab

    text = "the cat sat on the mat\n" * 200
    (tmp_path / "b.txt").write_text(text)
    given = Vocab.build_char({c: 1 for c in "the cat sat on mat\nxyz"})
    own = open_corpus(f"text:{tmp_path / 'b.txt'}", tmp_path / "data")
    tuned = open_corpus(f"text:{tmp_path / 'b.txt'}", tmp_path / "data", vocab=given)
    twin = tmp_path / f"{tuned.path.name.removeprefix('text-')}.txt"
    twin.write_text(text)
    spelt = open_corpus(f"text:{twin}", tmp_path / "data")
    folders = {own.path, tuned.path, spelt.path}
    assert len(folders) == 3
    assert tuned.vocab.fingerprint == given.fingerprint != own.vocab.fingerprint
    assert load_prepared(own.path).vocab.fingerprint == own.vocab.fingerprint  # untouched
    assert spelt.vocab.fingerprint == own.vocab.fingerprint
    # the same ids as the given vocabulary encodes the text to (its own numbering kept)
    assert tuned.split("train").tolist() == given.encode(text)[: len(tuned.split("train"))]


def test_a_configuration_with_init_set_by_hand_must_hold_the_checkpoints_model(char_base):
    """Python users may set ``init`` themselves; a model section that is not the
    checkpoint's is refused by name before anything is read or prepared."""
    from txlm.errors import ConfigError
    from txlm.training import Trainer
    from txlm.training.config import resolve
    from txlm.training.init import open_init

    root, _, _ = char_base
    corpus = _rhymes(root / "rhymes.txt")
    sets = [f"data.dataset=text:{corpus}", f"data.data_dir={root / 'data'}"]
    config = resolve("debug", None, [*sets, "model.n_layer=3"])
    config.init = str(root / "base" / "best")
    with pytest.raises(ConfigError, match=r"model\.n_layer"):
        Trainer(config, root / "by-hand", echo=False)
    assert not (root / "by-hand").exists()
    # through resolve(..., init=...) the same settings but for n_layer are a run
    config = resolve("debug", None, sets, init=open_init(root / "base" / "best"))
    trainer = Trainer(config, root / "by-api", echo=False)
    assert trainer.model_config == open_init(root / "base" / "best").model_config


# -- fast pieces of a run started from a checkpoint ---------------------------------------


def _tiny_checkpoint(path: Path, train: dict | None = None) -> Path:
    """A debug-shaped checkpoint with a char vocabulary (``train``: its run's record)."""
    from collections import Counter

    from txlm.checkpoints.checkpoint import save
    from txlm.config import ModelConfig
    from txlm.data import Vocab
    from txlm.model import TransformerXL

    vocab = Vocab.build_char(Counter("abcdefgh ,.\n"))
    config = ModelConfig.from_preset("debug", vocab_size=len(vocab), tgt_len=10, mem_len=20)
    extra: dict = {"vocab_fingerprint": vocab.fingerprint}
    if train is not None:
        extra["train"] = train
    return save(TransformerXL(config), path, vocab=vocab, extra_config=extra)


@pytest.mark.parametrize("recorded", [True, False], ids=["trained", "converted"])
def test_init_takes_the_checkpoints_evaluation_lengths_not_the_presets(tmp_path, recorded):
    """The preset's eval lengths (debug: mem 32) describe another model: a run started from
    a checkpoint evaluates as that checkpoint's run did (else with its model's lengths), and
    an eval.* setting still wins."""
    from txlm.checkpoints.checkpoint import Checkpoint
    from txlm.training.config import preset_config, resolve

    saved = {"eval_tgt_len": 6, "eval_mem_len": 44, "eval_clamp_len": 30, "same_length": True}
    path = _tiny_checkpoint(tmp_path / "ckpt", {"eval": saved} if recorded else None)
    want = saved if recorded else {"eval_tgt_len": 10, "eval_mem_len": 20,
                                   "eval_clamp_len": -1, "same_length": False}  # fmt: skip
    preset = preset_config("debug").eval
    assert [getattr(preset, k) for k in want] != list(want.values())  # the test can tell
    sets = [f"data.dataset=text:{tmp_path / 'x.txt'}"]
    config = resolve("debug", None, sets, init=Checkpoint.open(path))
    assert {k: getattr(config.eval, k) for k in want} == want
    config = resolve("debug", None, [*sets, "eval.eval_mem_len=7"], init=Checkpoint.open(path))
    assert config.eval.eval_mem_len == 7 and config.eval.eval_tgt_len == want["eval_tgt_len"]


def test_freezing_a_layer_is_that_layer_not_every_name_it_prefixes():
    """``optim.freeze=[layers.1]`` is layer 1 only: a prefix is whole dotted components,
    so layers.10 and layers.11 train."""
    from txlm.config import ModelConfig
    from txlm.model import TransformerXL
    from txlm.training.build import frozen_parameters

    with torch.device("meta"):
        model = TransformerXL(ModelConfig.from_preset("debug", vocab_size=50, n_layer=12))
    names = {id(p): n for n, p in model.named_parameters()}
    frozen = {names[id(p)] for p in frozen_parameters(model, ["layers.1"])}
    assert frozen and all(n.startswith("layers.1.") for n in frozen)
    assert frozen == {n for n in names.values() if n.startswith("layers.1.")}
    both = {names[id(p)] for p in frozen_parameters(model, ["layers.1.", "layers.10"])}
    assert both == frozen | {n for n in names.values() if n.startswith("layers.10.")}
