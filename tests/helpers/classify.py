"""Shared by the classification tests: a tiny language-model checkpoint to fine-tune, labelled
document folders, and the marker task whose label only the memory can carry."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

FILLER = "abcdefgh"
MARKERS = {"x": "X", "y": "Y"}  # label -> the symbol that decides it
ALPHABET = FILLER + "".join(MARKERS.values())

# The marker task's layout: documents of 4 segments of 8 symbols; the marker sits in the
# second segment, so the last segment sees it only through the memory (mem_len 16 holds the
# second and third segments while the fourth is read).
SEGMENT, MEMORY, LENGTH = 8, 16, 32
MARKED = range(SEGMENT, 2 * SEGMENT)


def tiny_lm(directory: Path, *, alphabet: str = ALPHABET, seed: int = 0, **model) -> Path:
    """The debug model (seed-``seed`` weights) with a char vocabulary of ``alphabet``, saved
    as `txlm train` saves a checkpoint: something ``--init`` accepts."""
    import torch

    from txlm.checkpoints import checkpoint
    from txlm.config import PRESETS, ModelConfig
    from txlm.data.vocab import Vocab
    from txlm.model import TransformerXL

    vocab = Vocab.build_char(Counter(alphabet), unk=False)
    shape = {**PRESETS["debug"].model, "tgt_len": SEGMENT, "mem_len": MEMORY, **model}
    config = ModelConfig.from_dict({**shape, "vocab_size": len(vocab)})
    torch.manual_seed(seed)
    extra = {"vocab_fingerprint": vocab.fingerprint}
    return checkpoint.save(TransformerXL(config), directory, vocab=vocab, extra_config=extra)


def marker_documents(
    root: Path, counts: dict[str, int], *, seed: int = 0, length: int = LENGTH
) -> Path:
    """``root/<split>/<label>/NNN.txt`` for each split's count per label: filler symbols and
    one marker (its label's) at a position of ``MARKED``."""
    rng = random.Random(seed)
    for split, n in counts.items():
        for label, marker in MARKERS.items():
            folder = root / split / label
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                text = [rng.choice(FILLER) for _ in range(length)]
                text[rng.choice(MARKED)] = marker
                (folder / f"{i:03d}.txt").write_text("".join(text), encoding="utf-8")
    return root


def label_folders(root: Path, docs: dict[str, list[str]]) -> Path:
    """``root/<label>/NNN.txt``, one file per text."""
    for label, texts in docs.items():
        folder = root / label
        folder.mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(texts):
            (folder / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    return root


def save_classifier(
    directory: Path, lm: Path, labels=("x", "y"), pooling: str = "mean", train: dict | None = None
) -> Path:
    """A classifier (``lm``'s body, a seed-0 head) saved as the trainer saves one (``train``:
    the run's record, e.g. its dataset)."""
    import torch

    from txlm.checkpoints import checkpoint
    from txlm.classify.classifier import Classifier, ClassifierConfig
    from txlm.classify.predict import checkpoint_extras

    ckpt = checkpoint.Checkpoint.open(lm)
    torch.manual_seed(0)
    model = Classifier(ckpt.load_model(), ClassifierConfig(tuple(labels), pooling))
    vocab = ckpt.vocab()
    extra = {**checkpoint_extras(model), "vocab_fingerprint": vocab.fingerprint}
    if train is not None:
        extra["train"] = train
    return checkpoint.save(model, directory, vocab=vocab, extra_config=extra)
