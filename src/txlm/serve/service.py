"""One served checkpoint: opened at once (a bad path fails before a server starts), its
model loaded in the background (``/health`` answers 503 until then), and the engine that
runs it."""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from txlm.checkpoints.checkpoint import Checkpoint
from txlm.checkpoints.convert import text_options
from txlm.data.text import normalize_text
from txlm.devices import autocast, check_precision, resolve_device
from txlm.errors import ConfigError, TxlmError
from txlm.inference.compiled import StepCompile
from txlm.inference.prompts import banned_ids, encode_prompt, start_token
from txlm.inference.sampling import SamplingConfig
from txlm.serve.config import ServeConfig
from txlm.serve.engine import Engine
from txlm.serve.errors import APIError, bad
from txlm.serve.metrics import Metrics
from txlm.serve.sessions import SessionStore


class Service:
    def __init__(
        self,
        checkpoint: str | Path | Checkpoint,
        config: ServeConfig | None = None,
        *,
        device: str = "auto",
        precision: str = "fp32",
        compile: bool | str | StepCompile = "auto",
        tgt_len: int | None = None,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        name: str | None = None,
    ) -> None:
        self.ckpt = (
            checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint.open(checkpoint)
        )
        self.config = config or ServeConfig()
        self.device = resolve_device(device)
        check_precision(precision, self.device)
        self.precision = precision
        self.compile = compile
        self.lengths = self.ckpt.lengths(tgt_len, mem_len, clamp_len)
        self.name = name or self.ckpt.path.name
        self.task = self.ckpt.task
        if self.task == "classify" and precision == "int8":
            raise ConfigError("--precision int8 is a language model's decoder: a classifier "
                              "serves in fp32 or bf16")  # fmt: skip
        self.created = int(time.time())
        self.metrics = Metrics()
        self.sessions = SessionStore(self.config.max_sessions, self.config.max_session_bytes)
        self.sessions.on_change = self._count_sessions
        self.ready = threading.Event()
        self.failed: str | None = None  # why the model did not load
        self.error: Exception | None = None
        self.on_failure = lambda: None  # the command stops its server: one line, exit 2
        self.on_ready = lambda: None  # the command says so: a second line
        self.model: Any = None
        self.vocab: Any = None
        self.engine: Engine | None = None
        self._loader: threading.Thread | None = None

    def _count_sessions(self, store: SessionStore) -> None:
        self.metrics.sessions.set(len(store.list()))
        self.metrics.session_bytes.set(store.total_bytes)

    # -- loading ------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model and start the engine in the background (once: not again after
        ``load``)."""
        if self._loader is None and not self.ready.is_set():
            self._loader = threading.Thread(target=self._load, name="txlm-serve-load", daemon=True)
            self._loader.start()

    def _load(self) -> None:
        try:
            self.load()
        except Exception as exc:  # reported by /health; the command then exits 2
            if not isinstance(exc, TxlmError):
                traceback.print_exc(file=sys.stderr)
            self.error, self.failed = exc, str(exc)
            self.on_failure()

    def load(self) -> None:
        if self.task == "classify":
            # the opened checkpoint's classifier (its body unpadded, as txlm.load_classifier)
            self.model = self.ckpt.load_model(self.device, align_heads=False, task="classify")
            self.vocab = self.model.vocab
        else:
            self.model = self.ckpt.load_model(self.device)
            self.vocab = self.ckpt.vocab() if self.ckpt.has_vocab else None
        start = None if self.vocab is None else start_token(self.vocab)
        self.engine = Engine(
            self.model, self.vocab, self.lengths, max_batch=self.config.max_batch,
            max_queue=self.config.max_queue, sessions=self.sessions, metrics=self.metrics,
            start_id=start, precision_context=functools.partial(
                autocast, self.device, self.precision),
            int8=self.precision == "int8", compile=self.compile, decoder=self.task == "lm",
        )  # fmt: skip
        self.engine.start()
        self.ready.set()
        self.on_ready()

    def stop(self, *, wait: bool = True) -> None:
        if self.engine is not None:
            self.engine.stop()
            if wait:
                self.engine.join(10)

    def require(self, task: str) -> Engine:
        if self.failed is not None:
            raise APIError(503, f"the model failed to load: {self.failed}")
        if not self.ready.is_set() or self.engine is None:
            raise APIError(503, "the model is loading: try again shortly",
                           headers={"Retry-After": "1"})  # fmt: skip
        if task != self.task:
            if self.task == "classify":
                raise APIError(400, "this server holds a classifier checkpoint: use "
                               "POST /v1/classify, not completions")  # fmt: skip
            raise APIError(400, "this server holds a language model: use POST /v1/completions; "
                           "/v1/classify needs a classifier checkpoint")  # fmt: skip
        return self.engine

    # -- prompts ------------------------------------------------------------------------
    def encode(self, prompt: str | list[int], field: str = "prompt") -> list[int]:
        vocab_size = self.ckpt.model_config.vocab_size
        if isinstance(prompt, list):
            wrong = [t for t in prompt if not 0 <= t < vocab_size]
            if wrong:
                raise bad(f"'{field}' holds token id {wrong[0]}, outside the vocabulary "
                          f"[0, {vocab_size})", field)  # fmt: skip
            return prompt
        if self.vocab is None:
            raise bad(f"this checkpoint has no vocabulary: send '{field}' as token ids", field)
        text = normalize_text(prompt, text_options(self.ckpt.data))
        ids, unknown = encode_prompt(self.vocab, text)
        if unknown and self.vocab.unk_id is None:
            raise bad(f"'{field}' has {unknown} symbol(s) the vocabulary lacks (and it has no "
                      "<unk>)", field)  # fmt: skip
        return ids

    def sampling(self, sampling: SamplingConfig, prompts: list[list[int]]) -> SamplingConfig:
        """A request's settings with its bans checked against the vocabulary and ``<unk>``
        banned as ``txlm generate`` bans it: unless every prompt holds it."""
        vocab_size = self.ckpt.model_config.vocab_size
        ban = sampling.ban
        if ban and ban[-1] >= vocab_size:
            raise bad(f"'logit_bias' holds token id {ban[-1]}, outside the vocabulary "
                      f"[0, {vocab_size})", "logit_bias")  # fmt: skip
        ban = tuple(sorted({*ban, *banned_ids(self.vocab, None, prompts)}))
        if len(ban) >= vocab_size:
            raise bad("'logit_bias' bans every token of the vocabulary", "logit_bias")
        return dataclasses.replace(sampling, ban=ban)

    def decode(self, ids: list[int]) -> str:
        return "" if self.vocab is None else self.vocab.decode(ids)

    def describe(self) -> dict[str, Any]:
        c = self.ckpt.model_config
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "txlm",
            "task": self.task,
            "vocab_size": c.vocab_size,
            "lengths": {
                "tgt_len": self.lengths.tgt_len,
                "mem_len": self.lengths.mem_len,
                "clamp_len": self.lengths.clamp_len,
                "same_length": self.lengths.same_length,
            },
            "ready": self.ready.is_set(),
        }
