"""What a dataset name means: its folder name, its input files and their hashes, and reading
them into a ``RawCorpus`` (the readers themselves are in corpora.py).

``NAME`` is the dataset name, with ``-LEVEL`` appended when a non-default level is asked for
(``shakespeare-word``), and ``text-STEM`` for ``text:PATH``. Downloads are kept in
``DATA_DIR/downloads/``, checked against a published sha256 or the one recorded at the first
download.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from txlm.data import corpora
from txlm.data.corpora import SPECS, SPLITS, RawCorpus
from txlm.data.download import fetch, load_record, mirror_url, sha256_file, sha256_overrides
from txlm.data.prepared import FORMAT_VERSION
from txlm.data.vocab import Vocab
from txlm.errors import DataError


def parse_name(name: str) -> tuple[str, Path | None]:
    if name.startswith("text:"):
        raw = name[len("text:") :]
        if not raw:
            raise DataError("text: needs a path, as in text:notes.txt or text:my_folder")
        return "text", Path(raw).expanduser()
    if name.startswith("classes:"):
        raise DataError(
            f"{name} is a classification dataset (a folder per label): train a classifier on it "
            "with txlm train --init CKPT --task classify"
        )
    if name not in SPECS or name == "text":
        known = ", ".join(n for n in SPECS if n != "text")
        raise DataError(
            f"unknown dataset {name!r}; choose one of {known}, text:PATH or recall[:k=v,...]"
        )
    return name, None


def out_name(kind: str, level: str, user_path: Path | None) -> str:
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


def list_sources(kind: str, user_path: Path | None, downloads: Path) -> list[dict]:
    """The inputs of dataset ``kind``: name, sha256 and size of each local file (hashed now),
    name, URL and sha256 of each remote one (published, overridden, or recorded at its first
    download; None when not yet known)."""
    spec = SPECS[kind]
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
    if local_files:
        return _hash_files(local_files)
    record, overrides = load_record(downloads), sha256_overrides()
    sources = []
    for rf in spec.remote:
        sha = overrides.get(rf.name) or rf.sha256 or record.get(rf.name, {}).get("sha256")
        sources.append({"name": rf.name, "url": rf.url, "sha256": sha})
    return sources


def fetch_sources(
    kind: str, sources: list[dict], downloads: Path, *, mirror: str | None, progress: bool
) -> dict[str, Path]:
    """Download (or find, verified) every remote input; fills in each entry's sha256, URL and
    size, and returns the local path of each file by name (empty for local datasets)."""
    paths: dict[str, Path] = {}
    remote = SPECS[kind].remote
    for rf, src in zip(remote, sources if remote else [], strict=True):
        url = mirror_url(rf.url, mirror)
        paths[rf.name], src["sha256"] = fetch(
            url, downloads, known_sha256=rf.sha256, progress=progress
        )
        src["url"] = url
        src["bytes"] = paths[rf.name].stat().st_size
    return paths


def input_key(kind: str, level: str, options: dict, sources: list[dict]) -> str:
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


def read(kind: str, user_path: Path | None, paths: dict[str, Path], work: Path) -> RawCorpus:
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
