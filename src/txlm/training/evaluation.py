"""What a run measures beside training: a split's loss with the evaluation lengths
(validation during training, valid and test at the end) and the closing sample."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from txlm.checkpoints import checkpoint
from txlm.data import PreparedCorpus
from txlm.data.text import normalize_text
from txlm.inference.evaluate import evaluate_tokens
from txlm.model import TransformerXL
from txlm.model.lengths import Lengths
from txlm.training.config import TrainConfig
from txlm.training.sample import sample_text


def eval_lengths(model: TransformerXL, config: TrainConfig) -> Lengths:
    """The lengths a run evaluates with: ``eval``'s, each not set the model's."""
    e = config.eval
    return model.lengths.replace(
        tgt_len=e.eval_tgt_len, mem_len=e.eval_mem_len, clamp_len=e.eval_clamp_len,
        same_length=e.same_length,
    )  # fmt: skip


def evaluate_split(
    model: TransformerXL,
    corpus: PreparedCorpus,
    config: TrainConfig,
    split: str,
    *,
    full: bool,
    echo: bool,
    desc: str | None = None,
) -> dict[str, Any]:
    """Stream ``split`` with ``eval``'s lengths: at most ``eval.max_eval_steps`` segments, or
    when ``full`` the split's first ``eval.final_max_tokens`` tokens (None: all of them).

    Progress (``txlm.data.progress``): a bar on a terminal; into a file (stderr redirected), a
    line at every tenth of the segments of a ``full`` evaluation that takes more than a
    second, so a long one shows in a log that it moves (the run's capped validations stay
    quiet there).
    """
    e = config.eval
    tokens = corpus.split(split)
    max_steps = e.max_eval_steps
    if full:
        max_steps = None
        if e.final_max_tokens is not None and len(tokens) - 1 > e.final_max_tokens:
            tgt_len = e.eval_tgt_len or model.config.tgt_len
            rows = max(1, min(e.batch_size, len(tokens) - 1))
            max_steps = max(1, e.final_max_tokens // (rows * tgt_len))
    show = echo and config.run.progress
    terminal = sys.stderr.isatty()
    result = evaluate_tokens(
        model,
        tokens,
        batch_size=e.batch_size,
        lengths=eval_lengths(model, config),
        max_steps=max_steps,
        precision=config.run.precision,
        metric=corpus.metric,
        tokens_per_byte=corpus.tokens_per_byte(split),
        progress=show and (terminal or full),
        desc=desc or split,
    )
    result["split"] = split
    result["split_tokens"] = len(tokens)
    return result


def final_evaluation(
    model: TransformerXL,
    corpus: PreparedCorpus,
    config: TrainConfig,
    out: Path,
    device: torch.device,
    *,
    echo: bool,
) -> dict[str, Any]:
    """Valid and test with the preset's evaluation lengths, on ``out/best`` (``model`` when
    there is none); then a sample."""
    best_dir = out / "best"
    if best_dir.exists():
        model = checkpoint.load(best_dir, device=device)
    metric = corpus.metric
    summary: dict[str, Any] = {"metric": metric}
    for split in ("valid", "test"):
        result = evaluate_split(
            model, corpus, config, split, full=True, echo=echo, desc=f"final {split}"
        )
        summary[split] = result
        if echo:
            part = (
                f" (the first of {result['split_tokens']}: eval.final_max_tokens)"
                if result["tokens"] < result["split_tokens"] - 1
                else ""
            )
            print(
                f"{split}: loss {result['loss']:.4f}, {metric} {result[metric]:.4f} over "
                f"{result['tokens']} tokens{part} (tgt_len {result['tgt_len']}, mem_len "
                f"{result['mem_len']}), {result['tokens_per_s']:.0f} tokens/s"
            )
    e = config.eval
    if e.sample_tokens > 0:
        t0 = time.perf_counter()
        # the run's evaluation lengths, which `txlm generate CKPT` reads from the checkpoint
        # (Checkpoint.lengths): the same seed then gives the same text there
        lengths = eval_lengths(model, config)
        # a corpus prepared lower-cased (a converted tokenizer's option): the prompt too
        lower = bool(corpus.meta.get("tokenizer", {}).get("lower_case"))
        prompt = normalize_text(e.sample_prompt, {"lower_case": lower})
        text = sample_text(
            model, corpus.vocab, prompt, e.sample_tokens, top_k=e.sample_top_k,
            seed=config.run.seed, lengths=lengths,
        )  # fmt: skip
        summary["sample"] = text
        summary["sample_seconds"] = time.perf_counter() - t0
        if echo:
            print(
                f"sample (top-{e.sample_top_k}, {e.sample_tokens} tokens, seed {config.run.seed}):"
            )
            print(text)
    return summary
