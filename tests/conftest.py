"""Shared test fixtures and the one environment every ``python -m txlm`` subprocess gets.

Helpers that are not fixtures are imported by name (``from conftest import subprocess_env``):
pytest puts this folder on ``sys.path``, and a module is imported once.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

# Triton decides when it decorates a kernel whether to compile it or interpret it; on this
# CPU only the interpreter runs txlm.model.triton_attention (test_model_triton_attention.py).
# Set before any test module imports triton; nothing else here runs Triton kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def spread_weights(model, std: float):
    """Every weight but the LayerNorms' drawn from N(0, std) (from the global generator), in
    place; the model back. Far from a fresh model's near-uniform outputs, so decoding tests
    reach every token class and sampling differences show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    return model


@pytest.fixture
def fresh_dynamo():
    """A test's compiled steps traced anew and dropped after it (dynamo keeps a bounded
    number of graphs per function across tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def subprocess_env(data_dir: str | Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a ``python -m txlm`` child: this checkout's ``src`` first on the
    path, one thread, fixed hashing, never the real Hub, the data directory given (else the
    default, as a user has it) and no fault seam unless asked for (``TXLM_FAULT=...``)."""
    env = dict(os.environ)
    for key in ("TXLM_DATA_DIR", "TXLM_FAULT", "TXLM_FAULT_DIR"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONHASHSEED"] = "0"
    env["HF_HUB_OFFLINE"] = "1"  # `convert --from hf NAME` must never reach the real Hub
    if data_dir is not None:
        env["TXLM_DATA_DIR"] = str(data_dir)
    env.update(extra)
    return env


# A Hugging Face TransfoXL small enough to build in milliseconds, with everything the
# converter maps: an adaptive softmax with two tail clusters (div_val 2), untied r biases.
TINY_HF = dict(
    vocab_size=40,
    cutoffs=[10, 25],
    d_model=16,
    d_embed=16,
    n_head=2,
    d_head=8,
    d_inner=24,
    div_val=2,
    n_layer=2,
    mem_len=6,
    untie_r=True,
)


def save_tiny_hf(directory: Path, *, safe: bool = True, **overrides):
    """``TINY_HF`` (plus ``overrides``) with seed-0 weights, saved with ``save_pretrained``:
    model.safetensors, or the pickled pytorch_model.bin of older Hub repositories."""
    import torch
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notice for TransfoXL
        model = TransfoXLLMHeadModel(TransfoXLConfig(**{**TINY_HF, **overrides}))
    model.save_pretrained(directory, safe_serialization=safe)
    return model


@pytest.fixture(scope="session")
def runner():
    """The warm fork server (reliability_cli_runner.py): ``python -m txlm`` children without
    an interpreter and torch start-up each."""
    from reliability_helpers import Runner

    r = Runner()
    yield r
    r.close()
