"""What a run measures beside training: a split's loss with the evaluation lengths
(validation during training, valid and test at the end) and the closing sample."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from txlm import checkpoint
from txlm.data import PreparedCorpus
from txlm.evaluate import evaluate_tokens
from txlm.model import TransformerXL
from txlm.training.config import TrainConfig
from txlm.training.sample import sample_text


def evaluate_split(
    model: TransformerXL,
    corpus: PreparedCorpus,
    config: TrainConfig,
    split: str,
    *,
    full: bool,
    echo: bool,
) -> dict[str, Any]:
    """Stream ``split`` with ``eval``'s lengths (all of it when ``full``, else at most
    ``eval.max_eval_steps`` segments)."""
    e = config.eval
    result = evaluate_tokens(
        model,
        corpus.split(split),
        batch_size=e.batch_size,
        tgt_len=e.eval_tgt_len,
        mem_len=e.eval_mem_len,
        clamp_len=e.eval_clamp_len,
        same_length=e.same_length,
        max_steps=None if full else e.max_eval_steps,
        precision=config.run.precision,
        metric=corpus.metric,
        tokens_per_byte=corpus.tokens_per_byte(split),
        progress=echo and config.run.progress and sys.stderr.isatty(),
        desc=split,
    )
    result["split"] = split
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
        result = evaluate_split(model, corpus, config, split, full=True, echo=echo)
        summary[split] = result
        if echo:
            print(
                f"{split}: loss {result['loss']:.4f}, {metric} {result[metric]:.4f} over "
                f"{result['tokens']} tokens (tgt_len {result['tgt_len']}, mem_len "
                f"{result['mem_len']}), {result['tokens_per_s']:.0f} tokens/s"
            )
    e = config.eval
    if e.sample_tokens > 0:
        t0 = time.perf_counter()
        # the run's evaluation lengths, which `txlm generate CKPT` reads from the checkpoint
        # (Checkpoint.lengths): the same seed then gives the same text there
        lengths = model.lengths.replace(
            tgt_len=e.eval_tgt_len, mem_len=e.eval_mem_len, clamp_len=e.eval_clamp_len,
            same_length=e.same_length,
        )  # fmt: skip
        text = sample_text(
            model, corpus.vocab, e.sample_prompt, e.sample_tokens, top_k=e.sample_top_k,
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
