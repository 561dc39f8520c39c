"""Classifier checkpoints and classifying documents of any length.

    clf = txlm.load_classifier("runs/genre/best")  # written by txlm train --task classify
    txlm.classify(clf, "To be, or not to be")      # Prediction(label=..., probs={...})
    txlm.classify(clf, [12, 7, 40, ...])           # token ids of the checkpoint's vocabulary

A classifier checkpoint is a txlm checkpoint whose config.json says ``"task": "classify"``
and holds a ``classifier`` section (the labels in id order, the pooling); its ``model``
section is the body's configuration and model.safetensors holds ``body.*`` (the language
model's tensors) and ``head.*``. It is read as every checkpoint is
(``txlm.checkpoints.checkpoint.Checkpoint.load_model``; ``load_classifier`` is that call):
``txlm.load`` refuses it (it is not a language model) and ``load_classifier`` refuses a
language model, each in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from txlm.classify.classifier import Classifier
from txlm.classify.documents import pad_documents
from txlm.data.progress import Progress
from txlm.errors import CheckpointError, DataError

TASK = "classify"


def checkpoint_extras(model: Classifier) -> dict[str, Any]:
    """What a classifier's config.json holds besides the body's ``model`` section."""
    return {"task": TASK, "classifier": model.classifier_config.to_dict()}


@dataclass
class Prediction:
    label: str
    probs: dict[str, float]  # every label's probability, in label order


def _ids(model: Classifier, doc: str | Sequence[int], vocab: Any) -> list[int]:
    if isinstance(doc, str):
        vocab = vocab if vocab is not None else getattr(model, "vocab", None)
        if vocab is None:
            raise DataError("this classifier has no vocabulary: pass token ids or vocab=")
        ids = vocab.encode(doc)
    else:
        ids = [int(i) for i in doc]
    if not ids:
        raise DataError("cannot classify an empty document")
    n = model.config.vocab_size
    if min(ids) < 0 or max(ids) >= n:
        raise DataError(f"token ids must be in [0, {n}), got {min(ids)}..{max(ids)}")
    return ids


@torch.no_grad()
def predict(
    model: Classifier,
    docs: Sequence[Sequence[int]],
    *,
    batch_size: int = 8,
    progress: bool = False,
    desc: str = "classify",
) -> torch.Tensor:
    """[N, C] label probabilities of token-id documents, read in batches of similar length
    (each document alone in its row, memory carried across its segments). ``progress``: on
    stderr (``txlm.data.progress``: a bar on a terminal, lines in a log past a second)."""
    device = next(model.parameters()).device
    order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
    probs = torch.empty(len(docs), len(model.labels), dtype=torch.float64)
    with Progress(desc, len(docs), unit="documents", enabled=progress) as bar:
        for a in range(0, len(order), batch_size):
            picked = order[a : a + batch_size]
            ids, start = pad_documents(
                [np.asarray(docs[i], dtype=np.int64) for i in picked], model.lengths.tgt_len,
                device,
            )  # fmt: skip
            out = model(ids, start)
            probs[picked] = out.log_probs.double().exp().cpu()
            bar.update(len(picked))
    return probs


def classify(
    model: Classifier, text_or_ids: str | Sequence[int], *, vocab: Any = None
) -> Prediction:
    """The label of one document (text, encoded with the checkpoint's vocabulary or
    ``vocab``, or token ids) and every label's probability. Any length: the document is read
    segment by segment with the memory, in constant memory."""
    if not isinstance(model, Classifier):
        raise CheckpointError("txlm.classify needs a classifier (txlm.load_classifier)")
    probs = predict(model, [_ids(model, text_or_ids, vocab)])[0].tolist()
    labels = model.labels
    best = max(range(len(labels)), key=lambda i: probs[i])
    return Prediction(labels[best], dict(zip(labels, probs, strict=True)))
