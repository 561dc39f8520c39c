"""Generation: the paper's sampling procedure (Appendix E) over a cached decoder.

Dimension legend
    B  rows (prompts x samples, prompt-major)     V  vocabulary

The prompts are read by a decoder (txlm.inference.decode: the context in end-aligned segments that
fill the memory, then one cached step per token) and each next token is drawn on the device
(txlm.inference.sampling: the renormalised top-k, k = 40 by default, optionally top-p, at a
temperature, or greedy). Every row of a batch, the samples of a prompt included, decodes in
one batch; a prompt with several samples is read once, its cache rows then repeated. No
step or draw reads a value back to the host; ``stream`` syncs once per token, to hand the
ids out.

An empty prompt starts from ``start_id`` (the vocabulary's end-of-sequence symbol in the CLI):
in the paper's word-level corpora every line ends with it, so it is what precedes a new text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from txlm.errors import ConfigError
from txlm.inference.decode import Decoder
from txlm.inference.sampling import SamplingConfig
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
) -> Iterator[Tensor]:
    """Yield the new tokens one step at a time: [B] ids per step, B = prompts x num_samples
    (prompt-major: the samples of prompt 0 first).

    ``stop_id``: a row that has drawn it is finished; from then on it yields ``stop_id``
    again (padding) and the stream ends once every row is finished. The ids come back on
    the CPU; the next step is already queued on the device when they are read.
    ``compile``: run the decoding step under ``torch.compile`` (see
    ``txlm.inference.decode.Decoder``).
    ``lengths``: the attention lengths to decode with (None: the model's).
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
    decoder = Decoder(model, lengths=lengths, cache=use_cache, compile=compile)
    if generator is None:
        generator = torch.Generator(device=decoder.device)
        if seed is None:
            generator.seed()  # nondeterministic, and leaves the global RNG alone
        else:
            generator.manual_seed(seed)
    if max_new_tokens == 0:
        return
    # each prompt read once, its rows repeated for its samples (C36)
    tokens = decoder.prefill(
        rows, start_id=start_id, repeats=num_samples, sampling=sampling, generator=generator
    )
    finished = torch.zeros(len(rows) * num_samples, dtype=torch.bool, device=decoder.device)
    for t in range(max_new_tokens):
        if stop_id is not None:
            tokens = tokens.masked_fill(finished, stop_id)
            finished |= tokens == stop_id
        upcoming = None
        if t + 1 < max_new_tokens:  # queued on the device before the host waits below
            upcoming = decoder.step(tokens, sampling, generator)
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
    temperature: float = 1.0,
    greedy: bool = False,
    seed: int | None = None,
    num_samples: int = 1,
    start_id: int | None = None,
    use_cache: bool = True,
    stop_id: int | None = None,
    compile: bool | str = False,
    lengths: Lengths | None = None,
) -> list[list[int]]:
    """Sample continuations; returns the new ids only, one list per row: prompts x samples,
    prompt-major (the samples of prompt 0 first). One prompt (a list of ids or a 1-D tensor)
    is one row, so ``generate(model, ids)[0]`` is its continuation.

    Sampling options as in ``SamplingConfig`` (``sampling`` overrides the keyword ones). The
    same ``seed`` gives the same ids. ``stop_id`` (e.g. the vocabulary's ``<eos>``): each row
    ends with the first one it draws.
    """
    if sampling is None:
        sampling = SamplingConfig(top_k=top_k, top_p=top_p, temperature=temperature, greedy=greedy)
    steps = list(
        stream(
            model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
            num_samples=num_samples, start_id=start_id, use_cache=use_cache, stop_id=stop_id,
            compile=compile, lengths=lengths,
        )
    )  # fmt: skip
    batch = len(_as_rows(prompts)) * num_samples
    out = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in range(batch)]
    if stop_id is not None:  # drop the padding after each row's stop
        out = [r[: r.index(stop_id) + 1] if stop_id in r else r for r in out]
    return out
