"""Bad input to `txlm info`: checkpoints that are damaged, foreign or inconsistent.

Contract C24 (ARCHITECTURE.md): one ``txlm: error:`` line, exit 2, nothing on disk changed.
The runner and the assets are shared by every command's table: ``helpers/cli_table.py``.
"""

from __future__ import annotations

import pytest

from tests.helpers.cli_table import (
    EVIL_ZIP,
    Case,
    check_pickle_never_runs,
    run_case,
    truncate,
    txlm_model,
    write,
)

CASES: list[Case] = [
    Case(
        "info-zero-byte-weights",
        ["info", "ckpt"],
        "model.safetensors",
        write("ckpt/model.safetensors", b""),
        uses=("ckpt",),
    ),
    Case(
        "info-truncated-weights",
        ["info", "ckpt"],
        "model.safetensors",
        truncate("ckpt/model.safetensors", 0.3),
        uses=("ckpt",),
    ),
    Case(
        "info-pickle-as-checkpoint",
        ["info", "ckpt"],
        "model.safetensors",
        write("ckpt/model.safetensors", EVIL_ZIP),
        uses=("ckpt",),
        pickle=True,
    ),
    Case(
        "info-config-wrong-type",
        ["info", "ckpt"],
        "n_layer",
        txlm_model("n_layer", "2"),
        uses=("ckpt",),
    ),
    Case(
        "info-config-unknown-key",
        ["info", "ckpt"],
        "n_layers",
        txlm_model("n_layers", 2),
        uses=("ckpt",),
    ),
    Case(
        "info-foreign-checkpoint",
        ["info", "hf"],
        "not a txlm checkpoint",
        uses=("hf",),
    ),
    Case("info-missing-checkpoint", ["info", "nope"], "nope"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, assets, runner, tmp_path) -> None:
    run_case(case, assets, runner, tmp_path)


PICKLE_CASES = [c for c in CASES if c.pickle]


@pytest.mark.parametrize("case", PICKLE_CASES, ids=[c.id for c in PICKLE_CASES])
def test_crafted_pickle_never_runs(case: Case, assets, runner, tmp_path) -> None:
    check_pickle_never_runs(case, assets, runner, tmp_path)
