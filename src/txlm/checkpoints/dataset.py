"""Which corpus a checkpoint was trained on, and where it is: what a run records in
config.json (``dataset``) and how ``txlm eval`` finds it again from any working directory.

A run records, beside the dataset name as it was given (``name``, ``prepared``: the folder's
name, ``level``):

    source       the name with its path made absolute (``text:/home/me/my_texts``,
                 ``classes:/home/me/my_plays``; a named dataset as it is)
    data_dir     the absolute data folder the corpus was prepared under
    path         the absolute prepared folder
    given_vocab  the corpus was encoded with the ``--init`` checkpoint's vocabulary (a
                 fine-tune): reading it again means encoding with the checkpoint's
    lower_case   that text was lower-cased first (a converted tokenizer's rule)

``dataset_of(ckpt)`` turns that back into what ``open_corpus`` is given. A relative path the
run was given is read from the working directory when the corpus is there (a run folder
moved or copied together with its data), else from where the run was trained.
``--dataset`` and ``--data-dir`` override the recorded dataset and data folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from txlm.checkpoints.checkpoint import Checkpoint
    from txlm.data.vocab import Vocab

_PATH_PREFIXES = ("text:", "classes:")


def absolute_source(name: str) -> str:
    """``name`` with the path of a ``text:`` or ``classes:`` dataset made absolute (resolved
    from the working directory), so that it means the same files from anywhere."""
    for prefix in _PATH_PREFIXES:
        if name.startswith(prefix) and name[len(prefix) :]:
            return prefix + str(Path(name[len(prefix) :]).expanduser().resolve())
    return name


def dataset_record(
    name: str, prepared: Path, *, level: str, metric: str, given_vocab: bool, lower_case: bool
) -> dict[str, Any]:
    """config.json's ``dataset`` for a language model's run on the corpus at ``prepared``."""
    path = Path(prepared).resolve()
    return {
        "name": name,
        "prepared": path.name,
        "level": level,
        "metric": metric,
        "source": absolute_source(name),
        "data_dir": str(path.parent),
        "path": str(path),
        "given_vocab": given_vocab,
        "lower_case": lower_case,
    }


def _path_exists(name: str) -> bool:
    """Whether a ``text:``/``classes:`` name's path exists from here (a named dataset: yes)."""
    for prefix in _PATH_PREFIXES:
        if name.startswith(prefix):
            return Path(name[len(prefix) :]).expanduser().exists()
    return True


@dataclass(frozen=True)
class DatasetRef:
    """What to open for a checkpoint's corpus (``txlm.data.open_corpus``'s arguments)."""

    name: str  # as the run (or --dataset) named it, for messages
    source: str  # the name to open: relative paths as they resolve for this call
    data_dir: str | None  # None: $TXLM_DATA_DIR or ./data
    level: str | None  # None: the dataset's default level (or the given vocabulary's)
    vocab: Vocab | None  # encode with this vocabulary (the checkpoint's), not the corpus's own
    lower_case: bool


def dataset_of(
    ckpt: Checkpoint, *, dataset: str | None = None, data_dir: str | None = None
) -> DatasetRef | None:
    """The corpus ``ckpt`` was trained on (None when it records none and ``dataset`` is not
    given). ``dataset``/``data_dir``: use these instead of the recorded ones; another dataset
    is read at the checkpoint's level, and encoded with its vocabulary when the run's was."""
    from txlm.checkpoints.convert import text_options
    from txlm.data.prepared import default_data_dir

    record = ckpt.data.get("dataset")
    record = record if isinstance(record, dict) else {}
    data = (ckpt.train_config or {}).get("data") or {}
    name = record.get("name") or data.get("dataset")
    if isinstance(record.get("dataset"), str):  # a classifier's record: classes:DIR
        name = name or record["dataset"]
    if not name and not dataset:
        return None
    given_vocab = record.get("given_vocab")
    if given_vocab is None:  # recorded before given_vocab was: the folder name tells
        given_vocab = "+" in str(record.get("prepared") or "")
    lower_case = record.get("lower_case")
    if lower_case is None:
        lower_case = text_options(ckpt.data)["lower_case"]

    configured = data.get("data_dir") or str(default_data_dir())
    if record.get("prepared"):
        here = (Path(configured) / record["prepared"]).is_dir()
    else:  # a classifier's documents are read where they are
        here = name.startswith("classes:") and Path(name[len("classes:") :]).is_dir()
    source, folder = name, data.get("data_dir")
    if not here:  # not beside this working directory: where the run was trained
        source = record.get("source") or name
        folder = record.get("data_dir") or folder
    elif not _path_exists(name):  # its data here, its text files only where it was trained
        source = record.get("source") or name
    if dataset is not None and dataset not in (name, record.get("source")):
        # another dataset: read where this call's data folder is, as any command would
        source, name, folder = dataset, dataset, data.get("data_dir")
    if data_dir is not None:
        folder = data_dir
    return DatasetRef(
        name=name,
        source=source,
        data_dir=os.fspath(folder) if folder else None,
        level=None if given_vocab else (record.get("level") or data.get("level")),
        vocab=ckpt.vocab() if given_vocab else None,
        lower_case=bool(lower_case) if given_vocab else False,
    )
