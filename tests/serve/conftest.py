"""Fixtures of the serving tests: a tiny checkpoint, its model and vocabulary in-process (the
offline reference), and a real server on 127.0.0.1 serving it."""

from __future__ import annotations

import pytest

from tests.helpers.serve import TIMEOUT, char_lm, serving
from txlm.checkpoints.checkpoint import Checkpoint
from txlm.serve.config import ServeConfig

pytest.importorskip("fastapi", reason="txlm serve needs the serve extra (fastapi, uvicorn)")


@pytest.fixture(scope="package")
def lm_path(tmp_path_factory):
    return char_lm(tmp_path_factory.mktemp("serve") / "lm")


@pytest.fixture(scope="package")
def offline(lm_path):
    """(model, vocab, lengths) as ``txlm generate`` and ``txlm eval`` open the checkpoint."""
    ckpt = Checkpoint.open(lm_path)
    return ckpt.load_model("cpu"), ckpt.vocab(), ckpt.lengths()


@pytest.fixture(scope="package")
def server(lm_path):
    config = ServeConfig(max_batch=16, max_sessions=4)
    with serving(lm_path, config) as running:
        yield running


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT,
                       max_retries=0) as c:  # fmt: skip
        yield c


@pytest.fixture
def http(server):
    httpx = pytest.importorskip("httpx")
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c
