"""Shared test fixtures and the one environment every ``python -m txlm`` subprocess gets.

Helpers that are not fixtures are imported by name (``from conftest import subprocess_env``):
pytest puts this folder on ``sys.path``, and a module is imported once.
"""

from __future__ import annotations

import os
import random
import signal
import warnings
from pathlib import Path

# Triton decides when it decorates a kernel whether to compile it or interpret it; on this
# CPU only the interpreter runs txlm.model.triton_attention (test_model_triton_attention.py).
# Set before any test module imports triton; nothing else here runs Triton kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# The suite's intra-op thread count (torch's default: one per core). `make test-portable`
# runs it at 1 and 3: which CPU kernel a product takes, and so the order of its sums, depends
# on the thread count, and a test that holds only at one count compares the wrong way.
if os.environ.get("TXLM_TEST_THREADS"):
    torch.set_num_threads(int(os.environ["TXLM_TEST_THREADS"]))


def _flush_denormal() -> bool:
    """torch has no getter for ``set_flush_denormal``: a denormal float32 reads as zero with
    it on."""
    return bool((torch.tensor(1e-40) * 1).item() == 0)


def _global_state() -> dict[str, object]:
    """What torch (and txlm's trainer) keep process-wide: a test or a library call that
    changes one of these changes every later test's arithmetic or behaviour."""
    return {
        "intra-op threads": torch.get_num_threads(),
        "flush-denormal": _flush_denormal(),
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "cudnn benchmark": torch.backends.cudnn.benchmark,
        "cpu autocast": torch.is_autocast_enabled("cpu"),
        "anomaly mode": torch.is_anomaly_enabled(),
        "SIGINT/SIGTERM handlers": (
            signal.getsignal(signal.SIGINT),
            signal.getsignal(signal.SIGTERM),
        ),
        "TXLM_* environment": {k: v for k, v in os.environ.items() if k.startswith("TXLM_")},
        "working directory": os.getcwd(),
    }


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same global generators (torch's, numpy's, Python's),
    whatever ran before it: what a test draws from them does not depend on the order."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


@pytest.fixture(autouse=True)
def global_state_restored():
    """Fails the test that leaves torch's process-wide state (or txlm's environment
    variables, the signal handlers, the working directory) other than it found it."""
    before = _global_state()
    yield
    after = _global_state()
    changed = [f"{k}: {before[k]!r} -> {after[k]!r}" for k in before if before[k] != after[k]]
    assert not changed, "the test left global state changed: " + "; ".join(changed)


def spread_weights(model, std: float):
    """Every weight but the LayerNorms' drawn from N(0, std) (from the global generator), in
    place; the model back. Far from a fresh model's near-uniform outputs, so decoding tests
    reach every token class and sampling differences show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    return model


def debug_model(seed: int = 0, *, dtype=None, std: float | None = None, **overrides):
    """The debug preset with ``overrides``, from seed ``seed``, in eval mode; ``dtype``: the
    model converted to it once built (under the default dtype). ``std``: every weight but the
    LayerNorms' drawn from N(0, std) (``spread_weights``); else as initialised, but with the
    zero-initialised ones (u, v, biases) drawn from N(0, 0.3), so every score term matters."""
    from txlm.config import ModelConfig
    from txlm.model import TransformerXL

    torch.manual_seed(seed)
    model = TransformerXL(ModelConfig.from_preset("debug", **overrides))
    if dtype is not None:
        model = model.to(dtype)
    model.eval()
    if std is not None:
        return spread_weights(model, std)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() <= 2 and p.abs().sum() == 0:
                p.normal_(0, 0.3)
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
    an interpreter and torch start-up each (the one ``_train_helpers.txlm`` uses too)."""
    from reliability_helpers import warm_runner

    return warm_runner()
