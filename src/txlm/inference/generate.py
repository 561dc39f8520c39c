"""Generation: the paper's sampling procedure (Appendix E) over a cached decoder.

Dimension legend
    B  rows (prompts x samples, prompt-major)     V  vocabulary

The prompts are read by a decoder (txlm.inference.decode: the context in end-aligned segments that
fill the memory, then one cached step per token) and each next token is drawn on the device
(txlm.inference.sampling: the renormalised top-k, k = 40 by default, optionally top-p and
min-p, at a temperature, or greedy; banned tokens never drawn). Every row of a batch, the
samples of a prompt included, decodes in one batch; a prompt with several samples is read
once, its cache rows then repeated. No step or draw reads a value back to the host;
``stream`` syncs once per token, to hand the ids out.

Seeds. With ``seed``, row r (prompts x samples, prompt-major) draws from its own generator,
seeded ``seed + r`` (``sample_seeds``): its prompt alone with ``num_samples=1, seed=seed + r``
draws the same sample again (one generator for every row: ``generator=``).

A repetition penalty reads each row's tokens so far, which a compiled step does not hold:
with one, each step gives the full next-token distribution (the decoder's log-probability
step, no cluster of an adaptive softmax skipped) and the draw follows it, outside the step.
Stop strings (txlm.inference.stops) are matched on each row's decoded text by ``generate``
and the CLI, which stop reading the stream once every row has ended.

An empty prompt starts from ``start_id`` (the vocabulary's end-of-sequence symbol in the CLI):
in the paper's word-level corpora every line ends with it, so it is what precedes a new text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from txlm.errors import ConfigError
from txlm.inference.decode import Decoder
from txlm.inference.prompts import banned_ids
from txlm.inference.sampling import Generators, SamplingConfig, mark_seen, sample, seen_tokens
from txlm.inference.stops import Continuation
from txlm.model.lengths import Lengths
from txlm.model.transformer import TransformerXL

PromptLike = Sequence[int] | Tensor


# -- prompts ----------------------------------------------------------------------------------
def _as_rows(prompts: PromptLike | Sequence[PromptLike]) -> list[list[int]]:
    """Normalise to a list of id lists (one prompt becomes one row)."""
    if isinstance(prompts, Tensor):
        if prompts.dim() == 1:
            return [prompts.tolist()]
        if prompts.dim() == 2:
            return prompts.tolist()
        raise ConfigError(f"prompt ids must be [P] or [B, P], got shape {tuple(prompts.shape)}")
    rows = list(prompts)
    if not rows or all(isinstance(x, int) for x in rows):
        return [[int(x) for x in rows]]
    out = []
    for r in rows:
        if isinstance(r, Tensor):
            r = r.tolist()
        if not all(isinstance(x, int) for x in r):
            raise ConfigError("prompt ids must be integers")
        out.append([int(x) for x in r])
    return out


# -- the generation loop ----------------------------------------------------------------------
def _check_samples(num_samples: int) -> None:
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ConfigError(f"num-samples must be an integer >= 1, got {num_samples!r}")


def sample_seeds(seed: int, rows: int) -> list[int]:
    """Each row's seed, rows prompt-major (prompts x samples): row r draws with ``seed + r``."""
    return [seed + r for r in range(rows)]


def _generators(
    seed: int | None, prompts: int, num_samples: int, device: torch.device
) -> Generators:
    """One generator per row, row r (prompt-major) seeded ``seed + r``; one for a batch of
    one row; without a seed one generator, seeded nondeterministically (and leaving the
    global RNG alone)."""
    if seed is None:
        generator = torch.Generator(device=device)
        generator.seed()
        return generator
    rows = [
        torch.Generator(device=device).manual_seed(s)
        for s in sample_seeds(seed, prompts * num_samples)
    ]
    return rows[0] if len(rows) == 1 else rows


