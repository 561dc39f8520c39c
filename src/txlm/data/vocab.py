"""Vocabularies: the map between text and token ids, stored as JSON (never a pickle).

Four levels (``BPEVocab`` is a ``Vocab`` too, so nothing that uses a vocabulary needs to know
which level it has):

* ``char``: one symbol per Unicode code point. Encoding is vectorised through a lookup table
  over code points, so preparing 100 MB of text takes seconds, not minutes.
* ``byte``: the 256 byte values (enwik8). Every byte sequence round-trips exactly.
* ``word``: whitespace-separated tokens; each line ends with the end-of-line symbol
  (``<eos>``), so ``decode(encode(text)) == text`` whenever the text is already in the
  normalised form "tokens joined by single spaces, every line ending in a newline".
* ``bpe``: a byte-level BPE learnt on train (``bpe.py`` learns it), held as a Hugging Face
  ``tokenizers`` tokenizer. ``tokenizer.json`` is that library's own file (``Tokenizer.from_file``
  reads it, as does transformers' ``PreTrainedTokenizerFast``); ``vocab.json`` beside it holds
  txlm's metadata (level, size, ``<eos>``) and the fingerprint, a hash of the tokenizer's
  canonical JSON. Loading recomputes the hash, so a ``tokenizer.json`` swapped under a
  checkpoint or a prepared corpus is refused rather than silently re-numbering the model.

Symbols unseen when the vocabulary was built map to ``<unk>`` when the vocabulary has one
(word level and the char level used for Shakespeare, whose valid/test works contain a few
characters that never occur in train); without ``<unk>`` an unknown symbol is an error.

The fingerprint is a hash of the level and the ordered symbol list. It is written into
``meta.json`` and into checkpoints, so a model is never paired with a vocabulary whose ids
mean something else.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from txlm import atomic
from txlm.errors import DataError, TxlmError

LEVELS = ("char", "byte", "word", "bpe")
FORMAT = "txlm-vocab"
FORMAT_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
EOS = "<eos>"
PIECE_CHARS = 1 << 16  # text is encoded in pieces of about this many characters, in parallel

# Where text may be cut without changing its tokens: before a newline that follows a word
# character or common punctuation. The byte-level pre-tokenizer (GPT-2's pattern) never joins
# such a character with the whitespace after it, and a whitespace run that starts at a newline
# is split the same way whether or not text precedes it; so encoding the pieces one by one
# gives exactly the tokens of the whole (tested). Cuts elsewhere (e.g. inside a run of
# blank lines) could change how a whitespace run is split.
_SAFE_CUT = re.compile(r"(?<=[\w.,;:!?)\]}'\"])\n")


@dataclass
class Vocab:
    """An ordered symbol list; a symbol's id is its position."""

    symbols: list[str]
    level: str
    unk: str | None = None
    eos: str | None = None
    bos: str | None = None
    _index: dict[str, int] = field(init=False, repr=False)
    _lut: np.ndarray | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise DataError(f"unknown vocabulary level {self.level!r}; expected one of {LEVELS}")
        self._index = {s: i for i, s in enumerate(self.symbols)}
        if len(self._index) != len(self.symbols):
            raise DataError("vocabulary has duplicate symbols")
        for name, sym in (("unk", self.unk), ("eos", self.eos), ("bos", self.bos)):
            if sym is not None and sym not in self._index:
                raise DataError(f"vocabulary {name} symbol {sym!r} is not in its symbol list")
        if self.level == "byte" and len(self.symbols) != 256:
            raise DataError("a byte vocabulary has exactly 256 symbols")
        if self.level == "bpe" and type(self) is Vocab:
            raise DataError("a bpe vocabulary is a BPEVocab (it needs its tokenizer)")

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def byte_level(cls) -> Vocab:
        """The fixed 256-symbol byte vocabulary; symbol i is the decimal string of byte i."""
        return cls([str(i) for i in range(256)], "byte")

    @classmethod
    def build_char(cls, counts: Counter[str] | dict[str, int], *, unk: bool = True) -> Vocab:
        """Characters sorted by code point (stable across runs), ``<unk>`` last if asked.

        ``<unk>`` is a multi-character symbol so it can never collide with a real character.
        """
        symbols = sorted(counts)
        return cls([*symbols, "<unk>"] if unk else symbols, "char", unk="<unk>" if unk else None)

    @classmethod
    def build_word(
        cls,
        counts: Counter[str],
        *,
        min_freq: int = 1,
        max_size: int | None = None,
        specials: Sequence[str] = ("<unk>", "<eos>"),
        unk: str | None = "<unk>",
        eos: str | None = "<eos>",
    ) -> Vocab:
        """Specials first, then words by decreasing count (ties by the word, for stability)."""
        ranked = sorted(
            (w for w, c in counts.items() if c >= min_freq and w not in specials),
            key=lambda w: (-counts[w], w),
        )
        if max_size is not None:
            ranked = ranked[: max(0, max_size - len(specials))]
        return cls([*specials, *ranked], "word", unk=unk, eos=eos)

    # -- properties -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.symbols)

    @property
    def unk_id(self) -> int | None:
        return None if self.unk is None else self._index[self.unk]

    @property
    def eos_id(self) -> int | None:
        return None if self.eos is None else self._index[self.eos]

    @property
    def bos_id(self) -> int | None:
        return None if self.bos is None else self._index[self.bos]

    @property
    def doc_start_id(self) -> int | None:
        """The symbol prepare puts before every document, if any (bpe: ``<eos>``)."""
        return None

    def count_unknown(self, text: str) -> int:
        """How many symbols of ``text`` the vocabulary lacks (they encode to ``<unk>``)."""
        if self.level == "word":
            return sum(1 for w in text.split() if w not in self._index)
        if self.level == "char":
            return sum(text.count(ch) for ch in set(text) if ch not in self._index)
        return 0  # bytes: every value is a symbol

    @property
    def fingerprint(self) -> str:
        payload = json.dumps({"level": self.level, "symbols": self.symbols}, ensure_ascii=True)
        return hashlib.sha256(payload.encode("ascii")).hexdigest()[:16]

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned integer type that holds every id."""
        n = len(self.symbols)
        if n <= 1 << 8:
            return np.dtype(np.uint8)
        if n <= 1 << 16:
            return np.dtype(np.uint16)
        return np.dtype(np.uint32)

    def id_of(self, symbol: str) -> int:
        try:
            return self._index[symbol]
        except KeyError:
            raise DataError(f"symbol {symbol!r} is not in the vocabulary") from None

    def __contains__(self, symbol: object) -> bool:
        return symbol in self._index

    # -- encoding -------------------------------------------------------------------------

    def encode(self, text: str | bytes) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str | bytes, *, add_eos: bool = True) -> np.ndarray:
        """Encode to an int64 array. ``add_eos`` (word level) ends every line with ``eos``."""
        if self.level == "byte":
            data = text.encode("utf-8") if isinstance(text, str) else text
            return np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if self.level == "char":
            return self._encode_chars(text)
        return np.asarray(self._encode_words(text, add_eos=add_eos), dtype=np.int64)

    def _char_lut(self) -> np.ndarray:
        # A dense table over code points: one gather per character, no Python loop.
        if self._lut is None:
            single = [(ord(s), i) for i, s in enumerate(self.symbols) if len(s) == 1]
            top = max((cp for cp, _ in single), default=0)
            lut = np.full(top + 1, -1, dtype=np.int64)
            for cp, i in single:
                lut[cp] = i
            self._lut = lut
        return self._lut

    def _encode_chars(self, text: str) -> np.ndarray:
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        lut = self._char_lut()
        ids = np.full(cps.shape, -1, dtype=np.int64)
        inside = cps < len(lut)
        ids[inside] = lut[cps[inside]]
        missing = ids < 0
        if missing.any():
            if self.unk is None:
                bad = chr(int(cps[np.argmax(missing)]))
                raise DataError(f"character {bad!r} is not in the vocabulary (no <unk>)")
            ids[missing] = self._index[self.unk]
        return ids

    def _encode_words(self, text: str, *, add_eos: bool) -> list[int]:
        return self.encode_lines(text, add_eos=add_eos)[0]

    def encode_lines(self, text: str, *, add_eos: bool = True) -> tuple[list[int], list[int]]:
        """Word-level encoding that also returns the offset where each line starts.

        lm1b treats every line (sentence) as a document, so prepare needs these offsets;
        a ``bos`` symbol, when the vocabulary has one, opens every line.
        """
        index, unk = self._index, self.unk_id
        eos = self.eos_id if add_eos else None
        bos = self.bos_id
        out: list[int] = []
        starts: list[int] = []
        for line in text.splitlines():
            starts.append(len(out))
            if bos is not None:
                out.append(bos)
            for w in line.split():
                i = index.get(w, unk)
                if i is None:
                    raise DataError(f"word {w!r} is not in the vocabulary (no <unk>)")
                out.append(i)
            if eos is not None:
                out.append(eos)
        return out, starts

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        seq = [int(i) for i in ids]
        if any(i < 0 or i >= len(self.symbols) for i in seq):
            raise DataError(f"token id out of range for a vocabulary of {len(self.symbols)}")
        if self.level == "byte":
            return bytes(seq).decode("utf-8", errors="replace")
        if self.level == "char":
            return "".join(self.symbols[i] for i in seq)
        eos, bos = self.eos_id, self.bos_id
        out: list[str] = []
        line: list[str] = []
        for i in seq:
            if i == bos and not line:
                continue  # bos only marks a line start; the text has no symbol for it
            if i == eos:
                out.append(" ".join(line) + "\n")
                line = []
            else:
                line.append(self.symbols[i])
        if line:
            out.append(" ".join(line))
        return "".join(out)

    # -- JSON -----------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "level": self.level,
                "unk": self.unk,
                "eos": self.eos,
                "bos": self.bos,
                "fingerprint": self.fingerprint,
                "symbols": self.symbols,
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, text: str) -> Vocab:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"vocabulary is not valid JSON: {exc}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise DataError("not a txlm vocabulary (missing format: txlm-vocab)")
        if d.get("version") != FORMAT_VERSION:
            raise DataError(f"unsupported vocabulary version {d.get('version')!r}")
        if d.get("level") == "bpe":
            raise DataError(
                "a bpe vocabulary is read from its folder (Vocab.load), with its tokenizer"
            )
        symbols = d.get("symbols")
        if not isinstance(symbols, list) or not all(isinstance(s, str) for s in symbols):
            raise DataError("vocabulary symbols must be a list of strings")
        vocab = cls(
            symbols, d.get("level", ""), unk=d.get("unk"), eos=d.get("eos"), bos=d.get("bos")
        )
        stored = d.get("fingerprint")
        if stored is not None and stored != vocab.fingerprint:
            raise DataError("vocabulary fingerprint does not match its symbols (edited file?)")
        return vocab

    def save(self, path: str | Path) -> None:
        atomic.write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"vocabulary file not found: {p}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a binary file (e.g. a pickle) under the vocabulary's name
            raise DataError(f"{p} is not UTF-8 text: not a txlm vocabulary") from None
        except OSError as exc:
            raise DataError(f"cannot read {p}: {exc.strerror or exc}") from None
        try:
            head = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}: vocabulary is not valid JSON: {exc}") from None
        if isinstance(head, dict) and head.get("format") == FORMAT and head.get("level") == "bpe":
            if head.get("version") != FORMAT_VERSION:
                raise DataError(f"{p}: unsupported vocabulary version {head.get('version')!r}")
            return BPEVocab.load_beside(head, p)
        try:
            return cls.from_json(text)
        except DataError as exc:  # say which file: a checkpoint's or a dataset's
            raise DataError(f"{p}: {exc}") from None


def check_fingerprint(
    vocab: Vocab,
    wanted: str | None,
    *,
    what: str,
    against: str,
    optional: bool = True,
    error: type[TxlmError] = DataError,
) -> None:
    """Refuse ``vocab`` (read from ``what``) unless it is the vocabulary ``against`` records
    (fingerprint ``wanted``; None: nothing recorded, accepted when ``optional``). The one
    check between a vocabulary and what was made with it: a corpus, a checkpoint."""
    if wanted is None and optional:
        return
    if vocab.fingerprint != wanted:
        raise error(
            f"{what} does not match {against} (vocabulary fingerprint {vocab.fingerprint}, "
            f"expected {wanted})"
        )


# -- bpe: a learnt byte-level BPE (learning it: bpe.py) ---------------------------------


def safe_pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of roughly ``size`` characters at token-preserving places."""
    pieces = []
    pos = 0
    while len(text) - pos > size:
        m = _SAFE_CUT.search(text, pos + size)
        if m is None:
            break
        pieces.append(text[pos : m.start()])
        pos = m.start()
    pieces.append(text[pos:])
    return [p for p in pieces if p]


