"""A classifier on a split: loss, accuracy, per-class precision, recall and F1, and the
confusion matrix.

Legend: N documents, C labels.

``confusion[i][j]``: documents of true label i predicted as j. For class c, precision is
TP / (predicted c), recall TP / (truly c), F1 their harmonic mean; a class never predicted
(or absent) has precision (recall) 0, as scikit-learn's ``zero_division=0``. ``macro_f1``:
the unweighted mean over classes.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from txlm.classify.classes import Documents
from txlm.classify.classifier import Classifier
from txlm.classify.predict import predict


def scores(labels: list[str], truth: np.ndarray, predicted: np.ndarray) -> dict[str, Any]:
    """Accuracy, per-class precision/recall/F1 and the confusion matrix of label ids."""
    C = len(labels)
    confusion = np.zeros((C, C), dtype=np.int64)
    np.add.at(confusion, (truth, predicted), 1)
    tp = np.diag(confusion).astype(np.float64)
    predicted_n, true_n = confusion.sum(0), confusion.sum(1)
    precision = np.divide(tp, predicted_n, out=np.zeros(C), where=predicted_n > 0)
    recall = np.divide(tp, true_n, out=np.zeros(C), where=true_n > 0)
    both = precision + recall
    f1 = np.divide(2 * precision * recall, both, out=np.zeros(C), where=both > 0)
    return {
        "documents": len(truth),
        "accuracy": float((truth == predicted).mean()) if len(truth) else 0.0,
        "macro_f1": float(f1.mean()),
        "per_class": {
            label: {
                "precision": float(precision[i]),
                "recall": float(recall[i]),
                "f1": float(f1[i]),
                "support": int(true_n[i]),
            }
            for i, label in enumerate(labels)
        },
        "labels": list(labels),
        "confusion": confusion.tolist(),
    }


def evaluate_documents(
    model: Classifier,
    documents: Documents,
    *,
    batch_size: int = 8,
    progress: bool = False,
    desc: str = "eval",
) -> dict[str, Any]:
    """The metrics of ``documents`` plus the mean cross-entropy (``loss``), documents and
    tokens per second. ``progress``: as ``predict``'s."""
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    probs = predict(model, documents.docs, batch_size=batch_size, progress=progress, desc=desc)
    seconds = time.perf_counter() - t0
    model.train(was_training)
    truth = documents.labels
    predicted = probs.argmax(1).numpy()
    picked = probs[torch.arange(len(truth)), torch.from_numpy(truth)]
    result = scores(list(model.labels), truth, predicted)
    tokens = int(documents.lengths().sum())
    result.update(
        loss=float(-picked.clamp(min=1e-300).log().mean()),
        tokens=tokens,
        seconds=seconds,
        docs_per_s=len(truth) / max(seconds, 1e-9),
        tokens_per_s=tokens / max(seconds, 1e-9),
    )
    return result


def report(result: dict[str, Any], split: str) -> str:
    """A human-readable table of ``result``."""
    labels = result["labels"]
    width = max(8, *(len(label) for label in labels))
    lines = [
        f"{split}: accuracy {result['accuracy']:.4f} ({result['documents']} documents), "
        f"macro F1 {result['macro_f1']:.4f}, loss {result['loss']:.4f}, "
        f"{result['docs_per_s']:.1f} documents/s",
        f"{'label':<{width}}  precision  recall     f1  support",
    ]
    for label in labels:
        c = result["per_class"][label]
        lines.append(
            f"{label:<{width}}  {c['precision']:9.4f}  {c['recall']:6.4f}  {c['f1']:5.4f}  "
            f"{c['support']:7d}"
        )
    lines.append("confusion (rows: true, columns: predicted)")
    lines.append(" " * width + "  " + "  ".join(f"{label:>{width}}" for label in labels))
    for label, row in zip(labels, result["confusion"], strict=True):
        lines.append(f"{label:<{width}}  " + "  ".join(f"{n:>{width}d}" for n in row))
    return "\n".join(lines)
