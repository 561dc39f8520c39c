"""What a server is allowed to take: the limits and settings of one ``txlm serve``."""

from __future__ import annotations

from dataclasses import dataclass, fields

from txlm.errors import ConfigError


@dataclass(frozen=True)
class ServeConfig:
    """Limits of one server (each a ``txlm serve`` flag). Over a cap a request is refused
    (400 or 413) with a message naming the cap; nothing grows without bound."""

    api_key: str | None = None  # every /v1 route and /metrics require "Bearer KEY"
    max_batch: int = 16  # rows decoded together (prompts x n of every running request)
    max_queue: int = 256  # requests waiting for a row; past it: 429 with Retry-After
    max_sessions: int = 64  # sessions kept; the least recently used is evicted past it
    max_session_bytes: int = 1 << 30  # their memories' bytes together, likewise
    max_body_bytes: int = 4 << 20  # a request body
    max_prompt_tokens: int = 32768  # tokens of one request's prompts together
    max_tokens: int = 4096  # max_tokens of one request
    max_n: int = 16  # n of one request
    max_logprobs: int = 20  # logprobs (top alternatives per token)
    request_timeout: float = 300.0  # seconds a request may take, queueing included

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "api_key":
                if value is not None and not value:
                    raise ConfigError("api key must not be empty")
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                flag = "--" + f.name.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive number, got {value!r}")