def _canonical(tokenizer_json: str) -> dict:
    try:
        data = json.loads(tokenizer_json)
    except json.JSONDecodeError as exc:
        raise DataError(f"tokenizer is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DataError("tokenizer JSON is not an object")
    model, pre, dec = data.get("model"), data.get("pre_tokenizer"), data.get("decoder")
    if not (
        isinstance(model, dict)
        and model.get("type") == "BPE"
        and isinstance(pre, dict)
        and pre.get("type") == "ByteLevel"
        and isinstance(dec, dict)
        and dec.get("type") == "ByteLevel"
        and data.get("normalizer") is None
    ):
        raise DataError("tokenizer is not a byte-level BPE without normalizer (not txlm's)")
    return data


def fingerprint_of(tokenizer_json: str) -> str:
    """A hash of the tokenizer's content (vocabulary, merges, settings), key order aside."""
    payload = json.dumps(
        {"level": "bpe", "tokenizer": _canonical(tokenizer_json)}, sort_keys=True, ensure_ascii=True
    )
    return hashlib.sha256(payload.encode("ascii")).hexdigest()[:16]


@dataclass
class BPEVocab(Vocab):
    """A ``Vocab`` whose symbols are byte-level BPE tokens (``symbols[i]`` is token i)."""

    tokenizer_json: str = field(default="", repr=False)
    _tok: Any = field(init=False, repr=False, default=None, compare=False)
    _fingerprint: str = field(init=False, repr=False, default="", compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._fingerprint = fingerprint_of(self.tokenizer_json)  # also checks the kind
        try:
            tok = Tokenizer.from_str(self.tokenizer_json)
        except Exception as exc:  # the Rust side raises a bare Exception
            raise DataError(f"tokenizer cannot be read: {str(exc).splitlines()[0]}") from None
        # Special tokens inside text are plain text: only prepare inserts <eos>.
        tok.encode_special_tokens = True
        if tok.get_vocab_size(with_added_tokens=True) != len(self.symbols):
            raise DataError("tokenizer size does not match the vocabulary's")
        self._tok = tok

    @classmethod
    def from_tokenizer_json(cls, tokenizer_json: str) -> BPEVocab:
        data = _canonical(tokenizer_json)
        vocab = data["model"].get("vocab")
        if not isinstance(vocab, dict):
            raise DataError("tokenizer has no BPE vocabulary")
        ids = {int(i): str(s) for s, i in vocab.items()}
        for added in data.get("added_tokens") or []:
            ids[int(added["id"])] = str(added["content"])
        if sorted(ids) != list(range(len(ids))):
            raise DataError("tokenizer ids are not 0..N-1")
        symbols = [ids[i] for i in range(len(ids))]
        eos = EOS if EOS in symbols else None
        return cls(symbols, "bpe", eos=eos, tokenizer_json=tokenizer_json)

    # -- what differs from the symbol-table vocabularies ----------------------------------

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def doc_start_id(self) -> int | None:
        return self.eos_id

    def encode_array(self, text: str | bytes, *, add_eos: bool = True) -> np.ndarray:
        """Token ids of ``text`` (``add_eos`` is for word level; BPE never adds one)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        pieces = safe_pieces(text)
        if not pieces:
            return np.zeros(0, dtype=np.int64)
        encodings = self._tok.encode_batch(pieces, add_special_tokens=False)
        return np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        seq = [int(i) for i in ids]
        if any(i < 0 or i >= len(self.symbols) for i in seq):
            raise DataError(f"token id out of range for a vocabulary of {len(self.symbols)}")
        # An incomplete UTF-8 sequence (a sample cut mid-character) decodes to U+FFFD.
        return self._tok.decode(seq, skip_special_tokens=False)

    def count_unknown(self, text: str) -> int:
        return 0  # bytes: every text is spelt

    # -- files ----------------------------------------------------------------------------

    def to_json(self) -> str:
        """vocab.json: the metadata; the tokens themselves are in tokenizer.json beside it."""
        return json.dumps(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "level": "bpe",
                "unk": None,
                "eos": self.eos,
                "bos": None,
                "fingerprint": self.fingerprint,
                "size": len(self.symbols),
                "tokenizer": TOKENIZER_FILE,
            },
            ensure_ascii=False,
        )

    def save(self, path: str | Path) -> None:
        """Write ``path`` (vocab.json) and ``tokenizer.json`` in the same folder."""
        p = Path(path)
        atomic.write_text(p.with_name(TOKENIZER_FILE), self.tokenizer_json)
        atomic.write_text(p, self.to_json())

    @classmethod
    def load_beside(cls, meta: dict, vocab_path: Path) -> BPEVocab:
        """The tokenizer.json next to ``vocab_path``, checked against vocab.json's record."""
        file = vocab_path.with_name(str(meta.get("tokenizer") or TOKENIZER_FILE))
        if file.name != TOKENIZER_FILE:
            raise DataError(f"{vocab_path}: tokenizer must be {TOKENIZER_FILE}")
        if not file.is_file():
            raise DataError(f"{file} is missing: a bpe vocabulary needs its tokenizer")
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{file} is not UTF-8 text: not a tokenizer") from None
        try:
            vocab = cls.from_tokenizer_json(text)
        except DataError as exc:
            raise DataError(f"{file}: {exc}") from None
        stored = meta.get("fingerprint")
        if stored != vocab.fingerprint or meta.get("size") != len(vocab):
            raise DataError(
                f"{file} does not match {vocab_path.name} (tokenizer fingerprint "
                f"{vocab.fingerprint}, size {len(vocab)}; {vocab_path.name} says {stored}, "
                f"size {meta.get('size')})"
            )
        return vocab
