"""A document-classification dataset: one folder per label, one ``.txt`` document per file.

    DIR/<label>/*.txt                    txlm splits it (seeded, stratified)
    DIR/train|valid|test/<label>/*.txt   the split as given

``data.dataset=classes:DIR``. Labels are the folder names, sorted: label id i is the i-th.
Documents are encoded with the vocabulary of the model being fine-tuned (the init
checkpoint's), so the ids mean what the body learned. A dataset that cannot train a
classifier is refused in one line (``DataError``): fewer than two labels, a label folder
without documents, an empty, unreadable or non-UTF-8 document, split folders whose labels
differ.

Without split folders each label's files (sorted by name) are shuffled with ``seed`` and cut
into test, valid and train by ``test_fraction`` and ``valid_fraction`` (every split gets at
least one document of a label that has three or more), so every split holds every label in
the dataset's proportions and the same seed gives the same split on any machine. The split
is recorded: ``meta`` lists each split's files per label, and ``record`` writes it beside
the prepared corpora (``DATA_DIR/classes/<name>-<hash>/split.json``).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from txlm import atomic
from txlm.data.vocab import Vocab
from txlm.errors import DataError
from txlm.resources import ResourceError, read_bounded

PREFIX = "classes:"
SPLITS = ("train", "valid", "test")
SUFFIX = ".txt"
MAX_DOCUMENT_BYTES = 256 * 2**20  # a device or a pipe named .txt must not be read forever


def is_classes(dataset: str) -> bool:
    return dataset.startswith(PREFIX)


def dataset_path(dataset: str) -> Path:
    path = dataset[len(PREFIX) :]
    if not path:
        raise DataError("data.dataset=classes:DIR needs a directory after 'classes:'")
    return Path(path).expanduser()


@dataclass
class Documents:
    """One split: documents as int64 id arrays and their label ids."""

    docs: list[np.ndarray]
    labels: np.ndarray  # [N] int64
    files: list[str]  # relative to the dataset directory

    def __len__(self) -> int:
        return len(self.docs)

    def lengths(self) -> np.ndarray:
        return np.asarray([len(d) for d in self.docs], dtype=np.int64)


@dataclass
class ClassDataset:
    path: Path
    labels: list[str]
    splits: dict[str, Documents]
    meta: dict[str, Any]

    def split(self, name: str) -> Documents:
        if name not in self.splits:
            raise DataError(f"{self.path} has no {name} split")
        return self.splits[name]

    def record(self, data_dir: Path) -> Path:
        """Write the split (``meta``) to ``data_dir/classes/<name>-<hash>/split.json``."""
        key = hashlib.sha256(json.dumps(self.meta, sort_keys=True).encode()).hexdigest()[:12]
        out = data_dir / "classes" / f"{self.path.name}-{key}" / "split.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        return atomic.write_json(out, self.meta)


def _label_folders(directory: Path) -> dict[str, list[Path]]:
    """label -> its documents (sorted), for a directory of label folders."""
    folders = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    found = {}
    for folder in folders:
        files = sorted(
            p for p in folder.iterdir() if p.suffix == SUFFIX and not p.name.startswith(".")
        )
        if not files:
            raise DataError(f"label folder {folder} holds no {SUFFIX} documents")
        found[folder.name] = files
    return found


def read_document(path: Path, vocab: Vocab) -> np.ndarray:
    """A document's token ids; ``DataError`` when it is unreadable, not UTF-8 or empty.
    ``-`` is standard input."""
    try:
        raw = read_bounded(path, MAX_DOCUMENT_BYTES)
    except OSError as exc:
        raise DataError(f"cannot read document {path}: {exc.strerror or exc}") from None
    except ResourceError:
        raise DataError(f"document {path} is larger than {MAX_DOCUMENT_BYTES >> 20} MiB") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"document {path} is not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise DataError(f"document {path} is empty")
    ids = vocab.encode_array(text)
    if ids.size == 0:
        raise DataError(f"document {path} encodes to no tokens")
    return ids


def stratified_split(
    files: dict[str, list[Path]], seed: int, valid_fraction: float, test_fraction: float
) -> dict[str, dict[str, list[Path]]]:
    """split -> label -> files: each label's files shuffled with ``seed`` and cut."""
    out: dict[str, dict[str, list[Path]]] = {s: {} for s in SPLITS}
    for label, paths in files.items():
        order = list(paths)
        random.Random(f"{seed}:{label}").shuffle(order)
        n = len(order)
        n_test = max(1, round(n * test_fraction)) if n >= 3 and test_fraction > 0 else 0
        n_valid = max(1, round(n * valid_fraction)) if n >= 3 and valid_fraction > 0 else 0
        out["test"][label] = order[:n_test]
        out["valid"][label] = order[n_test : n_test + n_valid]
        out["train"][label] = order[n_test + n_valid :]
    return out


def open_classes(
    dataset: str,
    vocab: Vocab,
    *,
    seed: int = 0,
    valid_fraction: float = 0.1,
    test_fraction: float = 0.1,
) -> ClassDataset:
    """Read, check, split and encode ``classes:DIR``."""
    root = dataset_path(dataset)
    if not root.is_dir():
        raise DataError(f"classification dataset {root} is not a directory")
    given = [s for s in SPLITS if (root / s).is_dir()]
    if given:
        if "train" not in given:
            raise DataError(f"{root} has {', '.join(given)} split folders but no train/")
        per_split = {s: _label_folders(root / s) for s in given}
        labels = sorted(per_split["train"])
        for s, found in per_split.items():
            if not set(found) <= set(labels):
                extra = sorted(set(found) - set(labels))
                raise DataError(f"{root / s} has labels the train split lacks: {extra}")
        split_files = {s: per_split.get(s, {}) for s in SPLITS}
        how: dict[str, Any] = {"given": True}
    else:
        files = _label_folders(root)
        labels = sorted(files)
        split_files = stratified_split(files, seed, valid_fraction, test_fraction)
        how = {"given": False, "seed": seed, "valid_fraction": valid_fraction,
               "test_fraction": test_fraction}  # fmt: skip
    if len(labels) < 2:
        found = f"only {labels[0]!r}" if labels else "none"
        raise DataError(f"{root} needs at least two label folders to classify, found {found}")
    index = {label: i for i, label in enumerate(labels)}
    splits = {}
    for s in SPLITS:
        docs, ids, names = [], [], []
        for label in labels:
            for path in split_files[s].get(label, []):
                docs.append(read_document(path, vocab))
                ids.append(index[label])
                names.append(path.relative_to(root).as_posix())
        splits[s] = Documents(docs, np.asarray(ids, dtype=np.int64), names)
    for s in ("train", "valid"):
        if not len(splits[s]):
            raise DataError(
                f"{root}: the {s} split holds no documents (give each label three or more "
                "documents, or a valid/ folder)"
            )
    meta = {
        "dataset": f"{PREFIX}{root}",
        "source": f"{PREFIX}{root.resolve()}",  # the same folder from any working directory
        "labels": labels,
        "split": how,
        "vocab_fingerprint": vocab.fingerprint,
        "files": {s: splits[s].files for s in SPLITS},
    }
    return ClassDataset(root, labels, splits, meta)
