"""Bad input to `txlm generate`: damaged checkpoints and tokenizers, bad sampling options, caches
that cannot fit (memory length, number of samples, a checkpoint asking for a huge memory),
prompt files that are binary, missing or endless.

Contract C24 (ARCHITECTURE.md): one ``txlm: error:`` line, exit 2, nothing on disk changed.
The runner and the assets are shared by every command's table: ``helpers/cli_table.py``.
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.cli_table import (
    EVIL,
    Case,
    check_pickle_never_runs,
    edit_json,
    run_case,
    swap_ids,
    write,
)

CASES: list[Case] = [
    Case("generate-missing-checkpoint", ["generate", "nope", "--prompt", "a"], "nope"),
    Case(
        "generate-bpe-tokenizer-edited",
        ["generate", "bpe-ckpt", "--prompt", "a"],
        "does not match",
        edit_json("bpe-ckpt/tokenizer.json", lambda d: swap_ids(d["model"]["vocab"], "a", "b")),
        uses=("bpe-ckpt",),
    ),
    Case(
        "generate-bpe-tokenizer-missing",
        ["generate", "bpe-ckpt", "--prompt", "a"],
        "tokenizer.json",
        lambda w: (w / "bpe-ckpt/tokenizer.json").unlink(),
        uses=("bpe-ckpt",),
    ),
    Case(
        "generate-bpe-tokenizer-not-json",
        ["generate", "bpe-ckpt", "--prompt", "a"],
        "tokenizer.json",
        write("bpe-ckpt/tokenizer.json", b"\x80\x04K."),
        uses=("bpe-ckpt",),
    ),
    Case(
        "generate-negative-tokens",
        ["generate", "run/best", "--prompt", "The", "--max-new-tokens", "-1"],
        "max-new-tokens",
        uses=("run",),
    ),
    Case(
        "generate-top-p-above-one",
        ["generate", "run/best", "--prompt", "The", "--top-p", "1.5"],
        "top-p",
        uses=("run",),
    ),
    Case(
        "generate-zero-top-k",
        ["generate", "run/best", "--prompt", "The", "--top-k", "0"],
        "top-k",
        uses=("run",),
    ),
    Case(
        "generate-negative-temperature",
        ["generate", "run/best", "--prompt", "The", "--temperature", "-1"],
        "temperature",
        uses=("run",),
    ),
    Case(
        "generate-min-p-above-one",
        ["generate", "run/best", "--prompt", "The", "--min-p", "2"],
        "min-p",
        uses=("run",),
    ),
    Case(
        "generate-negative-repetition-penalty",
        ["generate", "run/best", "--prompt", "The", "--repetition-penalty", "-1"],
        "repetition penalty",
        uses=("run",),
    ),
    Case(
        "generate-ban-unknown-symbol",
        ["generate", "run/best", "--prompt", "The", "--ban", "no-such-symbol"],
        "cannot ban",
        uses=("run",),
    ),
    Case(
        "generate-empty-stop-string",
        ["generate", "run/best", "--prompt", "The", "--stop", ""],
        "stop strings",
        uses=("run",),
    ),
    Case(
        "generate-zero-samples",
        ["generate", "run/best", "--prompt", "The", "--num-samples", "0"],
        "num-samples",
        uses=("run",),
    ),
    Case(
        "generate-no-vocab",
        ["generate", "run/best", "--prompt", "The"],
        "vocab",
        lambda w: (w / "run/best/vocab.json").unlink(),
        uses=("run",),
    ),
    Case(
        "generate-vocab-not-json",
        ["generate", "run/best", "--prompt", "The"],
        "vocab",
        write("run/best/vocab.json", EVIL),
        uses=("run",),
        pickle=True,
    ),
    Case(
        "generate-pickle-as-checkpoint",
        ["generate", "run/best", "--prompt", "The"],
        "model.safetensors",
        write("run/best/model.safetensors", EVIL),
        uses=("run",),
        pickle=True,
    ),
    Case(
        "generate-vocab-size-mismatch",
        ["generate", "run/best", "--prompt", "The"],
        "vocab",
        lambda w: shutil.copy2(w / "data/text-other/vocab.json", w / "run/best/vocab.json"),
        uses=("run", "data"),
    ),
    Case(
        "generate-prompt-file-binary",
        ["generate", "run/best", "--prompt-file", "p.txt"],
        "p.txt",
        write("p.txt", b"\xff\xfe\x00\x80" * 10),
        uses=("run",),
    ),
    Case(
        "generate-prompt-file-missing",
        ["generate", "run/best", "--prompt-file", "p.txt"],
        "p.txt",
        uses=("run",),
    ),
    Case(
        "generate-negative-mem-len",
        ["generate", "run/best", "--prompt", "The", "--mem-len", "-5"],
        "mem_len",
        uses=("run",),
    ),
    # ---- caches that cannot fit, prompts that never end
    Case(
        "generate-mem-len-cannot-fit",
        ["generate", "run/best", "--prompt", "The", "--mem-len", "1000000000000"],
        "--mem-len",
        uses=("run",),
    ),
    Case(
        "generate-samples-cannot-fit",
        ["generate", "run/best", "--prompt", "The", "--num-samples", "1000000000000"],
        "--num-samples",
        uses=("run",),
    ),
    Case(
        "generate-checkpoint-asks-huge-memory",
        ["generate", "run/best", "--prompt", "The"],
        "--mem-len",
        # the memory generate reads with: the run's evaluation memory (Checkpoint.lengths)
        edit_json(
            "run/best/config.json",
            lambda d: d["train"]["eval"].__setitem__("eval_mem_len", 10**12),
        ),
        uses=("run",),
    ),
    Case(
        "generate-no-cache-memory-cannot-fit",
        ["generate", "run/best", "--prompt", "The", "--no-cache", "--mem-len", "1000000000000"],
        "--mem-len",
        uses=("run",),
    ),
    Case(
        "generate-prompt-file-endless",
        ["generate", "run/best", "--prompt-file", "/dev/zero"],
        "/dev/zero",
        uses=("run",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, assets, runner, tmp_path) -> None:
    run_case(case, assets, runner, tmp_path)


PICKLE_CASES = [c for c in CASES if c.pickle]


@pytest.mark.parametrize("case", PICKLE_CASES, ids=[c.id for c in PICKLE_CASES])
def test_crafted_pickle_never_runs(case: Case, assets, runner, tmp_path) -> None:
    check_pickle_never_runs(case, assets, runner, tmp_path)
