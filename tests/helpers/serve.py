"""A real ``txlm serve`` for tests: uvicorn on 127.0.0.1, in a thread, on a socket bound
before it starts (the kernel queues the first connections, so nothing waits on a clock), the
model loaded before the first request, and always stopped."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

CHARS = "abcdefghijklmnopqrstuvwxyz ,.:\nROMEO"
TIMEOUT = 60.0  # every client call and every join is bounded by it


def char_lm(directory: Path, seed: int = 0, **model) -> Path:
    """The debug model (weights spread so they look trained) with a char vocabulary."""
    import txlm
    from tests.helpers.models import spread_weights
    from txlm.config import ModelConfig
    from txlm.data.vocab import Vocab
    from txlm.model import TransformerXL

    vocab = Vocab.build_char(Counter(CHARS))
    torch.manual_seed(seed)
    config = ModelConfig.from_preset("debug", vocab_size=len(vocab), **model)
    m = spread_weights(TransformerXL(config), 0.1)
    return txlm.save(m, directory, vocab_json=vocab.to_json())


@dataclass
class Running:
    url: str
    service: object
    server: object

    @property
    def engine(self):
        return self.service.engine


@contextlib.contextmanager
def serving(checkpoint: Path, config=None, **options) -> Iterator[Running]:
    import uvicorn

    from txlm.serve.application import create_app
    from txlm.serve.service import Service

    service = Service(checkpoint, config, device="cpu", **options)
    service.load()  # before the server: the first request finds the model
    app = create_app(service)
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield Running(f"http://127.0.0.1:{port}", service, server)
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        service.stop()
        sock.close()
