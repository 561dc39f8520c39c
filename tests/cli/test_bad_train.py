"""Bad input to `txlm train`: configurations that cannot be used, corpora that cannot be
trained on, resumes from damaged or foreign checkpoints, sizes that cannot fit in memory, and
an --out that holds another run.

Contract C24 (ARCHITECTURE.md): one ``txlm: error:`` line, exit 2, nothing on disk changed.
The runner and the assets are shared by every command's table: ``helpers/cli_table.py``.
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.cli_table import (
    EVIL,
    EVIL_ZIP,
    MARKER,
    TRAIN_BASE,
    Case,
    both,
    check_pickle_never_runs,
    edit_json,
    mkdir,
    run_case,
    truncate,
    write,
)

CASES: list[Case] = [
    Case("train-unknown-preset", ["train", "--preset", "gpt-5"], "gpt-5"),
    Case(
        "train-zero-layers", ["train", "--preset", "debug", "--set", "model.n_layer=0"], "n_layer"
    ),
    Case(
        "train-unknown-key", ["train", "--preset", "debug", "--set", "model.n_layerz=2"], "n_layerz"
    ),
    Case("train-wrong-type", ["train", "--preset", "debug", "--set", "optim.lr=fast"], "optim.lr"),
    Case(
        "train-negative-batch",
        ["train", "--preset", "debug", "--set", "data.batch_size=-4"],
        "batch_size",
    ),
    Case(
        "train-zero-tgt-len", ["train", "--preset", "debug", "--set", "data.tgt_len=0"], "tgt_len"
    ),
    Case(
        "train-negative-mem-len",
        ["train", "--preset", "debug", "--set", "model.mem_len=-1"],
        "mem_len",
    ),
    Case(
        "train-set-without-equals", ["train", "--preset", "debug", "--set", "optim.lr"], "optim.lr"
    ),
    Case(
        "train-yaml-wrong-type",
        ["train", "--preset", "debug", "--config", "c.yaml"],
        "max_steps",
        write("c.yaml", "optim:\n  max_steps: ten\n"),
    ),
    Case(
        "train-yaml-unknown-section",
        ["train", "--preset", "debug", "--config", "c.yaml"],
        "optimiser",
        write("c.yaml", "optimiser:\n  lr: 0.1\n"),
    ),
    Case(
        "train-yaml-binary",
        ["train", "--preset", "debug", "--config", "c.yaml"],
        "c.yaml",
        write("c.yaml", EVIL),
        pickle=True,
    ),
    Case(
        "train-yaml-missing", ["train", "--preset", "debug", "--config", "nope.yaml"], "nope.yaml"
    ),
    Case(
        "train-yaml-python-tag",
        ["train", "--preset", "debug", "--config", "c.yaml"],
        "c.yaml",
        write("c.yaml", f"optim: !!python/object/apply:os.system ['touch {MARKER}']\n"),
        pickle=True,
    ),
    Case(
        "train-missing-corpus",
        [*TRAIN_BASE, "data.dataset=text:nope.txt", "--out", "run"],
        "nope.txt",
    ),
    Case(
        "train-empty-corpus",
        [*TRAIN_BASE, "data.dataset=text:empty.txt", "--out", "run"],
        "empty",
        both(mkdir("data"), write("empty.txt", "")),
    ),
    Case(
        "train-corpus-too-small-for-batch",
        [*TRAIN_BASE, "data.batch_size=2048", "--out", "run"],
        "too few",
        uses=("corpus.txt", "data"),
    ),
    Case(
        "train-out-under-file",
        [*TRAIN_BASE, "--out", "blocker/run"],
        "blocker",
        write("blocker", "x"),
        uses=("corpus.txt", "data"),
    ),
    Case("train-resume-missing", ["train", "--resume", "run/last"], "run/last"),
    Case(
        "train-resume-from-best",
        ["train", "--resume", "run/best"],
        "last",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-resume-truncated-weights",
        ["train", "--resume", "run/last"],
        "model.safetensors",
        truncate("run/last/model.safetensors", 0.5),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-resume-zero-byte-optimizer",
        ["train", "--resume", "run/last"],
        "optimizer",
        write("run/last/optimizer.safetensors", b""),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-resume-pickled-optimizer",
        ["train", "--resume", "run/last"],
        "optimizer",
        write("run/last/optimizer.safetensors", EVIL_ZIP),
        uses=("corpus.txt", "data", "run"),
        pickle=True,
    ),
    Case(
        "train-resume-truncated-state",
        ["train", "--resume", "run/last"],
        "trainer_state.json",
        truncate("run/last/trainer_state.json", 0.5),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-resume-pickled-memory",
        ["train", "--resume", "run/last"],
        "memory",
        write("run/last/memory.safetensors", EVIL),
        uses=("corpus.txt", "data", "run"),
        pickle=True,
    ),
    Case(
        "train-resume-with-preset",
        ["train", "--resume", "run/last", "--preset", "debug"],
        "--preset",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-resume-config-wrong-type",
        ["train", "--resume", "run/last"],
        "lr",
        edit_json("run/last/config.json", lambda d: d["train"]["optim"].__setitem__("lr", "x")),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-yaml-endless",
        ["train", "--preset", "debug", "--config", "/dev/zero"],
        "/dev/zero",
    ),
    # ---- sizes that cannot fit in memory (a lower bound from the config: txlm.resources)
    Case(
        "train-model-cannot-fit",
        [*TRAIN_BASE, "model.d_model=100000", "model.d_inner=1000000", "--out", "run"],
        "model.d_model",
        uses=("corpus.txt", "data"),
    ),
    Case(
        "train-memory-cannot-fit",
        [*TRAIN_BASE, "model.mem_len=1000000000000", "optim.max_steps=2", "--out", "run"],
        "model.mem_len",
        uses=("corpus.txt", "data"),
    ),
    # ---- --init: a new run from a checkpoint's model (contract C38)
    Case(
        "train-init-not-a-checkpoint",
        [*TRAIN_BASE, "--init", "notckpt", "--out", "ft"],
        "notckpt",
        mkdir("notckpt"),
        uses=("corpus.txt", "data"),
    ),
    Case(
        "train-init-missing",
        [*TRAIN_BASE, "--init", "nope/best", "--out", "ft"],
        "nope/best",
        uses=("corpus.txt", "data"),
    ),
    Case(
        "train-init-truncated-weights",
        [*TRAIN_BASE, "--init", "run/best", "--out", "ft"],
        "model.safetensors",
        truncate("run/best/model.safetensors", 0.5),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-init-damaged-config",
        [*TRAIN_BASE, "--init", "run/best", "--out", "ft"],
        "config.json",
        write("run/best/config.json", "{"),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-init-without-vocab",
        [*TRAIN_BASE, "--init", "run/best", "--out", "ft"],
        "vocab.json",
        lambda w: (w / "run" / "best" / "vocab.json").unlink(),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-init-with-resume",
        ["train", "--init", "run/best", "--resume", "run/last"],
        "--resume",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-init-model-shape",
        [*TRAIN_BASE, "model.n_layer=3", "--init", "run/best", "--out", "ft"],
        "model.n_layer",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-init-other-level",
        [*TRAIN_BASE, "data.level=word", "--init", "run/best", "--out", "ft"],
        "data.level",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-init-cannot-fit",
        [*TRAIN_BASE, "--init", "run/best", "--out", "ft"],
        "start from a smaller one",
        edit_json("run/best/config.json", lambda d: d["model"].__setitem__("d_inner", 10**12)),
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-init-all-unknown",
        [*TRAIN_BASE, "data.dataset=text:alien.txt", "--init", "run/best", "--out", "ft"],
        "<unk>",
        write("alien.txt", "ζξψω ωψξζ ψω\n" * 200),
        uses=("corpus.txt", "data", "run"),
    ),
    # ---- an --out that holds another run is not replaced silently
    Case(
        "train-into-used-out",
        [*TRAIN_BASE, "optim.max_steps=2", "--out", "run"],
        "--overwrite",
        uses=("corpus.txt", "data", "run"),
    ),
    Case(
        "train-resume-into-another-run",
        ["train", "--resume", "run/last", "--out", "other"],
        "--overwrite",
        lambda w: shutil.copytree(w / "run", w / "other"),
        uses=("corpus.txt", "data", "run"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, assets, runner, tmp_path) -> None:
    run_case(case, assets, runner, tmp_path)


PICKLE_CASES = [c for c in CASES if c.pickle]


@pytest.mark.parametrize("case", PICKLE_CASES, ids=[c.id for c in PICKLE_CASES])
def test_crafted_pickle_never_runs(case: Case, assets, runner, tmp_path) -> None:
    check_pickle_never_runs(case, assets, runner, tmp_path)