def stream(
    model: TransformerXL,
    prompts: PromptLike | Sequence[PromptLike],
    *,
    max_new_tokens: int = 100,
    sampling: SamplingConfig | None = None,
    seed: int | None = None,
    num_samples: int = 1,
    start_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    stop_id: int | None = None,
    compile: bool | str = False,
    lengths: Lengths | None = None,
    int8: bool = False,
) -> Iterator[Tensor]:
    """Yield the new tokens one step at a time: [B] ids per step, B = prompts x num_samples
    (prompt-major: the samples of prompt 0 first).

    ``seed``: row r draws from a generator seeded ``seed + r``;
    ``generator``: one generator for every row instead. ``stop_id``: a row that has drawn it
    is finished; from then on it yields ``stop_id`` again (padding) and the stream ends once
    every row is finished. ``sampling.stop`` is not read here (``generate`` and the CLI match
    stop strings on the text and close the stream). The ids come back on
    the CPU; the next step is already queued on the device when they are read.
    ``compile``: how the decoding step is compiled (``txlm.inference.decode.Decoder``);
    "auto": from the kept packages of its step where there are some, else eager
    (``txlm.inference.packaged``).
    ``lengths``: the attention lengths to decode with (None: the model's).
    ``int8``: the decoder's layers and output head with int8 weights (weight-only, per row:
    txlm.inference.precision).
    The model is left as it is: each decoder call runs it in eval mode and puts it back
    (nothing is held changed across a ``yield``); the decoder's dtype is autocast's when
    it is on as the first step is taken (txlm.inference.decode.Decoder).
    """
    sampling = sampling or SamplingConfig()
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"max-new-tokens must be a non-negative integer, got {max_new_tokens!r}")
    rows = _as_rows(prompts)
    _check_samples(num_samples)
    if stop_id is not None and not 0 <= stop_id < model.config.vocab_size:
        raise ConfigError(
            f"stop id {stop_id} is outside the vocabulary (size {model.config.vocab_size})"
        )
    vocab = model.config.vocab_size
    if sampling.ban and sampling.ban[-1] >= vocab:
        raise ConfigError(
            f"banned token id {sampling.ban[-1]} is outside the vocabulary [0, {vocab})"
        )
    if len(sampling.ban) >= vocab:
        raise ConfigError("every token of the vocabulary is banned")
    decoder = Decoder(model, lengths=lengths, cache=use_cache, compile=compile, int8=int8)
    generators = generator
    if generators is None:
        generators = _generators(seed, len(rows), num_samples, decoder.device)
    if max_new_tokens == 0:
        return
    history = sampling.penalised  # the draw reads each row's tokens so far, after the step
    # each prompt read once, its rows repeated for its samples (C36)
    if history:
        log_probs = decoder.prefill(rows, start_id=start_id, repeats=num_samples)
        read = [r or [start_id] for r in rows for _ in range(num_samples)]
        seen = seen_tokens(read, vocab, decoder.device)  # what the model has read
        tokens = sample(log_probs, sampling, generators, seen=seen)
    else:
        tokens = decoder.prefill(
            rows, start_id=start_id, repeats=num_samples, sampling=sampling, generator=generators
        )
    finished = torch.zeros(len(rows) * num_samples, dtype=torch.bool, device=decoder.device)
    for t in range(max_new_tokens):
        if stop_id is not None:
            tokens = tokens.masked_fill(finished, stop_id)
            finished |= tokens == stop_id
        upcoming = None
        if t + 1 < max_new_tokens and history:
            mark_seen(seen, tokens)
            upcoming = sample(decoder.step(tokens), sampling, generators, seen=seen)
        elif t + 1 < max_new_tokens:  # queued on the device before the host waits below
            upcoming = decoder.step(tokens, sampling, generators)
        host = tokens.cpu()  # the one host synchronisation per token
        yield host
        if stop_id is not None and bool((host == stop_id).all()):
            return
        tokens = upcoming


def generate(
    model: TransformerXL,
    prompts: PromptLike | Sequence[PromptLike],
    *,
    max_new_tokens: int = 100,
    sampling: SamplingConfig | None = None,
    top_k: int | None = 40,
    top_p: float | None = None,
    min_p: float | None = None,
    temperature: float = 1.0,
    greedy: bool = False,
    repetition_penalty: float = 1.0,
    ban: Sequence[int | str] | None = None,
    stop: str | Sequence[str] = (),
    vocab: Any = None,
    seed: int | None = None,
    num_samples: int = 1,
    start_id: int | None = None,
    use_cache: bool = True,
    stop_id: int | None = None,
    compile: bool | str = False,
    lengths: Lengths | None = None,
    int8: bool = False,
) -> list[list[int]]:
    """Sample continuations; returns the new ids only, one list per row: prompts x samples,
    prompt-major (the samples of prompt 0 first). One prompt (a list of ids or a 1-D tensor)
    is one row, so ``generate(model, ids)[0]`` is its continuation.

    Sampling options as in ``SamplingConfig`` (``sampling`` overrides the keyword ones, its
    ``ban`` and ``stop`` as they are). ``temperature=0`` is greedy. The same ``seed`` gives
    the same ids; row r is drawn from seed ``seed + r`` (its prompt alone, ``num_samples=1``
    and ``seed + r``: the same ids). ``stop_id`` (e.g.
    the vocabulary's ``<eos>``): each row ends with the first one it draws.

    ``vocab`` (the checkpoint's, ``txlm.load_vocab``): what decodes the text stop strings are
    matched in, and names ``ban`` may give. ``ban``: token ids or symbols never drawn; None
    (the default) bans ``<unk>`` when ``vocab`` has one, unless every prompt holds it;
    ``()`` bans nothing. ``stop``: stop strings; a row ends when its generated text holds
    one, and its ids end before it (txlm.inference.stops: the longest prefix of the new ids
    whose text ends at or before the stop string).
    """
    rows = _as_rows(prompts)
    if sampling is None:
        sampling = SamplingConfig(
            top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature, greedy=greedy,
            repetition_penalty=repetition_penalty, ban=banned_ids(vocab, ban, rows),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
        )  # fmt: skip
    decode = None if vocab is None else vocab.decode
    ends = [
        Continuation(decode, r, sampling.stop, stop_id) for r in rows for _ in range(num_samples)
    ]
    steps = stream(
        model, rows, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
        num_samples=num_samples, start_id=start_id, use_cache=use_cache, stop_id=stop_id,
        compile=compile, lengths=lengths, int8=int8,
    )  # fmt: skip
    for tokens in steps:
        done = [end.push(tid) for end, tid in zip(ends, tokens.tolist(), strict=True)]
        if all(done):
            break
    return [end.kept_ids() for end in ends]
