"""``txlm serve CKPT``: an OpenAI-compatible completions server (txlm.serve) on uvicorn.

Binds 127.0.0.1 unless ``--host`` says otherwise. SIGTERM or SIGINT: the server stops
accepting, every open stream gets a final event, and the command exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket

from txlm.commands.options import COMPILE, add_device_options, apply_threads, use_precision
from txlm.errors import CheckpointError, ConfigError, TxlmError
from txlm.serve.config import ServeConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a checkpoint over HTTP (OpenAI-compatible completions, sessions)",
        description="Serve a checkpoint over HTTP: OpenAI-compatible /v1/completions with "
        "streaming, scoring (echo + logprobs) and sessions that keep a document's memory; "
        "/v1/classify for a classifier; a playground page at /.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    p.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="require Authorization: Bearer KEY on /v1 and /metrics (default: $TXLM_API_KEY)",
    )  # fmt: skip
    add_device_options(p, precision=True)
    p.add_argument(
        "--compile", nargs="?", choices=list(COMPILE), const="on", default="auto",
        help="on: torch.compile the decoding step for each batch bucket (1, 2, 4, .. rows), "
        "its compiled code kept in TXLM_HOME/inductor; package (a CPU): each bucket's step "
        "compiled ahead of time by AOTInductor, kept in TXLM_HOME/packages; auto (the "
        "default): this checkpoint's kept packages of the server's step where there are "
        "some, else the eager step; it makes none (docs/generation.md)",
    )  # fmt: skip
    d = ServeConfig()
    caps = [
        ("--max-batch", "max_batch", "rows decoded together"),
        ("--max-sessions", "max_sessions", "sessions kept (least recently used evicted)"),
        ("--max-session-bytes", "max_session_bytes", "bytes of all sessions' memories"),
        ("--max-queue", "max_queue", "requests waiting; past it 429"),
        ("--max-body-bytes", "max_body_bytes", "bytes of a request body"),
        ("--max-prompt-tokens", "max_prompt_tokens", "prompt tokens of a request"),
        ("--max-tokens", "max_tokens", "max_tokens of a request"),
        ("--max-n", "max_n", "n of a request"),
        ("--max-logprobs", "max_logprobs", "logprobs of a request"),
    ]
    for flag, name, what in caps:
        p.add_argument(flag, type=int, default=getattr(d, name), metavar="N",
                       help=f"{what} (default {getattr(d, name)})")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=d.request_timeout, metavar="S",
                   help=f"seconds a request may take (default {d.request_timeout:g})")  # fmt: skip
    from_run = "(default: the run's evaluation length)"
    p.add_argument("--mem-len", type=int, default=None, metavar="N", help=f"memory {from_run}")
    p.add_argument("--tgt-len", type=int, default=None, metavar="N", help=f"segment {from_run}")
    p.add_argument("--clamp-len", type=int, default=None, metavar="N",
                   help=f"clamp relative distances {from_run}")  # fmt: skip
    p.add_argument("--name", default=None, help="the model's id in /v1/models (default: the "
                   "checkpoint directory's name)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from txlm.checkpoints.checkpoint import home
    from txlm.inference.compiled import artifacts_in
    from txlm.serve.application import create_app
    from txlm.serve.service import Service

    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65536), got {args.port}")
    key = args.api_key if args.api_key is not None else os.environ.get("TXLM_API_KEY") or None
    config = ServeConfig(
        api_key=key, max_batch=args.max_batch, max_queue=args.max_queue,
        max_sessions=args.max_sessions, max_session_bytes=args.max_session_bytes,
        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens, max_n=args.max_n, max_logprobs=args.max_logprobs,
        request_timeout=args.request_timeout,
    )  # fmt: skip
    apply_threads(args)
    service = Service(
        args.checkpoint, config, device=args.device, precision=args.precision,
        compile=COMPILE[args.compile],
        tgt_len=args.tgt_len, mem_len=args.mem_len, clamp_len=args.clamp_len, name=args.name,
    )  # fmt: skip
    use_precision(args.precision, service.device)
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    settings = uvicorn.Config(create_app(service), log_level="warning", lifespan="on")
    server = _server(settings, service)
    service.on_failure = lambda: setattr(server, "should_exit", True)
    # listening at once (/health answers 503 while the model loads), ready once it has loaded
    service.on_ready = lambda: print(f"txlm: {service.name} loaded, ready for requests",
                                     flush=True)  # fmt: skip
    print(f"txlm: serving {service.name} at http://{shown}:{port}", flush=True)
    with sock, artifacts_in(home() / "inductor"):  # (a compiled step's code, kept)
        server.run(sockets=[sock])
    if service.error is not None:  # the model did not load: the server stopped at once
        if isinstance(service.error, TxlmError):
            raise service.error
        raise CheckpointError(f"cannot load {args.checkpoint}: {service.failed}")
    return 0


def _server(config, service):
    """uvicorn's server, whose SIGTERM / SIGINT end the open requests first (each gets a
    final event) and leave the process to exit 0, rather than raising the signal again."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            service.stop(wait=False)  # open streams get their final event; new requests 503

    return Server(config)
