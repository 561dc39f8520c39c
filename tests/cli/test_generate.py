"""``txlm generate`` and ``txlm.score`` end to end on tiny saved checkpoints.

Bad input: one line on stderr, exit code 2, checked in-process (fast) and once through a real
subprocess. The happy paths run the installed CLI as a user would.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

import txlm
from tests.helpers.models import spread_weights
from tests.helpers.train import txlm as forked_txlm
from txlm.checkpoints.checkpoint import Checkpoint
from txlm.cli import main
from txlm.config import ModelConfig
from txlm.errors import ConfigError
from txlm.inference.generate import stream
from txlm.inference.sampling import SamplingConfig
from txlm.inference.score import score, score_file
from txlm.model import TransformerXL

data = pytest.importorskip("txlm.data", reason="needs the data package (branch data)")
Vocab = data.Vocab

CHARS = "abcdefghijklmnopqrstuvwxyz ,.:\nROMEO"


def _save(path: Path, vocab, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = TransformerXL(ModelConfig.from_preset("debug", vocab_size=len(vocab)))
    spread_weights(model, 0.1)
    return txlm.save(model, path, vocab_json=vocab.to_json())


@pytest.fixture(scope="module")
def char_ckpt(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("gen") / "char", Vocab.build_char(Counter(CHARS)))


@pytest.fixture(scope="module")
def strict_ckpt(tmp_path_factory) -> Path:
    """A character vocabulary without <unk>: unknown symbols are refused."""
    vocab = Vocab.build_char(Counter(CHARS), unk=False)
    return _save(tmp_path_factory.mktemp("gen") / "strict", vocab)


@pytest.fixture(scope="module")
def word_ckpt(tmp_path_factory) -> Path:
    vocab = Vocab.build_word(Counter(["the", "cat", "sat", "on", "a", "mat", "and", "the", "dog"]))
    return _save(tmp_path_factory.mktemp("gen") / "word", vocab)


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return forked_txlm(list(argv), None, timeout=120)  # `python -m txlm`, forked


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--top-k", "0"], "top-k"),
        (["--top-p", "0"], "top-p"),
        (["--top-p", "1.5"], "top-p"),
        (["--temperature", "-2"], "temperature"),
        (["--min-p", "1.5"], "min-p"),
        (["--repetition-penalty", "0"], "repetition penalty"),
        (["--ban", "nosuchsymbol"], "cannot ban"),
        (["--stop", ""], "stop strings"),
        (["--max-new-tokens", "-1"], "max-new-tokens"),
        (["--num-samples", "0"], "num-samples"),
        (["--precision", "fp16"], "fp16 needs a GPU"),
    ],
)
def test_bad_flags_exit_2_with_one_line(flags, needle, char_ckpt, capsys) -> None:
    rc = main(["generate", str(char_ckpt), "--prompt", "ab", *flags])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("txlm: error: ") and err.count("\n") == 1 and needle in err


def test_bad_inputs_exit_2(char_ckpt, strict_ckpt, tmp_path, capsys) -> None:
    cases = [
        ["generate", str(tmp_path / "nope"), "--prompt", "a"],
        ["generate", str(char_ckpt), "--prompt-file", str(tmp_path / "missing.txt")],
        ["generate", str(strict_ckpt), "--prompt", "ab\u00e9"],  # no <unk> to map it to
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("txlm: error: ") and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exc:  # argparse: neither --prompt nor --prompt-file
        main(["generate", str(char_ckpt)])
    assert exc.value.code == 2


def test_bf16_generation_follows_fp32_greedy(char_ckpt, capsys, monkeypatch) -> None:
    """--precision bf16 runs the decoder under autocast (its weight products in bf16); greedy
    text starts as fp32's does (bf16 rounding may flip a near-tie later: a prefix only)."""
    from txlm.inference.decode import Decoder

    prepared: list[torch.dtype] = []
    original = Decoder.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        prepared.append(self.dtype)

    monkeypatch.setattr(Decoder, "__init__", recording)
    argv = ["generate", str(char_ckpt), "--prompt", "ab", "--greedy", "--max-new-tokens", "8"]
    samples = {}
    for precision in ("fp32", "bf16"):
        prepared.clear()
        assert main([*argv, "--precision", precision, "--json"]) == 0
        samples[precision] = json.loads(capsys.readouterr().out)["sample_ids"][0]
        assert prepared == [torch.float32 if precision == "fp32" else torch.bfloat16]
    assert len(samples["bf16"]) == 8
    assert samples["bf16"][:2] == samples["fp32"][:2]


