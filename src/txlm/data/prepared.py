"""A prepared corpus on disk: its layout, and reading it back.

Layout of a prepared dataset ``DATA_DIR/NAME/``::

    train.bin valid.bin test.bin   token ids, raw little-endian, the smallest unsigned dtype
    vocab.json                     the vocabulary (see vocab.py)
    tokenizer.json                 bpe level only: the learnt BPE (see vocab.py)
    meta.json                      sources and their sha256, sizes, document offsets,
                                   tokenizer and split settings, the metric (bpc, bpb or
                                   ppl), each split's UTF-8 size and <unk> count
    SPLIT.docs.bin                 int64 document offsets, only when there are too many
                                   to list in meta.json (lm1b: one per sentence)

``meta.json``'s ``input_key`` hashes what the copy was made from (sources, level, vocabulary
options, format version): ``is_current`` compares it with the key of a new request.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from txlm.data.metrics import metric_value
from txlm.data.vocab import Vocab, check_fingerprint
from txlm.errors import DataError

FORMAT = "txlm-prepared"
FORMAT_VERSION = 1


def default_data_dir() -> Path:
    return Path(os.environ.get("TXLM_DATA_DIR") or "data")


@dataclass
class PreparedCorpus:
    """A prepared dataset on disk; token arrays are read-only memmaps, never loaded whole."""

    path: Path
    vocab: Vocab
    meta: dict
    reused: bool = False  # open_corpus found this copy up to date and built nothing
    _checked: set[str] = field(default_factory=set, repr=False)  # splits whose ids were checked

    @property
    def level(self) -> str:
        return str(self.meta["level"])

    @property
    def metric(self) -> str:
        return str(self.meta["metric"])

    def tokens_per_byte(self, name: str) -> float | None:
        """Tokens per UTF-8 byte of a split's text (what turns a loss into bits per byte)."""
        info = self._split_meta(name)
        size = info.get("text_bytes")
        return int(info["tokens"]) / int(size) if size else None

    def metric_value(self, loss: float, split: str) -> float:
        """``loss`` (nats per token on ``split``) in this corpus's metric (bpc, bpb or ppl)."""
        tpb = self.tokens_per_byte(split) if self.metric == "bpb" else None
        return metric_value(loss, self.metric, tokens_per_byte=tpb)

    def unk_tokens(self, name: str) -> int | None:
        """How many tokens of a split are ``<unk>`` (None: the vocabulary has none)."""
        return self._split_meta(name).get("unk_tokens")

    def _split_meta(self, name: str) -> dict:
        splits = self.meta["splits"]
        if name not in splits:
            raise DataError(f"{self.path} has no split {name!r} (it has {', '.join(splits)})")
        return splits[name]

    def split(self, name: str) -> np.ndarray:
        info = self._split_meta(name)
        file = self.path / info["file"]
        dtype = np.dtype(self.meta["dtype"])
        expected = int(info["tokens"]) * dtype.itemsize
        if not file.is_file() or file.stat().st_size != expected:
            raise DataError(f"{file} is missing or truncated; run txlm prepare --force")
        tokens = np.memmap(file, dtype=dtype, mode="r", shape=(int(info["tokens"]),))
        # A same-size foreign file passes the size check; an id past the vocabulary would
        # reach the embedding as an IndexError. One pass over the split, once per split.
        if name not in self._checked:
            top = int(tokens.max()) if len(tokens) else -1
            if top >= len(self.vocab):
                raise DataError(
                    f"{file} (split {name!r}) holds token id {top}, past the vocabulary's "
                    f"{len(self.vocab)} symbols: not this dataset's data; run txlm prepare --force"
                )
            self._checked.add(name)
        return tokens

    def doc_starts(self, name: str) -> np.ndarray:
        info = self._split_meta(name)
        if "doc_starts" in info:
            out = np.asarray(info["doc_starts"], dtype=np.int64)
        else:
            file = self.path / info["doc_starts_file"]
            if not file.is_file():
                raise DataError(f"{file} is missing; run txlm prepare --force")
            out = np.fromfile(file, dtype="<i8")
        out.flags.writeable = False
        return out


def load_prepared(path: str | Path) -> PreparedCorpus:
    p = Path(path)
    meta_file = p / "meta.json"
    if not meta_file.is_file():
        raise DataError(f"{p} is not a prepared dataset (no meta.json); run txlm prepare first")
    try:
        meta = json.loads(read_json_text(meta_file))
    except json.JSONDecodeError:
        raise DataError(f"{meta_file} is not valid JSON; run txlm prepare --force") from None
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DataError(f"{p} was prepared by another format version; run txlm prepare --force")
    vocab = Vocab.load(p / "vocab.json")
    check_fingerprint(
        vocab,
        meta.get("vocab_fingerprint"),
        what=str(p / "vocab.json"),
        against="the prepared data",
        optional=False,
    )
    if len(vocab) != meta.get("vocab_size"):
        raise DataError(
            f"{p / 'vocab.json'} does not match the prepared data: {len(vocab)} symbols, "
            f"meta.json says {meta.get('vocab_size')}"
        )
    if vocab.dtype != np.dtype(meta.get("dtype")):
        raise DataError(f"{p}: token dtype {meta.get('dtype')} does not fit the vocabulary")
    return PreparedCorpus(p, vocab, meta)


def read_json_text(path: Path) -> str:
    """A prepared dataset's JSON file as text; a binary file there is refused, not rebuilt over.

    txlm writes meta.json and vocab.json atomically, so a file that is not UTF-8 was put there
    by something else (e.g. a pickle): say so in one line rather than delete it.
    """
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(
            f"{path} is not UTF-8 text, so not written by txlm prepare; remove it or run "
            "txlm prepare --force"
        ) from None


def is_current(out: Path, key: str) -> bool:
    """Whether ``out`` is a whole copy made from the inputs that ``key`` hashes."""
    try:
        meta = json.loads(read_json_text(out / "meta.json"))
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(meta, dict) or meta.get("input_key") != key:
        return False
    try:  # an edited or foreign (JSON) vocab.json makes the copy stale: rebuild it
        read_json_text(out / "vocab.json")  # a binary file there is refused, not rebuilt over
    except OSError:
        return False
    try:
        if Vocab.load(out / "vocab.json").fingerprint != meta.get("vocab_fingerprint"):
            return False
    except DataError:
        return False
    dtype = np.dtype(meta["dtype"])
    for info in meta["splits"].values():
        f = out / info["file"]
        if not f.is_file() or f.stat().st_size != info["tokens"] * dtype.itemsize:
            return False
    return True
