"""The completions request as the OpenAI API defines it, checked field by field.

Every field is named in the message that refuses it: unknown fields, fields txlm does not
support (``best_of`` > 1, ``suffix``, presence and frequency penalties, a ``logit_bias`` other
than a ban), wrong types and caps. ``logit_bias`` takes -100 only, which the OpenAI API
documents as a ban: the token is never drawn. Extensions, named as vLLM names them:
``top_k`` (default 40, as ``txlm generate``), ``min_p``, ``repetition_penalty`` (CTRL's, over
the prompt and the text so far, as ``txlm generate --repetition-penalty``) and ``session``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from txlm.inference.sampling import SamplingConfig
from txlm.serve.config import ServeConfig
from txlm.serve.errors import APIError, bad

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's

# accepted only at the value that means "off"
_OFF = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}
_KNOWN = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
    "stream", "stream_options", "logprobs", "echo", "user", "session", "min_p",
    "repetition_penalty", "logit_bias", *_OFF,
}  # fmt: skip


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]  # each a text or token ids
    max_tokens: int
    sampling: SamplingConfig
    n: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token; None: no log-probs
    echo: bool
    session: str | None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int, cap: str) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad(f"'{name}' must be an integer, got {type(value).__name__}", name)
    if value < lo:
        raise bad(f"'{name}' must be >= {lo}, got {value}", name)
    if value > hi:
        raise bad(f"'{name}' is {value}, over the server's cap of {hi} ({cap})", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {type(value).__name__}", name)
    return value


def _prompts(value: Any) -> list[str | list[int]]:
    if value is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(_is_int(x) for x in value):
        return [list(value)]
    if isinstance(value, list) and value:
        out: list[str | list[int]] = []
        for item in value:
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, list) and item and all(_is_int(x) for x in item):
                out.append(list(item))
            else:
                raise bad(
                    "'prompt' must be a string, a list of strings, a list of token ids or "
                    "a list of such lists",
                    "prompt",
                )
        return out
    raise bad(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "such lists (not empty)",
        "prompt",
    )


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    if len(items) > 4:
        raise bad(f"'stop' takes at most 4 strings, got {len(items)}", "stop")
    return tuple(items)


def _bans(value: Any) -> tuple[int, ...]:
    """``logit_bias`` {token id: -100}: the ids never drawn (sorted); a bias other than a ban
    is refused, as is an id that is not one."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad("'logit_bias' must be an object of token ids to -100", "logit_bias")
    ids = set()
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise bad(f"'logit_bias' keys are token ids, got {key!r}", "logit_bias")
        if not _is_num(bias) or bias != -100:
            raise bad(f"'logit_bias' takes only -100 (never draw the token), got {bias!r} for "
                      f"{key}", "logit_bias")  # fmt: skip
        ids.add(int(key))
    return tuple(sorted(ids))


def parse_completion(body: Any, limits: ServeConfig) -> CompletionRequest:
    """The checked request, or ``APIError`` (400) naming the field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise bad(f"unknown field '{unknown[0]}'", unknown[0])
    for name, off in _OFF.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value not in off):
            raise bad(f"'{name}' is not supported by txlm serve (only {off[1]!r})", name)
    if "model" in body and not isinstance(body["model"], str):
        raise bad("'model' must be a string", "model")
    if "user" in body and not isinstance(body["user"], str | None):
        raise bad("'user' must be a string", "user")
    prompts = _prompts(body.get("prompt"))
    max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS, 0, limits.max_tokens, "--max-tokens")
    n = _int(body, "n", 1, 1, limits.max_n, "--max-n")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad(f"'seed' must be an integer, got {type(seed).__name__}", "seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise bad(f"'seed' must be in [0, 2**63), got {seed}", "seed")
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if not _is_num(temperature) or temperature < 0:
        raise bad("'temperature' must be a number >= 0 (0: greedy)", "temperature")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_num(top_p) or not 0 < top_p <= 1):
        raise bad("'top_p' must be a number in (0, 1]", "top_p")
    top_k = _int(body, "top_k", 40, 1, 2**31, "top_k")
    min_p = body.get("min_p")
    if min_p is not None and (not _is_num(min_p) or not 0 <= min_p < 1):
        raise bad("'min_p' must be a number in [0, 1)", "min_p")
    penalty = body.get("repetition_penalty")
    penalty = 1.0 if penalty is None else penalty
    if not _is_num(penalty) or penalty <= 0:
        raise bad("'repetition_penalty' must be a number > 0 (1: off)", "repetition_penalty")
    sampling = SamplingConfig(
        top_k=top_k,
        top_p=None if top_p is None or top_p >= 1 else float(top_p),
        temperature=float(temperature) if temperature > 0 else 1.0,
        greedy=temperature == 0,
        min_p=None if not min_p else float(min_p),
        repetition_penalty=float(penalty),
        ban=_bans(body.get("logit_bias")),
    )
    logprobs = _int(body, "logprobs", None, 0, limits.max_logprobs, "--max-logprobs")
    echo = _flag(body, "echo")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("'stream_options' takes only 'include_usage'", "stream_options")
        include_usage = options.get("include_usage") is True
    session = body.get("session")
    if session is not None:
        if not isinstance(session, str) or not session:
            raise bad("'session' must be a non-empty string (an id from POST /v1/sessions)",
                      "session")  # fmt: skip
        if len(prompts) != 1 or n != 1:
            raise bad("a 'session' request takes one prompt and n = 1", "session")
    if max_tokens == 0 and not echo:
        raise bad("'max_tokens' 0 returns nothing without 'echo': true", "max_tokens")
    return CompletionRequest(
        prompts=prompts, max_tokens=max_tokens, sampling=sampling, n=n, seed=seed,
        stop=_stop(body.get("stop")), stream=stream, include_usage=include_usage,
        logprobs=logprobs, echo=echo, session=session,
    )  # fmt: skip


def check_prompt_tokens(total: int, limits: ServeConfig) -> None:
    if total > limits.max_prompt_tokens:
        raise APIError(
            413,
            f"the prompt has {total} tokens, over the server's cap of "
            f"{limits.max_prompt_tokens} (--max-prompt-tokens)",
            "prompt",
        )
