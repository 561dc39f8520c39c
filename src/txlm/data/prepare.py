"""``prepare``: turn a dataset into flat token-id files, and load them back.

Layout of a prepared dataset ``DATA_DIR/NAME/``::

    train.bin valid.bin test.bin   token ids, raw little-endian, the smallest unsigned dtype
    vocab.json                     the vocabulary (see vocab.py)
    tokenizer.json                 bpe level only: the learnt BPE (see bpe.py)
    meta.json                      sources and their sha256, sizes, document offsets,
                                   tokenizer and split settings, the metric (bpc, bpb or
                                   ppl), each split's UTF-8 size and <unk> count
    SPLIT.docs.bin                 int64 document offsets, only when there are too many
                                   to list in meta.json (lm1b: one per sentence)

``NAME`` is the dataset name, with ``-LEVEL`` appended when a non-default level is asked for
(``shakespeare-word``), and ``text-STEM`` for ``text:PATH``. Downloads are kept in
``DATA_DIR/downloads/``.

A dataset is built in a temporary folder next to its final place and renamed into place only
when complete, so an error or an interrupt never damages an earlier prepared copy. A second
call whose inputs (source hashes, level, vocabulary options, format version) are unchanged
returns the existing copy without work; ``force=True`` rebuilds. Vocabulary options left
unset (``vocab_size``, ``min_freq``, ``max_vocab`` = None) mean "as the existing copy was
prepared", else the defaults: so ``txlm train`` and ``txlm eval``, which name only the dataset
and level, find the copy that ``txlm prepare --vocab-size 16000`` made instead of rebuilding it.
A build holds a lock on its temporary folder (``DATA_DIR/.NAME.tmp-XXXX/.lock``) while it
runs; the next prepare of the same dataset removes such folders whose lock is free, i.e.
those of a killed build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from txlm.data import bpe, corpora
from txlm.data.corpora import SPECS, SPLITS, RawCorpus
from txlm.data.download import fetch, load_record, mirror_url, sha256_file, sha256_overrides
from txlm.data.metrics import metric_for_level, metric_value
from txlm.data.vocab import Vocab, write_text_atomic
from txlm.errors import DataError

FORMAT = "txlm-prepared"
FORMAT_VERSION = 1
INLINE_DOC_STARTS = 1 << 16  # more document offsets than this go to SPLIT.docs.bin


def default_data_dir() -> Path:
    return Path(os.environ.get("TXLM_DATA_DIR") or "data")


# --- loading -----------------------------------------------------------------------------


@dataclass
class PreparedCorpus:
    """A prepared dataset on disk; token arrays are read-only memmaps, never loaded whole."""

    path: Path
    vocab: Vocab
    meta: dict
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
        meta = json.loads(_read_text(meta_file))
    except json.JSONDecodeError:
        raise DataError(f"{meta_file} is not valid JSON; run txlm prepare --force") from None
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DataError(f"{p} was prepared by another format version; run txlm prepare --force")
    vocab = Vocab.load(p / "vocab.json")
    if vocab.fingerprint != meta.get("vocab_fingerprint") or len(vocab) != meta.get("vocab_size"):
        raise DataError(
            f"{p / 'vocab.json'} does not match the prepared data (vocabulary fingerprint "
            f"{vocab.fingerprint}, size {len(vocab)}; meta.json says "
            f"{meta.get('vocab_fingerprint')}, size {meta.get('vocab_size')})"
        )
    if vocab.dtype != np.dtype(meta.get("dtype")):
        raise DataError(f"{p}: token dtype {meta.get('dtype')} does not fit the vocabulary")
    return PreparedCorpus(p, vocab, meta)


# --- preparing ---------------------------------------------------------------------------


def _parse_name(name: str) -> tuple[str, Path | None]:
    if name.startswith("text:"):
        raw = name[len("text:") :]
        if not raw:
            raise DataError("text: needs a path, as in text:notes.txt or text:my_folder")
        return "text", Path(raw).expanduser()
    if name not in SPECS or name == "text":
        known = ", ".join(n for n in SPECS if n != "text")
        raise DataError(
            f"unknown dataset {name!r}; choose one of {known}, text:PATH or recall[:k=v,...]"
        )
    return name, None


def _out_name(kind: str, level: str, user_path: Path | None) -> str:
    base = kind
    if user_path is not None:
        stem = user_path.resolve().name
        stem = re.sub(r"\.txt$", "", stem)
        base = "text-" + (re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) or "corpus")
    return base if level == SPECS[kind].default_level else f"{base}-{level}"


def _hash_files(files: list[Path]) -> list[dict]:
    out = []
    for f in files:
        if not f.is_file():
            raise DataError(f"file not found: {f}")
        out.append({"name": f.name, "sha256": sha256_file(f), "bytes": f.stat().st_size})
    return out


def _input_key(kind: str, level: str, options: dict, sources: list[dict]) -> str:
    payload = json.dumps(
        {
            "format": FORMAT_VERSION,
            "dataset": kind,
            "level": level,
            "options": options,
            "sources": [(s["name"], s["sha256"]) for s in sources],
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def _read_text(path: Path) -> str:
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


def _is_current(out: Path, key: str) -> bool:
    try:
        meta = json.loads(_read_text(out / "meta.json"))
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(meta, dict) or meta.get("input_key") != key:
        return False
    try:  # an edited or foreign (JSON) vocab.json makes the copy stale: rebuild it
        _read_text(out / "vocab.json")  # a binary file there is refused, not rebuilt over
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


def prepare_dataset(
    name: str,
    data_dir: str | Path,
    *,
    level: str | None = None,
    force: bool = False,
    mirror: str | None = None,
    progress: bool = True,
    min_freq: int | None = None,
    max_vocab: int | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Prepare ``name`` under ``data_dir`` (reusing an up-to-date copy) and return its folder.

    ``mirror`` (default: ``$TXLM_MIRROR``) replaces the base URL of every download.
    Vocabulary options (None: as the existing copy, else the default): ``min_freq`` and
    ``max_vocab`` bound word vocabularies built from train (not lm1b's own; rarer words
    become ``<unk>``; ``max_vocab=0``: no cap), ``vocab_size`` is the bpe level's target size.
    """
    from txlm.data import recall

    if recall.is_recall(name):  # generated, not read: its own writer (same layout)
        if level not in (None, "char"):
            raise DataError(f"recall is a character-level task, not {level!r}")
        return recall.prepare_recall(name, data_dir, force=force)
    kind, user_path = _parse_name(name)
    spec = SPECS[kind]
    level = level or spec.default_level
    if level not in spec.levels:
        raise DataError(f"{kind} is available at level {' or '.join(spec.levels)}, not {level!r}")
    mirror = mirror or os.environ.get("TXLM_MIRROR") or None
    data_dir = Path(data_dir)
    out = data_dir / _out_name(kind, level, user_path)
    options = _vocab_options(
        out, level, {"min_freq": min_freq, "max_vocab": max_vocab, "vocab_size": vocab_size}
    )
    min_freq, max_vocab = options.get("min_freq", 1), options.get("max_vocab")
    vocab_size = options.get("vocab_size", bpe.DEFAULT_VOCAB_SIZE)

    # 1. The inputs and their hashes: cheap for local text, recorded for downloads.
    local_files: list[Path] = []
    if kind == "shakespeare":
        local_files = [f for s in SPLITS for f in corpora.shakespeare_files()[s]]
    elif kind == "text":
        assert user_path is not None
        if not user_path.exists():
            raise DataError(f"no such file or folder: {user_path}")
        local_files = (
            sorted(p for p in user_path.rglob("*.txt") if p.is_file())
            if user_path.is_dir()
            else [user_path]
        )
        if not local_files:
            raise DataError(f"folder {user_path} has no .txt files")
    downloads = data_dir / "downloads"
    if local_files:
        sources = _hash_files(local_files)
    else:
        record, overrides = load_record(downloads), sha256_overrides()
        sources = []
        for rf in spec.remote:
            sha = overrides.get(rf.name) or rf.sha256 or record.get(rf.name, {}).get("sha256")
            sources.append({"name": rf.name, "url": rf.url, "sha256": sha})
    if all(s["sha256"] for s in sources) and not force:
        key = _input_key(kind, level, options, sources)
        if _is_current(out, key):
            return out

    # 2. Fetch what is remote (verified), then build in a temporary folder.
    paths: dict[str, Path] = {}
    for rf, src in zip(spec.remote, sources if spec.remote else [], strict=True):
        url = mirror_url(rf.url, mirror)
        paths[rf.name], src["sha256"] = fetch(
            url, downloads, known_sha256=rf.sha256, progress=progress
        )
        src["url"] = url
        src["bytes"] = paths[rf.name].stat().st_size
    key = _input_key(kind, level, options, sources)
    if not force and _is_current(out, key):
        return out

    # Local text needs no scratch folder: read and check it (binary, empty, ...) before
    # creating anything, so a refused first prepare leaves no DATA_DIR behind.
    raw: RawCorpus | None = None
    if kind in ("text", "shakespeare"):
        raw = _read(kind, user_path, paths, data_dir)
        vocab = _build_vocab(
            raw, level, min_freq=min_freq, max_vocab=max_vocab, vocab_size=vocab_size
        )
    with building(data_dir, out) as tmp:
        work = tmp / "raw"
        work.mkdir()
        if raw is None:
            raw = _read(kind, user_path, paths, work)
            vocab = _build_vocab(
                raw, level, min_freq=min_freq, max_vocab=max_vocab, vocab_size=vocab_size
            )
        vocab, splits_meta, train_counts = _encode_splits(raw, vocab, tmp, progress=progress)
        vocab.save(tmp / "vocab.json")
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dataset": kind,
            "name": out.name,
            "level": level,
            "metric": metric_for_level(level),
            "dtype": vocab.dtype.name,
            "vocab_size": len(vocab),
            "vocab_fingerprint": vocab.fingerprint,
            "input_key": key,
            "options": options,
            "sources": sources,
            "source_bytes": sum(int(s["bytes"]) for s in sources),
            "tokenizer": _tokenizer_settings(level, vocab, options),
            "corpus": raw.settings,
            "splits": splits_meta,
        }
        if level in ("bpe", "word"):
            meta["adaptive_softmax"] = {
                "ids": "sorted by train count (specials first)",
                "suggested_cutoffs": bpe.suggest_cutoffs(train_counts),
                "covering": "80% and 95% of the train tokens",
            }
        write_text_atomic(tmp / "meta.json", json.dumps(meta, indent=1))
        shutil.rmtree(work)
    return out


