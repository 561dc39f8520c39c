"""Bad input to `txlm convert`: Hugging Face directories that are missing, foreign,
inconsistent or hostile (pickles that would run code), and configs that claim more than the
weights hold.

Contract C24 (ARCHITECTURE.md): one ``txlm: error:`` line, exit 2, nothing on disk changed.
The runner and the assets are shared by every command's table: ``helpers/cli_table.py``.
"""

from __future__ import annotations

import pytest

from tests.helpers.cli_table import (
    EVIL,
    EVIL_SYSTEM,
    EVIL_ZIP,
    Case,
    both,
    check_pickle_never_runs,
    dos_vocab,
    hf_model,
    mkdir,
    run_case,
    truncate,
    write,
)

CASES: list[Case] = [
    Case("convert-missing-src", ["convert", "--from", "hf", "nope", "--out", "o"], "nope"),
    Case(
        "convert-hub-name-offline-not-cached",
        ["convert", "--from", "hf", "org/transfo-xl-absent", "--out", "o"],
        "HF_HUB_OFFLINE",
    ),
    Case(
        "convert-missing-path",
        ["convert", "--from", "hf", "./models/nope", "--out", "o"],
        "models/nope",
    ),
    Case(
        "convert-src-is-file",
        ["convert", "--from", "hf", "f.txt", "--out", "o"],
        "not a directory",
        write("f.txt", "x"),
    ),
    Case(
        "convert-no-config",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "config.json",
        lambda w: (w / "hf/config.json").unlink(),
        uses=("hf",),
    ),
    Case(
        "convert-config-not-json",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "config.json",
        write("hf/config.json", b"\x00\xff{{"),
        uses=("hf",),
    ),
    Case(
        "convert-foreign-model-type",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "gpt2",
        hf_model("model_type", "gpt2"),
        uses=("hf",),
    ),
    Case(
        "convert-config-wrong-type",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "d_model",
        hf_model("d_model", "sixteen"),
        uses=("hf",),
    ),
    Case(
        "convert-config-negative-length",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "n_layer",
        hf_model("n_layer", -1),
        uses=("hf",),
    ),
    Case(
        "convert-config-claims-huge-model",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "vocab",
        hf_model("vocab_size", 2**36),  # 4 TiB of embeddings next to a 40-row weight file
        uses=("hf",),
    ),
    Case(
        "convert-weights-missing",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "pytorch_model.bin",
        lambda w: (w / "hf/pytorch_model.bin").unlink(),
        uses=("hf",),
    ),
    Case(
        "convert-weights-zero-bytes",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "pytorch_model.bin",
        write("hf/pytorch_model.bin", b""),
        uses=("hf",),
    ),
    Case(
        "convert-weights-truncated",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "pytorch_model.bin",
        truncate("hf/pytorch_model.bin", 0.5),
        uses=("hf",),
    ),
    Case(
        "convert-weights-other-shape",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "shape",
        hf_model("d_inner", 64),
        uses=("hf",),
    ),
    Case(
        "convert-evil-pickle-weights",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "pytorch_model.bin",
        write("hf/pytorch_model.bin", EVIL_ZIP),
        uses=("hf",),
        pickle=True,
    ),
    Case(
        "convert-evil-plain-pickle-weights",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "pytorch_model.bin",
        write("hf/pytorch_model.bin", EVIL),
        uses=("hf",),
        pickle=True,
    ),
    Case(
        "convert-evil-vocab-bin",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "vocab.bin",
        write("hf/vocab.bin", EVIL),
        uses=("hf",),
        pickle=True,
    ),
    Case(
        "convert-evil-vocab-bin-os-system",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "posix.system",
        write("hf/vocab.bin", EVIL_SYSTEM),
        uses=("hf",),
        pickle=True,
    ),
    Case(
        "convert-evil-vocab-pkl-zip",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "vocab.pkl",
        write("hf/vocab.pkl", EVIL_ZIP),
        uses=("hf",),
        pickle=True,
    ),
    Case(
        "convert-vocab-bin-memory-bomb",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "vocab.bin",
        write("hf/vocab.bin", dos_vocab()),
        uses=("hf",),
        pickle=True,
    ),
    Case(
        "convert-vocab-size-mismatch",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "vocab",
        write(
            "hf/vocab.bin",
            __import__("pickle").dumps(
                {"idx2sym": ["a", "b", "c"], "sym2idx": {"a": 0, "b": 1, "c": 2}}
            ),
        ),
        uses=("hf",),
    ),
    Case(
        "convert-out-exists",
        ["convert", "--from", "hf", "hf", "--out", "o"],
        "exists",
        both(mkdir("o"), write("o/keep.txt", "precious")),
        uses=("hf",),
    ),
    Case(
        "convert-out-under-file",
        ["convert", "--from", "hf", "hf", "--out", "blocker/o"],
        "blocker",
        write("blocker", "x"),
        uses=("hf",),
    ),
    Case("convert-unknown-source", ["convert", "--from", "tf", "hf", "--out", "o"], "--from"),
    Case("convert-no-out", ["convert", "--from", "hf", "hf"], "--out"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, assets, runner, tmp_path) -> None:
    run_case(case, assets, runner, tmp_path)


PICKLE_CASES = [c for c in CASES if c.pickle]


@pytest.mark.parametrize("case", PICKLE_CASES, ids=[c.id for c in PICKLE_CASES])
def test_crafted_pickle_never_runs(case: Case, assets, runner, tmp_path) -> None:
    check_pickle_never_runs(case, assets, runner, tmp_path)