@pytest.mark.parametrize("machine, has_bf16, precision, noted", [
    ("x86_64", False, "bf16", True),  # emulated bf16: slower than fp32, said once
    ("x86_64", True, "bf16", False),
    ("x86_64", False, "fp32", False),
    ("aarch64", False, "bf16", False),  # (the x86 instruction says nothing of an Arm CPU)
])  # fmt: skip
def test_bf16_on_a_cpu_that_emulates_it_says_so(
    char_ckpt, capsys, monkeypatch, machine, has_bf16, precision, noted
) -> None:
    import platform

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: has_bf16)
    argv = ["generate", str(char_ckpt), "--prompt", "ab", "--max-new-tokens", "2", "--json"]
    assert main([*argv, "--precision", precision]) == 0
    err = capsys.readouterr().err
    note = (
        "txlm: note: this CPU has no AVX512-BF16 instructions, so bf16 products are "
        "emulated and run slower than fp32 here\n"
    )
    assert (note in err) == noted and err.count("AVX512") == noted


def test_greedy_with_temperature_zero_is_allowed(char_ckpt, capsys) -> None:
    argv = ["generate", str(char_ckpt), "--prompt", "ab", "--greedy", "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["sample_ids"][0]) == 3


@pytest.mark.slow
def test_subprocess_generate_streams_seeded_text(char_ckpt) -> None:
    argv = ["generate", str(char_ckpt), "--prompt", "ROMEO:", "--max-new-tokens", "30"]
    first = _cli(*argv, "--seed", "5")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("ROMEO:")
    again = _cli(*argv, "--seed", "5", "--json")
    result = json.loads(again.stdout)
    assert len(result["sample_ids"][0]) == 30  # 30 tokens (a random model may draw <unk>)
    assert first.stdout == "ROMEO:" + result["samples"][0] + "\n"  # same seed, same text
    model, vocab = txlm.load(char_ckpt), Vocab.load(char_ckpt / "vocab.json")
    [ids] = txlm.generate(model, vocab.encode("ROMEO:"), max_new_tokens=30, seed=5, vocab=vocab)
    assert result["sample_ids"][0] == ids  # the CLI is the library
    # the rate is the decoding's, after the first token (which a --compile run compiles)
    assert 0 < result["first_token_s"] < result["seconds"]
    rate = 29 / (result["seconds"] - result["first_token_s"])
    assert result["tokens_per_s"] == pytest.approx(rate, rel=1e-2)
    assert "the first after" in first.stderr
    bad = _cli("generate", str(char_ckpt), "--prompt", "x", "--top-p", "2")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_empty_prompt_unk_and_samples(word_ckpt, capsys) -> None:
    base = ["generate", str(word_ckpt), "--max-new-tokens", "6", "--seed", "1", "--json"]
    assert main([*base, "--prompt", ""]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == [0] and len(out["sample_ids"][0]) == 6
    assert main([*base, "--prompt", "the zebra cat", "--num-samples", "3"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert "1 prompt symbol(s) not in the vocabulary -> <unk>" in cap.err
    assert out["prompt_tokens"] == [3]  # no <eos> after an unfinished line
    assert len(out["samples"]) == 3 and len({tuple(s) for s in out["sample_ids"]}) > 1


def test_score_equals_one_forward_and_restores_lengths(char_ckpt) -> None:
    model = txlm.load(char_ckpt)
    ids = torch.randint(
        0, model.config.vocab_size, (120,), generator=torch.Generator().manual_seed(0)
    )
    whole = model(ids[None, :-1], labels=ids[None, 1:]).losses[0]
    before = model.config
    got = score(model, ids, tgt_len=7, mem_len=200)  # segments + memory reach everything
    assert model.config == before
    torch.testing.assert_close(got, -whole, atol=1e-5, rtol=0)
    # short memory: equals the segment loop written out by hand
    lengths = model.lengths.replace(tgt_len=10, mem_len=5)
    mems, want = None, []
    for lo in range(0, 119, 10):
        out = model(
            ids[None, lo : min(lo + 10, 119)], mems=mems, labels=ids[None, lo + 1 : lo + 11],
            lengths=lengths,
        )  # fmt: skip
        mems = out.mems
        want.append(-out.losses[0])
    torch.testing.assert_close(score(model, ids, tgt_len=10, mem_len=5), torch.cat(want))
    vocab = Vocab.load(char_ckpt / "vocab.json")
    torch.testing.assert_close(
        score(model, "ROMEO: a cat", vocab), score(model, vocab.encode("ROMEO: a cat"))
    )
    with pytest.raises(txlm.TxlmError, match="vocabulary"):
        score(model, "text without a vocab")


def test_score_file_reports_bpc(char_ckpt, tmp_path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("ROMEO: a cat sat.\n" * 10)
    res = score_file(char_ckpt, f, lengths=Checkpoint.open(char_ckpt).lengths(16, 32))
    model, vocab = txlm.load(char_ckpt), Vocab.load(char_ckpt / "vocab.json")
    lp = score(model, vocab.encode(f.read_text()), tgt_len=16, mem_len=32)
    assert res["tokens"] == 179 and res["metric"] == "bpc"
    assert res["bpc"] == pytest.approx(float(-lp.double().mean()) / 0.6931471805599453)


def test_eval_file_through_the_cli(char_ckpt, tmp_path) -> None:
    """``txlm eval CKPT --file F`` scores any text file with memory carried."""
    f = tmp_path / "t.txt"
    f.write_text("ROMEO: a cat sat.\n" * 5)
    result = _cli("eval", str(char_ckpt), "--file", str(f), "--tgt-len", "8", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["tokens"] == 89 and out["tgt_len"] == 8 and out["metric"] == "bpc"
    res = score_file(char_ckpt, f, lengths=Checkpoint.open(char_ckpt).lengths(tgt_len=8))
    assert out["bpc"] == pytest.approx(res["bpc"])
    missing = _cli("eval", str(char_ckpt), "--file", str(tmp_path / "none.txt"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert missing.stderr.count("\n") == 1


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_eval_file_scores_in_the_precision_asked(char_ckpt, tmp_path, capsys, precision) -> None:
    """``txlm eval CKPT --file F --precision P`` reads the text in P (bf16 autocast; int8
    layers through the cache): the loss ``txlm.score`` gives in P, near float32's, not it."""
    f = tmp_path / "t.txt"
    f.write_text("ROMEO: a cat sat.\n" * 5)
    argv = ["eval", str(char_ckpt), "--file", str(f), "--tgt-len", "8", "--json", "--threads", "1"]
    losses = {}
    for p in ("fp32", precision):
        assert main([*argv, "--precision", p]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["precision"] == p
        losses[p] = out["loss"]
    model, vocab = txlm.load(char_ckpt), Vocab.load(char_ckpt / "vocab.json")
    lp = score(model, vocab.encode(f.read_text()), tgt_len=8, precision=precision,
               mem_len=Checkpoint.open(char_ckpt).lengths().mem_len)  # fmt: skip
    assert losses[precision] == pytest.approx(float(-lp.double().mean()), rel=1e-6)
    assert losses[precision] != losses["fp32"]
    assert losses[precision] == pytest.approx(losses["fp32"], rel=0.02)


def test_prompt_file_and_max_context(char_ckpt, tmp_path, capsys) -> None:
    f = tmp_path / "prompt.txt"
    f.write_text("ROMEO: a cat sat on a mat. " * 4)  # 108 characters
    base = ["generate", str(char_ckpt), "--max-new-tokens", "5", "--seed", "2", "--json"]
    assert main([*base, "--prompt-file", str(f), "--max-context", "20"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["prompt_tokens"] == [20] and "reading the last 20" in cap.err
    # the trimmed context is exactly what is read: same ids as passing its last 20 characters
    assert main([*base, "--prompt", f.read_text()[-20:]]) == 0
    assert json.loads(capsys.readouterr().out)["sample_ids"] == out["sample_ids"]


def test_several_prompts_in_one_batch(word_ckpt, capsys) -> None:
    """Rows of different lengths, each as if run alone (greedy: no sampling order effects)."""
    base = ["generate", str(word_ckpt), "--max-new-tokens", "7", "--greedy", "--json"]
    prompts = ["the cat sat on a mat and", "dog", ""]
    assert main([*base, *(f"--prompt={p}" for p in prompts), "--num-samples", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == [7, 1, 0] and len(out["sample_ids"]) == 6
    for i, p in enumerate(prompts):
        assert main([*base, f"--prompt={p}"]) == 0
        alone = json.loads(capsys.readouterr().out)["sample_ids"][0]
        assert out["sample_ids"][2 * i] == out["sample_ids"][2 * i + 1] == alone


def test_stop_id_ends_each_row_at_its_first_stop() -> None:
    """Rows stop independently at their first stop id (kept), the stream pads finished rows
    and ends when all have stopped, and the tokens before a stop are those of a run without
    one (stopping changes no draw)."""
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig.from_preset("debug", vocab_size=12)).eval()
    prompts = [[1, 2, 3], [4, 5], [6]]
    free = txlm.generate(model, prompts, max_new_tokens=40, seed=3, top_k=None)
    # a stop id that the rows draw at different steps (so they stop independently)
    counts = Counter(t for row in free for t in row)
    stop = next(t for t, _ in counts.most_common() if len({r.index(t) for r in free if t in r}) > 1)
    stopped = txlm.generate(model, prompts, max_new_tokens=40, seed=3, top_k=None, stop_id=stop)
    for row, full in zip(stopped, free, strict=True):
        if stop in full:
            k = full.index(stop)
            assert row == full[: k + 1]  # same draws, cut after the first stop
        else:
            assert row == full  # never stopped: the whole budget
    sampling = SamplingConfig(top_k=None)
    steps = list(stream(model, prompts, max_new_tokens=40, seed=3, stop_id=stop, sampling=sampling))
    stops = [full.index(stop) if stop in full else None for full in free]
    assert len(steps) == (40 if None in stops else max(stops) + 1)
    for r, k in enumerate(stops):
        if k is not None:
            assert all(int(s[r]) == stop for s in steps[k:])  # padding after the stop
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        txlm.generate(model, [1], max_new_tokens=2, stop_id=12)


def test_cli_stop_at_eos(word_ckpt, char_ckpt, capsys) -> None:
    vocab = Vocab.load(word_ckpt / "vocab.json")
    eos = vocab.eos_id
    assert eos is not None
    argv = ["generate", str(word_ckpt), "--prompt", "the cat", "--max-new-tokens", "60",
            "--seed", "2", "--num-samples", "4", "--json"]  # fmt: skip
    assert main(argv) == 0
    free = json.loads(capsys.readouterr().out)["sample_ids"]
    assert main([*argv, "--stop-at-eos"]) == 0
    stopped = json.loads(capsys.readouterr().out)["sample_ids"]
    assert any(eos in row for row in free)  # the check below is not vacuous
    for row, full in zip(stopped, free, strict=True):
        assert row == (full[: full.index(eos) + 1] if eos in full else full)
    # character vocabulary: a newline ends the sample
    assert main(["generate", str(char_ckpt), "--prompt", "ab", "--max-new-tokens", "80",
                 "--seed", "1", "--stop-at-eos", "--json"]) == 0  # fmt: skip
    text = json.loads(capsys.readouterr().out)["samples"][0]
    assert "\n" not in text[:-1]
    assert text.endswith("\n") or len(text) == 80


@pytest.mark.parametrize("prompt", ["the cat", ""])
def test_end_of_training_sample_reads_prompts_as_the_cli(word_ckpt, capsys, prompt) -> None:
    """txlm.training.sample_text (the sample printed when training ends) and `txlm generate`
    read a word-level prompt alike (no <eos> after an unfinished line; an empty prompt starts
    from <eos>): the same seed gives the same ids."""
    from txlm.inference.prompts import encode_prompt
    from txlm.training import sample_text

    model, vocab = txlm.load(word_ckpt), Vocab.load(word_ckpt / "vocab.json")
    text = sample_text(model, vocab, prompt, 12, seed=4)
    argv = ["generate", str(word_ckpt), "--prompt", prompt, "--max-new-tokens", "12"]
    assert main([*argv, "--seed", "4", "--json"]) == 0
    new = json.loads(capsys.readouterr().out)["sample_ids"][0]
    assert text == vocab.decode(encode_prompt(vocab, prompt)[0] + new)


def test_compile_flag_compiles_the_step_and_keeps_the_text(char_ckpt, capsys, monkeypatch):
    """``--compile`` (on) runs the decoding step through torch.compile (fullgraph, static
    shapes) and samples the same ids; ``auto`` (the default) and ``off`` do not compile
    here. The backend is swapped for "aot_eager": the same tracing (a graph break would
    fail), without inductor's minute of code generation on a CPU."""
    real_compile = torch.compile
    calls: list[dict] = []

    def fast_compile(fn, options=None, **kwargs):
        calls.append({**kwargs, "options": options})
        return real_compile(fn, **{**kwargs, "backend": "aot_eager", "mode": None})

    monkeypatch.setattr(torch, "compile", fast_compile)
    argv = ["generate", str(char_ckpt), "--prompt", "abc", "--seed", "3", "--json"]
    argv += ["--max-new-tokens", "40"]
    ids = {}
    for extra in ([], ["--compile"], ["--compile", "off"]):  # (auto: eager for 40 tokens)
        assert main([*argv, *extra]) == 0
        ids[" ".join(extra)] = json.loads(capsys.readouterr().out)["sample_ids"]
    assert ids["--compile"] == ids[""] == ids["--compile off"]
    cpp = {"cpp_wrapper": True, "freezing": False}  # the CPU's compiled step: one C++ function
    assert calls == [dict(fullgraph=True, dynamic=False, backend="inductor", options=cpp)]


def test_prompt_file_with_several_samples_prints_the_prompt_once(char_ckpt, tmp_path, capsys):
    """Several samples of a --prompt-file: the prompt once, then each sample's generated
    text under a header that marks where it starts; the samples are the --json run's."""
    prompt = "ROMEO:\nA long prompt that should not be repeated before every sample.\n"
    path = tmp_path / "prompt.txt"
    path.write_text(prompt, encoding="utf-8")
    base = ["generate", str(char_ckpt), "--prompt-file", str(path), "--max-new-tokens", "12",
            "--seed", "4", "--num-samples", "3"]  # fmt: skip
    assert main(base) == 0
    out = capsys.readouterr().out
    assert out.count(prompt) == 1 and out.startswith("=== prompt ===\n" + prompt)
    assert main([*base, "--json"]) == 0
    samples = json.loads(capsys.readouterr().out)["samples"]
    for j, text in enumerate(samples, 1):
        assert f"=== sample {j} (seed {3 + j}): generated ===\n{text}\n" in out


def test_each_sample_prints_its_seed_and_is_drawn_again_alone(word_ckpt, capsys) -> None:
    base = ["generate", str(word_ckpt), "--max-new-tokens", "8", "--top-k", "5"]
    prompts = ["--prompt", "the cat", "--prompt", "a dog"]
    assert main([*base, *prompts, "--seed", "7", "--num-samples", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["seeds"] == [7, 8, 9, 10, 11, 12]
    assert len(set(map(tuple, result["sample_ids"]))) > 1
    texts = ["the cat"] * 3 + ["a dog"] * 3
    for row, (prompt, seed) in enumerate(zip(texts, result["seeds"], strict=True)):
        assert main([*base, "--prompt", prompt, "--seed", str(seed), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["sample_ids"] == [result["sample_ids"][row]]
    assert main([*base, *prompts[:2], "--seed", "7", "--num-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "=== sample 1 (seed 7): generated ===" in out
    assert "=== sample 2 (seed 8): generated ===" in out


def test_temperature_zero_is_greedy(char_ckpt, capsys) -> None:
    base = ["generate", str(char_ckpt), "--prompt", "ab", "--max-new-tokens", "10", "--json"]
    assert main([*base, "--greedy"]) == 0
    greedy = json.loads(capsys.readouterr().out)["sample_ids"]
    assert main([*base, "--temperature", "0", "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["sample_ids"] == greedy


def test_controls_from_the_command_line_are_the_librarys(char_ckpt, capsys) -> None:
    """--stop, --ban, --min-p, --repetition-penalty and the default <unk> ban give what
    txlm.generate gives with the same settings; the live text ends before the stop string."""
    model, vocab = txlm.load(char_ckpt), Vocab.load(char_ckpt / "vocab.json")
    argv = ["generate", str(char_ckpt), "--prompt", "ROMEO:", "--max-new-tokens", "40",
            "--seed", "2", "--top-k", "20"]  # fmt: skip
    flags = ["--ban", "e", "--min-p", "0.05", "--repetition-penalty", "1.3"]
    assert main([*argv, *flags, "--json"]) == 0
    free = json.loads(capsys.readouterr().out)["samples"][0]
    stop = free[10:12]
    flags += ["--stop", stop]
    assert main([*argv, *flags, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    [want] = txlm.generate(
        model, vocab.encode("ROMEO:"), max_new_tokens=40, seed=2, top_k=20, min_p=0.05,
        repetition_penalty=1.3, ban=["e", "<unk>"], stop=[stop], vocab=vocab,
    )  # fmt: skip
    assert result["sample_ids"] == [want]
    text = result["samples"][0]
    assert text == free[: free.index(stop)] and len(text) <= 10
    assert "e" not in free and "<unk>" not in free
    assert main([*argv, *flags]) == 0  # live: the prompt, the text, a newline
    assert capsys.readouterr().out == "ROMEO:" + text + "\n"
