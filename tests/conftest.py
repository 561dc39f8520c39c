"""Shared test fixtures and the one environment every ``python -m txlm`` subprocess gets.

Helpers that are not fixtures live in ``tests/helpers`` (``from tests.helpers.env import
subprocess_env``); the test folders mirror the package's layers.
"""

from __future__ import annotations

import os
import random
import signal

# Triton decides when it decorates a kernel whether to compile it or interpret it; on this
# CPU only the interpreter runs txlm.model.triton_attention (model/test_triton_attention.py).
# Set before any test module imports triton; nothing else here runs Triton kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

# The suite's intra-op thread count (torch's default: one per core). `make test-portable`
# runs it at 1 and 3: which CPU kernel a product takes, and so the order of its sums, depends
# on the thread count, and a test that holds only at one count compares the wrong way.
# Under pytest-xdist (`make test`: one worker per core) each worker takes 1, and so do the
# processes its tests start (OMP_NUM_THREADS): two workers of two threads on two cores wait
# on each other's spinning threads, many times slower than either alone.
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("TXLM_TEST_THREADS"):
    os.environ["TXLM_TEST_THREADS"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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


@pytest.fixture
def fresh_dynamo():
    """A test's compiled steps traced anew and dropped after it (dynamo keeps a bounded
    number of graphs per function across tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def runner():
    """The warm fork server (helpers/reliability_cli_runner.py): ``python -m txlm`` children without
    an interpreter and torch start-up each (the one ``_train_helpers.txlm`` uses too)."""
    from tests.helpers.reliability import warm_runner

    return warm_runner()
