"""``prepare``: turn a dataset into flat token-id files (layout: prepared.py), and
``open_corpus``, the one way every command and analysis gets a prepared corpus.

A second call whose inputs (source hashes, level, vocabulary options, format version) are
unchanged returns the existing copy without work; ``force=True`` rebuilds. Vocabulary options
left unset (``vocab_size``, ``min_freq``, ``max_vocab`` = None) mean "as the existing copy was
prepared", else the defaults: so ``txlm train`` and ``txlm eval``, which name only the dataset
and level, find the copy that ``txlm prepare --vocab-size 16000`` made instead of rebuilding it.
A build happens in a temporary folder renamed into place (building.py), so an error or an
interrupt never damages an earlier prepared copy.

The steps: sources.py says what a name's inputs are and reads them, the vocabulary is built
on train here, splits.py writes each split's ids.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from txlm import atomic
from txlm.data import bpe, recall, sources
from txlm.data.building import building
from txlm.data.corpora import SPECS, Piece, RawCorpus, SplitSource
from txlm.data.metrics import metric_for_level
from txlm.data.prepared import (
    FORMAT,
    FORMAT_VERSION,
    PreparedCorpus,
    default_data_dir,
    is_current,
    load_prepared,
)
from txlm.data.splits import encode_splits
from txlm.data.text import normalize_text
from txlm.data.vocab import TOKENIZER_FILE, Vocab, check_fingerprint
from txlm.errors import DataError


def prepared_folder(
    name: str,
    data_dir: str | Path,
    level: str | None = None,
    *,
    vocab: Vocab | None = None,
    lower_case: bool = False,
) -> Path:
    """Where ``prepare_dataset(name, data_dir, level=level, vocab=vocab, ...)`` keeps its copy.

    A copy encoded with a given vocabulary (a checkpoint's) carries its level and fingerprint
    in the name, after a "+" that no name of the corpus's own copies holds: it can never be
    taken for a copy with the corpus's own vocabulary, nor for one with another checkpoint's.
    """
    if recall.is_recall(name):
        return Path(data_dir) / recall.parse_spec(name).folder_name
    kind, user_path = sources.parse_name(name)
    if vocab is None:
        level = level or SPECS[kind].default_level
        return Path(data_dir) / sources.out_name(kind, level, user_path)
    base = sources.out_name(kind, SPECS[kind].default_level, user_path)
    suffix = "-lower" if lower_case else ""
    # "+": never in a name of the corpus's own copies (text: stems keep [A-Za-z0-9_.-])
    return Path(data_dir) / f"{base}+{vocab.level}-vocab-{vocab.fingerprint}{suffix}"


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
    vocab: Vocab | None = None,
    lower_case: bool = False,
    replace: bool = True,
) -> Path:
    """Prepare ``name`` under ``data_dir`` (reusing an up-to-date copy) and return its folder.

    ``mirror`` (default: ``$TXLM_MIRROR``) replaces the base URL of every download.
    Vocabulary options (None: as the existing copy, else the default): ``min_freq`` and
    ``max_vocab`` bound word vocabularies built from train (not lm1b's own; rarer words
    become ``<unk>``; ``max_vocab=0``: no cap), ``vocab_size`` is the bpe level's target size.

    ``vocab``: encode with this vocabulary (a checkpoint's, to fine-tune it) instead of one
    built from train; its level is the level, no vocabulary option applies, ids are kept as
    they are, and a train split with no symbol the vocabulary knows is refused.
    ``lower_case``: lower-case the text first (a converted tokenizer that did so).
    ``replace=False``: a copy that is there but not up to date (its sources changed, or it
    is damaged) is refused in one line naming ``txlm prepare ... --force``, never rebuilt:
    models trained on it may depend on it as it is. Only ``txlm prepare`` replaces a copy.
    """
    if recall.is_recall(name):  # generated, not read: its own writer (same layout)
        if vocab is not None:
            raise DataError("recall builds its own alphabet: it cannot take a checkpoint's")
        if level not in (None, "char"):
            raise DataError(f"recall is a character-level task, not {level!r}")
        return recall.prepare_recall(name, data_dir, force=force)
    kind, user_path = sources.parse_name(name)
    mirror = mirror or os.environ.get("TXLM_MIRROR") or None
    data_dir = Path(data_dir)
    given = {"min_freq": min_freq, "max_vocab": max_vocab, "vocab_size": vocab_size}
    if vocab is None:
        spec = SPECS[kind]
        level = level or spec.default_level
        if level not in spec.levels:
            raise DataError(
                f"{kind} is available at level {' or '.join(spec.levels)}, not {level!r}"
            )
        out = data_dir / sources.out_name(kind, level, user_path)
        options = _vocab_options(out, level, given)
    else:
        level = _given_vocab_level(vocab, level, given)
        out = prepared_folder(name, data_dir, vocab=vocab, lower_case=lower_case)
        options = {"vocab": vocab.fingerprint, "lower_case": lower_case}
    min_freq, max_vocab = options.get("min_freq", 1), options.get("max_vocab")
    vocab_size = options.get("vocab_size", bpe.DEFAULT_VOCAB_SIZE)

    # 1. The inputs and their hashes: cheap for local text, recorded for downloads.
    downloads = data_dir / "downloads"
    inputs = sources.list_sources(kind, user_path, downloads)
    if all(s["sha256"] for s in inputs) and not force:
        key = sources.input_key(kind, level, options, inputs)
        if is_current(out, key):
            return out

    # 2. Fetch what is remote (verified), then build in a temporary folder.
    paths = sources.fetch_sources(kind, inputs, downloads, mirror=mirror, progress=progress)
    key = sources.input_key(kind, level, options, inputs)
    if not force and is_current(out, key):
        return out
    if not replace and atomic.resolve(out).exists():
        raise DataError(_stale(name, out, key, level, data_dir, given=vocab is not None))

    def vocabulary(raw: RawCorpus) -> Vocab:
        if vocab is not None:
            return vocab
        return _build_vocab(
            raw, level, min_freq=min_freq, max_vocab=max_vocab, vocab_size=vocab_size
        )

    # Local text needs no scratch folder: read and check it (binary, empty, ...) before
    # creating anything, so a refused first prepare leaves no DATA_DIR behind.
    raw: RawCorpus | None = None
    if kind in ("text", "shakespeare"):
        raw = sources.read(kind, user_path, paths, data_dir)
        used = vocabulary(raw)
    with building(data_dir, out) as tmp:
        work = tmp / "raw"
        work.mkdir()
        if raw is None:
            raw = sources.read(kind, user_path, paths, work)
            used = vocabulary(raw)
        if lower_case:
            raw = _lower_cased(raw)
        # a given vocabulary keeps its ids: they are what its model reads
        used, splits_meta, train_counts = encode_splits(
            raw, used, tmp, progress=progress, renumber=vocab is None
        )
        if vocab is not None:
            _refuse_all_unknown(vocab, train_counts, name)
        used.save(tmp / "vocab.json")
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dataset": kind,
            "name": out.name,
            "level": level,
            "metric": metric_for_level(level),
            "dtype": used.dtype.name,
            "vocab_size": len(used),
            "vocab_fingerprint": used.fingerprint,
            "input_key": key,
            "options": options,
            "sources": inputs,
            "source_bytes": sum(int(s["bytes"]) for s in inputs),
            "tokenizer": _tokenizer_settings(level, used, options),
            "corpus": raw.settings,
            "splits": splits_meta,
        }
        if level in ("bpe", "word") and vocab is None:
            meta["adaptive_softmax"] = {
                "ids": "sorted by train count (specials first)",
                "suggested_cutoffs": bpe.suggest_cutoffs(train_counts),
                "covering": "80% and 95% of the train tokens",
            }
        atomic.write_text(tmp / "meta.json", json.dumps(meta, indent=1))
        shutil.rmtree(work)
    return out


def _stale(name: str, out: Path, key: str, level: str, data_dir: Path, *, given: bool) -> str:
    """Why the copy at ``out`` is not the one asked for, and the command that remakes it."""
    try:
        meta = json.loads((atomic.resolve(out) / "meta.json").read_text(encoding="utf-8"))
        recorded = meta.get("input_key") if isinstance(meta, dict) else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        recorded = None
    if recorded is not None and recorded != key:
        why = f"{name} changed since it was prepared in {out} (other files or contents)"
    else:
        why = f"{out} is damaged or incomplete"
    if given:  # a copy in a checkpoint's vocabulary: made by train --init, not by prepare
        return (
            f"{why}; it is left as it is: restore the source, or remove {out} and run "
            "txlm train --init again to encode the corpus anew"
        )
    where = "" if data_dir == default_data_dir() else f" --data-dir {data_dir}"
    return (
        f"{why}; it is left as it is: restore the source, or run txlm prepare {name} "
        f"--level {level}{where} --force (a model trained on the old copy will not match it)"
    )


def _given_vocab_level(vocab: Vocab, level: str | None, options: dict) -> str:
    """The level of a corpus encoded with ``vocab``: the vocabulary's own; another level
    asked for, or a vocabulary option (which would build one), is refused by name."""
    if level is not None and level != vocab.level:
        raise DataError(
            f"data.level={level} contradicts the checkpoint's {vocab.level} vocabulary "
            "(the corpus is encoded with it): drop data.level"
        )
    for key, value in options.items():
        if value is not None:
            raise DataError(
                f"{_FLAG[key]} ({key}) builds a vocabulary; the checkpoint's is used as it is"
            )
    return vocab.level


def _lower_cased(raw: RawCorpus) -> RawCorpus:
    options = {"lower_case": True}

    def lowered(source: SplitSource) -> SplitSource:
        def pieces() -> Iterator[Piece]:
            for text, new_doc in source.pieces():
                yield (normalize_text(text, options) if isinstance(text, str) else text), new_doc

        return SplitSource(pieces, line_docs=source.line_docs)

    splits = {name: lowered(source) for name, source in raw.splits.items()}
    return dataclasses.replace(raw, splits=splits)


def _refuse_all_unknown(vocab: Vocab, train_counts: np.ndarray, name: str) -> None:
    """A corpus of which the vocabulary knows nothing but spaces, line ends and its special
    symbols would train the model on ``<unk>``."""
    if vocab.unk_id is None:
        return
    specials = {i for i in (vocab.unk_id, vocab.eos_id, vocab.bos_id) if i is not None}
    blank = {i for i, sym in enumerate(vocab.symbols) if not sym.strip()}
    seen = np.flatnonzero(train_counts)
    if all(int(i) in specials or int(i) in blank for i in seen):
        raise DataError(
            f"every symbol of {name}'s train split becomes {vocab.unk} with the checkpoint's "
            f"{vocab.level} vocabulary: nothing to learn from"
        )


def open_corpus(
    dataset: str,
    data_dir: str | Path | None = None,
    *,
    level: str | None = None,
    fingerprint: str | None = None,
    owner: str = "the checkpoint",
    log: Callable[[str], None] | None = None,
    progress: bool = False,
    force: bool = False,
    mirror: str | None = None,
    min_freq: int | None = None,
    max_vocab: int | None = None,
    vocab_size: int | None = None,
    vocab: Vocab | None = None,
    lower_case: bool = False,
    replace: bool = False,
) -> PreparedCorpus:
    """The prepared corpus ``dataset``, prepared under ``data_dir`` (default: ``$TXLM_DATA_DIR``
    or ./data) if there is no up-to-date copy, or read as it is when ``dataset`` is a prepared
    folder. ``progress`` to ``vocab_size``: as ``prepare_dataset``.

    ``fingerprint``: the vocabulary a model was trained with (``owner`` names the model in
    messages). The corpus must have it: a copy made with another vocabulary is refused before
    anything is rebuilt, and one prepared anew here (none was there: the model's corpus was
    prepared under another data directory) is kept only when it came out with that vocabulary,
    i.e. it is the same preparation; else it is removed again and the error names
    ``--data-dir``. ``log`` hears where a copy was prepared (``corpus.reused``: none was).
    ``vocab`` and ``lower_case``: as ``prepare_dataset`` (the corpus encoded with a given
    vocabulary; a prepared folder passed as ``dataset`` must have it).
    ``replace``: rebuild a copy that is there but not up to date (``txlm prepare`` only);
    without it such a copy is refused and left byte for byte as it is.
    """
    if vocab is not None:
        fingerprint = vocab.fingerprint
    if (Path(dataset) / "meta.json").is_file():
        corpus = load_prepared(dataset)
        check_fingerprint(corpus.vocab, fingerprint, what=str(corpus.path), against=owner)
        corpus.reused = True
        return corpus
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    folder = prepared_folder(dataset, data_dir, level, vocab=vocab, lower_case=lower_case)
    before = _identity(folder)
    if fingerprint is not None and before is not None:
        found = _recorded_fingerprint(folder)
        if found is not None and found != fingerprint:
            raise DataError(
                f"{folder} holds another preparation of {dataset} (vocabulary fingerprint "
                f"{found}) than {owner}'s ({fingerprint}): point --data-dir at the data folder "
                f"its corpus was prepared under"
            )
    path = prepare_dataset(
        dataset,
        data_dir,
        level=level,
        force=force,
        mirror=mirror,
        progress=progress,
        min_freq=min_freq,
        max_vocab=max_vocab,
        vocab_size=vocab_size,
        vocab=vocab,
        lower_case=lower_case,
        replace=replace,
    )
    corpus = load_prepared(path)
    corpus.reused = before is not None and _identity(path) == before
    if fingerprint is not None and corpus.vocab.fingerprint != fingerprint:
        if before is None:  # this call made it, and it is not the model's corpus: undo that
            shutil.rmtree(path, ignore_errors=True)
        raise DataError(
            f"no prepared copy of {dataset} with {owner}'s vocabulary ({fingerprint}) in "
            f"{data_dir}; prepared there anew it has another ({corpus.vocab.fingerprint}), "
            f"so its corpus was prepared elsewhere or otherwise: point --data-dir at the data "
            f"folder it was prepared under"
        )
    if log is not None and not corpus.reused:
        if fingerprint is not None:
            log(
                f"{dataset}: no up-to-date copy in {data_dir}; prepared it in {path}, with "
                f"{owner}'s vocabulary (fingerprint {fingerprint})"
            )
        else:
            log(f"{dataset}: prepared in {path}")
    return corpus


def _identity(folder: Path) -> tuple[int, int] | None:
    """Which copy is at ``folder`` (a rebuild renames a new folder into place), if any."""
    if not (folder / "meta.json").is_file():
        return None
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _recorded_fingerprint(folder: Path) -> str | None:
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # damaged: prepare_dataset rebuilds it or says what is wrong
    return meta.get("vocab_fingerprint") if isinstance(meta, dict) else None


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
        return sources.read_lm1b_vocab(raw.vocab_file)
    train = raw.splits["train"]
    if level == "bpe":
        texts = [t if isinstance(t, str) else t.decode("utf-8") for t, _ in train.pieces()]
        return bpe.train_bpe(texts, vocab_size, renumber=False)  # see splits.encode_splits
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
            file=TOKENIZER_FILE,
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
