"""Bad input to `txlm serve`: checkpoints that are missing or damaged, flags out of range.

Contract C24 (ARCHITECTURE.md): one ``txlm: error:`` line, exit 2, nothing on disk changed.
The runner and the assets are shared by every command's table: ``helpers/cli_table.py``.
"""

from __future__ import annotations

import pytest

from tests.helpers.classify import save_classifier, tiny_lm
from tests.helpers.cli_table import Case, run_case, truncate, txlm_model, write

pytest.importorskip("uvicorn", reason="txlm serve needs the serve extra (fastapi, uvicorn)")

SERVE = ["serve", "ckpt", "--port", "0", "--device", "cpu"]

CASES: list[Case] = [
    Case("serve-missing-checkpoint", ["serve", "nowhere", "--port", "0"], "nowhere"),
    Case("serve-config-wrong-type", SERVE, "n_layer", txlm_model("n_layer", "2"), ("ckpt",)),
    # found as the model loads, after the server listened: it stops, one line, exit 2
    Case(
        "serve-zero-byte-weights",
        SERVE,
        "model.safetensors",
        write("ckpt/model.safetensors", b""),
        ("ckpt",),
    ),
    Case(
        "serve-truncated-weights",
        SERVE,
        "model.safetensors",
        truncate("ckpt/model.safetensors", 0.3),
        ("ckpt",),
    ),
    Case("serve-port-out-of-range", ["serve", "ckpt", "--port", "70000"], "--port", uses=("ckpt",)),
    Case("serve-max-batch-zero", [*SERVE, "--max-batch", "0"], "--max-batch", uses=("ckpt",)),
    Case("serve-queue-negative", [*SERVE, "--max-queue", "-1"], "--max-queue", uses=("ckpt",)),
    Case("serve-empty-api-key", [*SERVE, "--api-key", ""], "api key", uses=("ckpt",)),
    Case("serve-threads-zero", [*SERVE, "--threads", "0"], "--threads", uses=("ckpt",)),
    Case("serve-fp16-on-cpu", [*SERVE, "--precision", "fp16"], "fp16", uses=("ckpt",)),
    Case("serve-compile-unknown", [*SERVE, "--compile", "always"], "--compile", uses=("ckpt",)),
    Case(
        "serve-int8-classifier",
        ["serve", "clf", "--port", "0", "--precision", "int8"],
        "a classifier serves in fp32 or bf16",
        lambda work: save_classifier(work / "clf", tiny_lm(work / "lm")),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, assets, runner, tmp_path) -> None:
    run_case(case, assets, runner, tmp_path)
