"""``txlm generate CKPT --prompt TEXT``: sample text from a checkpoint, streamed as produced.

The context is read in segments that fill the memory, then tokens are drawn one at a time from
the renormalised top-k (the paper's Appendix E), each step reusing the cached memory keys and
values (txlm.generate). Symbols of the prompt that the vocabulary lacks become ``<unk>`` when
it has one (a note on stderr says how many); without ``<unk>`` the prompt is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from txlm.checkpoints.checkpoint import Checkpoint, home
from txlm.checkpoints.convert import text_options
from txlm.commands.options import COMPILE, add_device_options, apply_threads, use_precision
from txlm.data.text import normalize_text
from txlm.devices import autocast, resolve_device
from txlm.errors import ConfigError
from txlm.inference.compiled import artifacts_in
from txlm.inference.generate import sample_seeds, stream
from txlm.inference.prompts import (
    banned_ids,
    encode_prompt,
    end_token,
    read_prompt_file,
    start_token,
)
from txlm.inference.sampling import SamplingConfig
from txlm.inference.stops import Continuation

DEFAULT_MAX_CONTEXT = 512  # Appendix E: "a context of up to 512 tokens"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="sample text from a checkpoint (cached incremental decoding)",
        description="Sample text from a checkpoint, streamed as it is produced: the prompt is "
        "read in segments that fill the memory, then each token is one cached step.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompt", metavar="TEXT", action="append",
        help='the context ("" starts from nothing); repeat for several prompts in one batch',
    )  # fmt: skip
    src.add_argument(
        "--prompt-file", metavar="F", type=Path, help="read the context from F (-: standard input)"
    )
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="default 200")
    p.add_argument("--top-k", type=int, default=40, metavar="K", help="default 40 (paper)")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus, in (0, 1]")
    p.add_argument(
        "--min-p", type=float, default=None, metavar="P",
        help="keep tokens at least P times as likely as the most likely one, in [0, 1]",
    )  # fmt: skip
    p.add_argument(
        "--temperature", type=float, default=1.0, metavar="T", help=">= 0, default 1 (0: greedy)"
    )
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, metavar="R",
        help="divide the scores of tokens already present by R (CTRL; default 1: off)",
    )  # fmt: skip
    p.add_argument(
        "--ban", metavar="TOKEN", action="append", default=[],
        help="never draw this vocabulary symbol (repeatable); <unk> is banned by default",
    )  # fmt: skip
    p.add_argument(
        "--allow-unk", action="store_true",
        help="let samples draw <unk> (banned by default unless every prompt holds it)",
    )  # fmt: skip
    p.add_argument(
        "--stop", metavar="TEXT", action="append", default=[],
        help="end a sample where its text reaches TEXT, excluded (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--seed", type=int, default=None, metavar="S",
        help="same seed, same text; sample r (all prompts' in order) is drawn with seed S + r - 1",
    )  # fmt: skip
    p.add_argument("--num-samples", type=int, default=1, metavar="K", help="samples per prompt")
    p.add_argument(
        "--max-context",
        type=int,
        default=DEFAULT_MAX_CONTEXT,
        metavar="N",
        help=f"read at most the last N prompt tokens (default {DEFAULT_MAX_CONTEXT}; 0: all)",
    )
    # as in txlm eval: each default is the length the run evaluated with, else the model's
    from_run = "(default: the run's evaluation length)"
    p.add_argument(
        "--mem-len", type=int, default=None, metavar="N", help=f"memory length {from_run}"
    )
    p.add_argument(
        "--tgt-len", type=int, default=None, metavar="N", help=f"context segment {from_run}"
    )
    p.add_argument(
        "--clamp-len",
        type=int,
        default=None,
        metavar="N",
        help=f"clamp relative distances {from_run}",
    )
    add_device_options(p, precision=True)
    p.add_argument("--no-cache", action="store_true", help="re-project the memory each step")
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end each sample at <eos> (character/byte vocabularies: at a newline)",
    )
    p.add_argument(
        "--compile", nargs="?", choices=list(COMPILE), const="on", default="auto",
        help="on: torch.compile the decoding step (on CUDA then captured in a CUDA graph), "
        "once before the first token, its compiled code kept in TXLM_HOME/inductor; "
        "package (a CPU): the step compiled ahead of time by AOTInductor, its package kept "
        "in TXLM_HOME/packages and opened in a fraction of a second next time; auto (the "
        "default): this checkpoint's kept packages of these sampling settings where there "
        "are some, else the eager step; it makes none (docs/generation.md); --compile "
        "alone: on",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.set_defaults(func=run)


class _TextStream:
    """One row's continuation (txlm.inference.stops.Continuation: ended by a stop string or
    the stop id), written as tokens arrive when ``out`` is given: the decoding of the whole
    minus what was written (safe for vocabularies whose decode joins with spaces or
    assembles bytes), holding back what may yet begin a stop string."""

    def __init__(
        self, vocab: Any, prompt_ids: list[int], out: Any, stops: Any, stop_id: int | None
    ) -> None:
        self.row = Continuation(vocab.decode, prompt_ids, stops, stop_id)
        self.out = out
        self.written = 0

    @property
    def ids(self) -> list[int]:
        return self.row.ids

    def push(self, tid: int, *, final: bool = False) -> None:
        self.row.push(tid)
        if self.out is not None:
            self.flush(final=final)

    def flush(self, *, final: bool = False) -> None:
        row = self.row
        text = row.text()
        if not final and not row.done:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence may still complete
            if row.matcher is not None:
                text = text[: row.matcher.safe(text)]
        if len(text) > self.written:
            self.out.write(text[self.written :])
            self.out.flush()
            self.written = len(text)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return list(args.prompt)
    return [read_prompt_file(args.prompt_file)]


def _check_memory(
    args: argparse.Namespace, model: Any, device: torch.device, rows: int, mem_len: int
) -> None:
    """Refuse a cache (rows x memory) that cannot fit (txlm.resources). After loading: the
    loader has checked config.json against the weights, whose memory is taken already."""
    from txlm import resources

    resources.check_generation(
        model.config, device, weights=0, rows=rows, samples=args.num_samples,
        mem_len=mem_len, precision=args.precision, cache=not args.no_cache,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    # Cheap checks first: a bad flag should not wait for a model to load.
    sampling = SamplingConfig(
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, temperature=args.temperature,
        greedy=args.greedy, repetition_penalty=args.repetition_penalty, stop=tuple(args.stop),
    )  # fmt: skip
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise ConfigError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_context < 0:
        raise ConfigError(f"--max-context must be >= 0 (0: all), got {args.max_context}")
    apply_threads(args)
    texts = _read_prompts(args)
    device = resolve_device(args.device)
    use_precision(args.precision, device)

    ckpt = Checkpoint.open(args.checkpoint)
    # the lengths of this run only: the model keeps the ones it was built with
    lengths = ckpt.lengths(args.tgt_len, args.mem_len, args.clamp_len)
    vocab = ckpt.vocab()
    model = ckpt.load_model(device, task="lm")
    _check_memory(args, model, device, rows=len(texts) * args.num_samples, mem_len=lengths.mem_len)

    prompts = []
    options = text_options(ckpt.data)  # a converted tokenizer's lower-casing, if any
    for ids, n_unk in (encode_prompt(vocab, normalize_text(t, options)) for t in texts):
        if n_unk:
            sys.stderr.write(
                f"txlm: note: {n_unk} prompt symbol(s) not in the vocabulary -> <unk>\n"
            )
        if args.max_context and len(ids) > args.max_context:
            sys.stderr.write(
                f"txlm: note: prompt has {len(ids)} tokens; reading the last {args.max_context} "
                "(--max-context 0 reads all)\n"
            )
            ids = ids[-args.max_context :]
        prompts.append(ids)
    stop = None
    if args.stop_at_eos:
        stop = end_token(vocab)
        if stop is None:
            raise ConfigError("--stop-at-eos: the vocabulary has neither <eos> nor a newline")
    start = start_token(vocab)
    if start is None and not all(prompts):
        raise ConfigError("empty prompt, and the vocabulary has no symbol to start from")
    ban = banned_ids(vocab, args.ban, prompts)
    if not args.allow_unk:
        ban += banned_ids(vocab, None, prompts)
    sampling = dataclasses.replace(sampling, ban=ban)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    seeds = sample_seeds(seed, len(prompts) * args.num_samples)  # one per row, prompt-major
    if args.seed is None and not args.json:
        more = f" (sample r: {seed} + r - 1)" if len(seeds) > 1 else ""
        sys.stderr.write(f"txlm: seed {seed}{more}\n")

    live = args.num_samples == 1 and len(prompts) == 1 and not args.json
    # one stream per row, prompt-major like txlm.inference.generate.stream
    rows = [(i, j) for i in range(len(prompts)) for j in range(args.num_samples)]
    out = sys.stdout if live else None
    streams = [_TextStream(vocab, prompts[i], out, sampling.stop, stop) for i, _ in rows]
    if live:
        sys.stdout.write(texts[0])
        sys.stdout.flush()
    began = time.perf_counter()
    first_at = None  # the first token: the prompt read, and a --compile step compiled
    n_new = 0
    steps = stream(
        model, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=seed,
        num_samples=args.num_samples, start_id=start, use_cache=not args.no_cache,
        stop_id=stop, compile=COMPILE[args.compile], lengths=lengths,
        int8=args.precision == "int8",
    )  # fmt: skip
    # the generator runs inside: each step too; a compiled step loads from TXLM_HOME next time
    with autocast(device, args.precision), artifacts_in(home() / "inductor"):
        for t, tokens in enumerate(steps):
            n_new = t + 1
            if first_at is None:
                first_at = time.perf_counter()
            final = n_new == args.max_new_tokens
            for s, tid in zip(streams, tokens.tolist(), strict=True):
                if not s.row.done:  # (an ended row's draws are not its sample)
                    s.push(int(tid), final=final)
            if all(s.row.done for s in streams):
                break
    elapsed = time.perf_counter() - began
    produced = sum(len(s.ids) for s in streams)  # rows stopped at <eos> count what they drew
    # the decoding rate, after the first token: a one-off compile is reported apart
    first_s = (first_at or began) - began
    decoding = elapsed - first_s
    rate = (produced - len(streams)) / decoding if n_new > 1 and decoding > 0 else 0.0

    if args.json:
        result = {
            "checkpoint": str(args.checkpoint),
            "seed": seed,
            "seeds": seeds,  # each sample's own: its prompt alone with it draws it again
            "prompt_tokens": [len(p) for p in prompts],
            "new_tokens": n_new,
            "new_tokens_per_sample": [len(s.ids) for s in streams],  # fewer where one stopped
            "samples": [s.row.text() for s in streams],  # up to a stop string, excluded
            "sample_ids": [s.row.kept_ids() for s in streams],
            "seconds": round(elapsed, 6),
            "first_token_s": round(first_s, 6),
            "tokens_per_s": round(rate, 2),  # after the first token
        }
        print(json.dumps(result))
        return 0
    if live:
        streams[0].flush(final=True)
        if not streams[0].row.text().endswith("\n"):  # a sample stopped at a newline has one
            sys.stdout.write("\n")
    else:
        # each prompt once, then its samples: the generated text only, each under a header
        # that marks where it starts (a long --prompt-file is not repeated per sample)
        for (i, j), s, row_seed in zip(rows, streams, seeds, strict=True):
            if j == 0:
                which = f"prompt {i + 1}" if len(prompts) > 1 else "prompt"
                sys.stdout.write(f"=== {which} ===\n{texts[i]}\n")
            which = f"prompt {i + 1}, sample {j + 1}" if len(prompts) > 1 else f"sample {j + 1}"
            sys.stdout.write(f"=== {which} (seed {row_seed}): generated ===\n{s.row.text()}\n")
    sys.stdout.flush()
    sys.stderr.write(
        f"txlm: {produced} tokens in {elapsed:.2f}s "
        f"(the first after {first_s:.2f}s, then {rate:.1f}/s)\n"
    )
    return 0
