"""Bad input to `txlm eval` (and `--file`): damaged or foreign checkpoints, corpora that do
not match, bad lengths, memories that cannot fit, text sources that never end.

Contract C24 (ARCHITECTURE.md): one ``txlm: error:`` line, exit 2, nothing on disk changed.
The runner and the assets are shared by every command's table: ``helpers/cli_table.py``.
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.cli_table import (
    EVIL,
    EVIL_ZIP,
    Case,
    check_pickle_never_runs,
    edit_json,
    run_case,
    truncate,
    write,
)

CASES: list[Case] = [
    Case("eval-missing-checkpoint", ["eval", "run/best"], "run/best"),
    Case(
        "eval-zero-byte-weights",
        ["eval", "run/best"],
        "model.safetensors",
        write("run/best/model.safetensors", b""),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-truncated-weights",
        ["eval", "run/best"],
        "model.safetensors",
        truncate("run/best/model.safetensors", 0.9),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-pickle-as-checkpoint",
        ["eval", "run/best"],
        "model.safetensors",
        write("run/best/model.safetensors", EVIL_ZIP),
        uses=("corpus.txt", "data", "run"),
        pickle=True,
    ),
    Case(
        "eval-foreign-checkpoint",
        ["eval", "hf"],
        "not a txlm checkpoint",
        uses=("hf",),
    ),
    Case(
        "eval-config-wrong-type",
        ["eval", "run/best"],
        "d_model",
        edit_json("run/best/config.json", lambda d: d["model"].__setitem__("d_model", 32.5)),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-config-unknown-key",
        ["eval", "run/best"],
        "rope",
        edit_json("run/best/config.json", lambda d: d["model"].__setitem__("rope", True)),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-vocab-mismatch",
        ["eval", "run/best", "--dataset", "text:other.txt"],
        "vocabulary",
        uses=("corpus.txt", "other.txt", "data", "run"),
    ),
    Case(
        "eval-missing-split",
        ["eval", "run/best", "--split", "test"],
        "test",
        edit_json("data/text-corpus/meta.json", lambda d: d["splits"].pop("test")),
        uses=("corpus.txt", "data", "run"),
    ),
    Case("eval-unknown-split", ["eval", "run/best", "--split", "dev"], "--split"),
    Case(
        "eval-run-folder",
        ["eval", "run"],
        "(a run folder: did you mean run/best?)",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-zero-tgt-len",
        ["eval", "run/best", "--tgt-len", "0"],
        "tgt-len",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-file-zero-threads",
        ["eval", "run/best", "--file", "corpus.txt", "--threads", "0"],
        "--threads",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-negative-mem-len",
        ["eval", "run/best", "--mem-len", "-1"],
        "mem-len",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-zero-batch",
        ["eval", "run/best", "--batch-size", "0"],
        "batch-size",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-pickle-as-corpus-meta",
        ["eval", "run/best"],
        "meta.json",
        write("data/text-corpus/meta.json", EVIL),
        uses=("corpus.txt", "data", "run"),
        pickle=True,
    ),
    Case(
        "eval-pickle-as-corpus-tokens",
        ["eval", "run/best"],
        "test.bin",
        lambda w: (w / "data/text-corpus/test.bin").write_bytes(
            (EVIL * 100)[: (w / "data/text-corpus/test.bin").stat().st_size]
        ),
        uses=("corpus.txt", "data", "run"),
        pickle=True,
    ),
    Case(
        "eval-pickle-as-corpus-vocab",
        ["eval", "run/best"],
        "vocab.json",
        write("data/text-corpus/vocab.json", EVIL),
        uses=("corpus.txt", "data", "run"),
        pickle=True,
    ),
    Case(
        "eval-file-bpe-foreign-tokenizer",
        ["eval", "bpe-ckpt", "--file", "corpus.txt"],
        "does not match the checkpoint",
        lambda w: [
            shutil.copy2(w / "other-bpe" / n, w / "bpe-ckpt" / n)
            for n in ("vocab.json", "tokenizer.json")
        ],
        uses=("bpe-ckpt", "other-bpe", "corpus.txt"),
    ),
    # ---- memories that cannot fit, text sources that never end
    Case(
        "eval-mem-len-cannot-fit",
        ["eval", "run/best", "--mem-len", "10000000000"],
        "--mem-len",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-kv-cache-cannot-fit",
        ["eval", "run/best", "--mem-len", "10000000000", "--kv-cache"],
        "--mem-len",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-checkpoint-asks-huge-memory",
        ["eval", "run/best"],
        "--mem-len",
        edit_json(
            "run/best/config.json", lambda d: d["train"]["eval"].__setitem__("eval_mem_len", 10**10)
        ),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "eval-file-mem-len-cannot-fit",
        ["eval", "run/best", "--file", "corpus.txt", "--mem-len", "10000000000"],
        "--mem-len",
        uses=("corpus.txt", "run"),
    ),
    Case(
        "eval-file-endless",
        ["eval", "run/best", "--file", "/dev/zero"],
        "regular file",
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