@contextlib.contextmanager
def building(data_dir: Path, out: Path) -> Iterator[Path]:
    """A locked temporary folder beside ``out`` to build a dataset in. When the block ends
    cleanly it replaces ``out`` in one rename; when it raises, it is removed and ``out`` stays
    as it was (a dead process's folder is removed by the next build: see TEMP_LOCK)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_folders(data_dir, out.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=data_dir))
    os.chmod(tmp, 0o755)  # mkdtemp creates 0700
    lock: int | None = None
    try:
        lock = _hold(tmp)
        yield tmp
        (tmp / TEMP_LOCK).unlink()  # not part of the dataset; the fd keeps the lock until done
        _swap_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if lock is not None:
            os.close(lock)


# A build in progress holds an flock on TMP/.lock; the kernel drops it when the process dies,
# however it dies (SIGKILL, power loss). So a temp folder of this dataset whose lock can be
# taken, or that has no lock file, belongs to a dead prepare: the next prepare removes it.
TEMP_LOCK = ".lock"


def _hold(tmp: Path) -> int:
    fd = os.open(tmp / TEMP_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    # Without flock (some network file systems) the folder simply looks in use to others.
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _remove_stale_temp_folders(data_dir: Path, name: str) -> None:
    """Remove DATA_DIR/.NAME.tmp-* left by a prepare of the same dataset that was killed."""
    for folder in data_dir.glob(f".{name}.tmp-*"):
        if not folder.is_dir():
            continue
        try:
            fd = os.open(folder / TEMP_LOCK, os.O_RDWR)
        # No lock file: killed before it made one. (A live build in the microseconds between
        # mkdtemp and its lock would lose its folder and fail with an error; nothing in place
        # is touched.)
        except FileNotFoundError:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live prepare holds it (or flock is unsupported): leave it alone
        else:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Two renames; the old copy is deleted only once the new one is in place."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def _read(kind: str, user_path: Path | None, paths: dict[str, Path], work: Path) -> RawCorpus:
    if kind == "shakespeare":
        return corpora.read_shakespeare()
    if kind == "text":
        assert user_path is not None
        return corpora.read_user_text(user_path)[0]
    if kind in ("wt2", "wt103"):
        top = "wikitext-2" if kind == "wt2" else "wikitext-103"
        return corpora.read_wikitext(paths[f"{top}-v1.zip"], work, top)
    if kind == "ptb":
        return corpora.read_ptb(paths["simple-examples.tgz"], work)
    if kind == "enwik8":
        return corpora.read_enwik8(paths["enwik8.zip"], work)
    if kind == "text8":
        return corpora.read_text8(paths["text8.zip"], work)
    if kind == "lm1b":
        archive, vocab_file = (paths[rf.name] for rf in SPECS["lm1b"].remote)
        return corpora.read_lm1b(archive, vocab_file, work)
    raise DataError(f"no reader for {kind}")  # pragma: no cover - SPECS and _read agree


_OPTIONS_OF_LEVEL = {"word": ("min_freq", "max_vocab"), "bpe": ("vocab_size",)}
_FLAG = {"min_freq": "--min-freq", "max_vocab": "--max-vocab", "vocab_size": "--vocab-size"}


def _vocab_options(out: Path, level: str, given: dict) -> dict:
    """The level's vocabulary options: those given, else the existing copy's, else defaults."""
    wanted = _OPTIONS_OF_LEVEL.get(level, ())
    for key, value in given.items():
        if value is not None and key not in wanted:
            levels = [lv for lv, keys in _OPTIONS_OF_LEVEL.items() if key in keys]
            raise DataError(f"{_FLAG[key]} is for --level {levels[0]}, not {level}")
    if given.get("min_freq") is not None and given["min_freq"] < 1:
        raise DataError(f"--min-freq (min_freq) must be >= 1, got {given['min_freq']}")
    if given.get("max_vocab") is not None and given["max_vocab"] != 0 and given["max_vocab"] < 3:
        raise DataError(
            f"--max-vocab (max_vocab) must be >= 3 (<unk>, <eos> and a word) or 0 (no cap), "
            f"got {given['max_vocab']}"
        )
    if given.get("vocab_size") is not None:
        bpe.check_vocab_size(given["vocab_size"])
    previous: dict = {}
    try:
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
        if isinstance(meta, dict) and meta.get("level") == level:
            previous = meta.get("options") or {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass
    defaults = {"min_freq": 1, "max_vocab": None, "vocab_size": bpe.DEFAULT_VOCAB_SIZE}
    options = {}
    for key in wanted:
        value = given.get(key)
        if value is None:
            value = previous.get(key, defaults[key])
        options[key] = None if key == "max_vocab" and value == 0 else value  # 0: no cap
    return options


def _build_vocab(
    raw: RawCorpus, level: str, *, min_freq: int, max_vocab: int | None, vocab_size: int
) -> Vocab:
    if level == "byte":
        return Vocab.byte_level()
    if raw.vocab_file is not None:
        return read_lm1b_vocab(raw.vocab_file)
    train = raw.splits["train"]
    if level == "bpe":
        texts = [t if isinstance(t, str) else t.decode("utf-8") for t, _ in train.pieces()]
        return bpe.train_bpe(texts, vocab_size, renumber=False)  # see _encode_splits
    if level == "char":
        counts: Counter[str] = Counter()
        for text, _ in train.pieces():
            assert isinstance(text, str)
            # bincount over code points: linear time, and at most 1.1M bins even for emoji
            bins = np.bincount(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32))
            seen = np.flatnonzero(bins)
            counts.update({chr(int(c)): int(bins[c]) for c in seen})
        if not counts:
            raise DataError("the train split is empty")
        # Characters never seen in train (in valid/test, or in a generation prompt) map to
        # <unk>. text8 has a fixed 27-letter alphabet and no <unk>: the paper's softmax.
        return Vocab.build_char(counts, unk=raw.char_unk)
    words: Counter[str] = Counter()
    for text, _ in train.pieces():
        assert isinstance(text, str)
        words.update(text.split())
    if not words:
        raise DataError("the train split has no words")
    return Vocab.build_word(words, min_freq=min_freq, max_size=max_vocab)


def read_lm1b_vocab(path: Path) -> Vocab:
    """``1b_word_vocab.txt``: one ``word [count]`` per line, in id order."""
    text = corpora.read_text(path)
    symbols = [line.split()[0] for line in text.splitlines() if line.strip()]
    if len(set(symbols)) != len(symbols):
        raise DataError(f"{path} lists a word twice; not the lm1b vocabulary file")
    for needed in ("<S>", "</S>", "<UNK>"):
        if needed not in symbols:
            raise DataError(f"{path} lacks {needed}; not the lm1b vocabulary file")
    return Vocab(symbols, "word", unk="<UNK>", eos="</S>", bos="<S>")


def _tokenizer_settings(level: str, vocab: Vocab, options: dict) -> dict:
    settings: dict = {"level": level, "newlines": "\\r\\n read as \\n; a leading BOM dropped"}
    if level == "char":
        settings["unknown"] = (
            "characters not in train map to <unk>"
            if vocab.unk
            else "no <unk>: a fixed alphabet, every character occurs in train"
        )
    if level == "bpe":
        settings.update(
            kind="byte-level BPE (Hugging Face tokenizers), trained on the train split",
            file=bpe.TOKENIZER_FILE,
            eos=f"{vocab.eos} opens every document",
            unknown="none: every byte sequence is spelt",
            **options,
        )
    if level == "word":
        settings.update(
            split="whitespace",
            eos=f"{vocab.eos} ends every line" if vocab.eos else None,
            bos=f"{vocab.bos} opens every line" if vocab.bos else None,
            unk=vocab.unk,
            **options,
        )
    return settings


def _encode_splits(
    raw: RawCorpus, vocab: Vocab, folder: Path, *, progress: bool
) -> tuple[Vocab, dict, np.ndarray]:
    """Every split written; the final vocabulary, the splits' meta.json and train's counts.

    A bpe vocabulary arrives numbered in merge order: train is encoded with it, then its ids
    are renumbered by the counts of that pass (bpe.renumber_by_count) and train.bin is
    rewritten through the map, before valid and test are encoded with the final numbering.
    """
    splits: dict = {}
    splits["train"], counts = _encode_split(raw, "train", vocab, folder, progress=progress)
    if isinstance(vocab, bpe.BPEVocab):
        vocab, lut = bpe.renumber_by_count(vocab, counts)
        file = folder / splits["train"]["file"]
        ids = np.fromfile(file, dtype=np.dtype(vocab.dtype).newbyteorder("<"))
        lut.astype(ids.dtype)[ids].tofile(file)
        counts = counts[np.argsort(lut)]  # counts[new id]
    for split in SPLITS[1:]:
        splits[split] = _encode_split(raw, split, vocab, folder, progress=progress)[0]
    return vocab, splits, counts


def _encode_split(
    raw: RawCorpus, split: str, vocab: Vocab, folder: Path, *, progress: bool = False
) -> tuple[dict, np.ndarray]:
    """Write SPLIT.bin; returns its meta.json entry and the split's token counts."""
    source = raw.splits[split]
    # numpy chunks, not one list of ints: lm1b has 30M sentence starts (1 GB as Python ints)
    starts: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
    n = 0
    text_bytes = 0
    counts = np.zeros(len(vocab), dtype=np.int64)
    doc_start = vocab.doc_start_id
    file = folder / f"{split}.bin"
    bar = tqdm(
        desc=f"{folder.name.split('.tmp-')[0].lstrip('.')} {split}",
        unit=" tokens",
        unit_scale=True,
        disable=not progress,
        leave=False,
    )
    with open(file, "wb") as f, bar:
        for text, new_doc in source.pieces():
            text_bytes += len(text) if isinstance(text, bytes) else len(text.encode("utf-8"))
            if vocab.level == "word":
                assert isinstance(text, str)
                ids_list, line_starts = vocab.encode_lines(text)
                ids = np.asarray(ids_list, dtype=vocab.dtype)
                if source.line_docs:
                    starts.append(n + np.asarray(line_starts, dtype=np.int64))
            else:
                ids = vocab.encode_array(text).astype(vocab.dtype)
            if new_doc and doc_start is not None:  # bpe: <eos> opens every document
                ids = np.concatenate([np.array([doc_start], dtype=vocab.dtype), ids])
            if new_doc and not source.line_docs:
                starts.append(np.array([n], dtype=np.int64))
            f.write(ids.astype(ids.dtype.newbyteorder("<")).tobytes())
            counts += np.bincount(ids, minlength=len(vocab))
            n += len(ids)
            bar.update(len(ids))
    if n == 0:
        raise DataError(f"the {split} split is empty after tokenisation")
    doc = np.unique(np.concatenate(starts))
    doc = doc[doc < n]
    info: dict = {"file": file.name, "tokens": n, "bytes": n * vocab.dtype.itemsize}
    info["text_bytes"] = text_bytes  # UTF-8 size of the split's text: bits per byte
    if vocab.unk_id is not None:
        info["unk_tokens"] = int(counts[vocab.unk_id])
    info["documents"] = len(doc)
    if len(doc) <= INLINE_DOC_STARTS:
        info["doc_starts"] = doc.tolist()
    else:
        doc.astype("<i8").tofile(folder / f"{split}.docs.bin")
        info["doc_starts_file"] = f"{split}.docs.bin"
    return info, counts
