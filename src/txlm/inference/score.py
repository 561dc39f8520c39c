"""Per-token log-probabilities of arbitrarily long text, in constant memory.

Legend: N tokens of the text, L segment length (tgt_len), M memory length (mem_len).

The text is one stream read in segments of L with the memory carried between them (the
paper's evaluation, Sec. 3.2): token t is scored given everything before it that the memory
reaches. Work memory is one segment's activations plus the memory, whatever N is; only the
N - 1 output values grow with the text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from txlm.checkpoints.checkpoint import Checkpoint
from txlm.errors import ConfigError, DataError
from txlm.inference.evaluate import stream_segments
from txlm.model.lengths import Lengths
from txlm.model.transformer import TransformerXL


def _ids(ids_or_text: str | Sequence[int] | Tensor | np.ndarray, vocab: Any) -> Tensor:
    if isinstance(ids_or_text, str):
        if vocab is None:
            raise ConfigError("scoring text needs a vocabulary (vocab=...); or pass token ids")
        return torch.as_tensor(vocab.encode(ids_or_text), dtype=torch.long)
    ids = torch.as_tensor(np.asarray(ids_or_text) if not isinstance(ids_or_text, Tensor)
                          else ids_or_text).long()  # fmt: skip
    if ids.dim() != 1:
        raise ConfigError(f"token ids must be one sequence [N], got shape {tuple(ids.shape)}")
    return ids


@torch.no_grad()
def score(
    model: TransformerXL,
    ids_or_text: str | Sequence[int] | Tensor | np.ndarray,
    vocab: Any = None,
    *,
    lengths: Lengths | None = None,
    tgt_len: int | None = None,
    mem_len: int | None = None,
    clamp_len: int | None = None,
    same_length: bool | None = None,
    precision: str = "fp32",
    progress: bool = False,
) -> Tensor:
    """log p(x_t | x_<t) for t = 1 .. N-1: float32 [N - 1] (the first token has no context).

    ``ids_or_text``: token ids ([N] list / array / tensor) or a string encoded with ``vocab``
    (``Vocab.encode``; its rules for unknown symbols apply). ``lengths`` (None: the model's),
    each of ``tgt_len`` .. ``same_length`` given changing it; the model is left unchanged.
    ``precision``: "fp32"; "bf16" or "fp16" (autocast); "int8" (the layers' weights in int8,
    read through the key/value cache: ``stream_segments``).
    """
    ids = _ids(ids_or_text, vocab)
    vocab_size = model.config.vocab_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ConfigError(f"token ids must lie in [0, {vocab_size})")
    n = max(ids.numel() - 1, 0)
    out = torch.empty(n, dtype=torch.float32)
    if n == 0:
        return out
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, unit="tok", desc="score", leave=False)
    lengths = (model.lengths if lengths is None else lengths).replace(
        tgt_len=tgt_len, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length
    )
    segments = stream_segments(model, ids, lengths=lengths, precision=precision)
    for seg in segments:
        width = seg.input_ids.size(1)
        out[seg.start : seg.start + width] = -seg.out.losses[0].float().cpu()
        if bar is not None:
            bar.update(width)
    if bar is not None:
        bar.close()
    return out


@dataclass
class TextScore:
    """Summary of ``score`` over a text: what ``txlm eval --file`` prints."""

    tokens: int  # scored tokens (N - 1)
    nll: float  # mean negative log-likelihood per token, nats
    ppl: float  # exp(nll)
    bits_per_token: float  # nll / ln 2 (bpc for a character-level vocabulary)
    tgt_len: int
    mem_len: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarize(log_probs: Tensor, *, tgt_len: int, mem_len: int) -> TextScore:
    if log_probs.numel() == 0:
        raise ConfigError("the text has fewer than two tokens: nothing to score")
    nll = float(-log_probs.double().mean())
    return TextScore(
        tokens=log_probs.numel(),
        nll=nll,
        ppl=math.exp(min(nll, 700.0)),
        bits_per_token=nll / math.log(2),
        tgt_len=tgt_len,
        mem_len=mem_len,
    )


def score_file(
    checkpoint: str | Path | Checkpoint,
    path: str | Path,
    *,
    lengths: Lengths | None = None,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
    progress: bool = False,
    data: bytes | None = None,
) -> dict[str, Any]:
    """``txlm eval CKPT --file F``: score any text file with a checkpoint, one stream.

    ``checkpoint``: a directory or an open ``Checkpoint``. ``lengths`` default to its
    evaluation lengths (``Checkpoint.lengths()``). ``data``: the file's bytes, already read
    (standard input: ``path`` is its name only). ``precision``: as ``score``'s. Symbols
    outside the vocabulary become ``<unk>`` when it has one, else the file is refused.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint.open(checkpoint)
    used = ckpt.lengths() if lengths is None else lengths
    file = Path(path)
    if data is None and not file.is_file():
        raise DataError(f"text file {file} does not exist")
    vocab = ckpt.vocab()
    model = ckpt.load_model(device, task="lm")
    raw = file.read_bytes() if data is None else data
    try:
        text: str | bytes = raw if vocab.level == "byte" else raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{file} is not UTF-8 text: {exc}") from None
    from txlm.checkpoints.convert import text_options  # a converted tokenizer's rules
    from txlm.data.text import normalize_text

    ids = vocab.encode(
        text if isinstance(text, bytes) else normalize_text(text, text_options(ckpt.data))
    )
    if vocab.doc_start_id is not None:  # the file is a document: read it as training did
        ids = [vocab.doc_start_id, *ids]
    ids = torch.as_tensor(ids, dtype=torch.long)
    n_bytes = len(text) if isinstance(text, bytes) else len(text.encode("utf-8"))

    began = time.perf_counter()
    log_probs = score(model, ids, lengths=used, precision=precision, progress=progress)
    seconds = time.perf_counter() - began
    result = summarize(log_probs, tgt_len=used.tgt_len, mem_len=used.mem_len).to_dict()
    from txlm.data.metrics import metric_for_level, metrics

    metric = metric_for_level(vocab.level)
    unk = vocab.unk_id
    # Bits per byte: the loss summed over the scored tokens, per byte of the file (with a
    # document-start symbol every token of the file is scored: the sum covers every byte).
    tokens_per_byte = log_probs.numel() / max(n_bytes, 1)
    result.update(
        file=str(file),
        checkpoint=str(ckpt.path),
        metric=metric,
        loss=result["nll"],
        clamp_len=used.clamp_len,
        same_length=used.same_length,
        precision=precision,
        unk_tokens=0 if unk is None else int((ids == unk).sum()),
        text_bytes=n_bytes,
        seconds=round(seconds, 4),
        tokens_per_s=round(log_probs.numel() / seconds, 1) if seconds > 0 else 0.0,
    )
    result.update(metrics(result["nll"], metric, tokens_per_byte=tokens_per_byte))
    return result
