"""Prompts as the CLI and the end-of-training sample read them: text -> ids, the tokens
that start an empty prompt and end a sample, and the tokens a sample never draws. One
place, so ``txlm train``'s closing sample and ``txlm generate`` with the same seed give the
same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from txlm.errors import ConfigError
from txlm.resources import ResourceError, read_bounded


def start_token(vocab: Any) -> int | None:
    """What an empty prompt starts from: a symbol that precedes new text in the corpora."""
    for tid in (vocab.doc_start_id, vocab.eos_id, vocab.bos_id):
        if tid is not None:
            return int(tid)
    newline = "10" if vocab.level == "byte" else "\n"
    return vocab.id_of(newline) if newline in vocab else None


def end_token(vocab: Any) -> int | None:
    """What ends a sample with --stop-at-eos: ``<eos>``, or a newline where the vocabulary
    has no ``<eos>`` (character and byte corpora mark line ends that way)."""
    if vocab.eos_id is not None:
        return int(vocab.eos_id)
    newline = "10" if vocab.level == "byte" else "\n"
    return vocab.id_of(newline) if newline in vocab else None


def encode_prompt(vocab: Any, text: str) -> tuple[list[int], int]:
    """Prompt ids and how many symbols became ``<unk>``.

    Word level: the vocabulary ends every line with ``<eos>``; an unfinished last line (no
    trailing newline) must stay open, so its ``<eos>`` is dropped.
    """
    ids = [int(i) for i in vocab.encode(text)]
    if (
        vocab.level == "word"
        and ids
        and vocab.eos_id is not None
        and ids[-1] == vocab.eos_id
        and not text.endswith(("\n", "\r"))
    ):
        ids.pop()
    return ids, vocab.count_unknown(text)


# A prompt is read whole before it is encoded; only its last --max-context tokens (512 by
# default) are ever read by the model. A bound keeps an endless source (a device, a pipe that
# never closes) from taking all memory: read at most this much, refuse anything longer.
MAX_PROMPT_BYTES = 64 * 1024 * 1024


def read_prompt_file(path: Path, limit: int = MAX_PROMPT_BYTES) -> str:
    """The text of a prompt file, at most ``limit`` bytes of UTF-8 (else ``ConfigError``)."""
    try:
        data = read_bounded(path, limit)
    except FileNotFoundError:
        raise ConfigError(f"prompt file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
    except ResourceError:
        raise ConfigError(
            f"prompt file {path} is longer than {limit // 2**20} MiB: pass a shorter prompt "
            "(only its last --max-context tokens are read)"
        ) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read prompt file {path}: not UTF-8 text ({exc})") from None


def banned_ids(
    vocab: Any, ban: Sequence[int | str] | None, prompts: Sequence[Sequence[int]]
) -> tuple[int, ...]:
    """The token ids a sample never draws. ``ban``: ids or symbols of ``vocab`` (symbols
    need it); None, the default: ``<unk>`` when ``vocab`` has one, unless every prompt holds
    it (a batch shares its bans, so no sample of a prompt without it draws it), nothing
    without a vocabulary; ``()``: nothing."""
    if ban is None:
        unk = None if vocab is None else vocab.unk_id
        if unk is None or all(unk in p for p in prompts):
            return ()
        return (int(unk),)
    if isinstance(ban, str | int):
        ban = [ban]
    out = []
    for item in ban:
        if isinstance(item, str):
            if vocab is None:
                raise ConfigError(f"banning {item!r} by name needs the vocabulary (vocab=)")
            if item not in vocab:
                raise ConfigError(f"cannot ban {item!r}: not a symbol of the vocabulary")
            out.append(int(vocab.id_of(item)))
        elif isinstance(item, int) and not isinstance(item, bool):
            out.append(item)
        else:
            raise ConfigError(f"a banned token is an id or a symbol, got {item!r}")
    return tuple(out)
