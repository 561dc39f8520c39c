"""Byte-level BPE vocabularies (level ``bpe``), learnt with Hugging Face ``tokenizers``.

Byte level: text is first read as its UTF-8 bytes, each byte one of 256 base symbols, and BPE
merges frequent neighbours into longer tokens. No text is ever unknown (no ``<unk>``), and
``decode(encode(text)) == text`` for any Unicode text, whitespace included: there is no
normalisation and no prefix space.

Ids. ``<eos>`` is id 0; every other token is numbered by decreasing count in the train split
(ties by the token), like the word vocabularies, so the adaptive softmax's head cluster
(``model.cutoffs``) holds the frequent tokens. ``suggest_cutoffs`` reads the counts.

``<eos>`` opens every document of a prepared corpus (GPT-2 puts its separator between
documents the same way): the model learns where a text starts and ends, an empty prompt
starts from it, and ``--stop-at-eos`` stops where the model ends a document. Text never
encodes to it: a literal "<eos>" in a file is read as the five characters it is.

Storage: ``tokenizer.json`` is the ``tokenizers`` library's own file (``Tokenizer.from_file``
reads it, as does transformers' ``PreTrainedTokenizerFast``); ``vocab.json`` beside it holds
txlm's metadata (level, size, ``<eos>``) and the fingerprint, a hash of the tokenizer's
canonical JSON. Loading recomputes the hash, so a ``tokenizer.json`` swapped under a
checkpoint or a prepared corpus is refused rather than silently re-numbering the model.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from txlm.data.vocab import FORMAT, FORMAT_VERSION, Vocab, write_text_atomic
from txlm.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
EOS = "<eos>"
BYTE_ALPHABET = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET + 1  # the 256 byte symbols and <eos>
# Small corpora (1-10 MB, the "your own folder of text" case) give each of 8k tokens a few
# hundred occurrences to learn its embedding from; 16k and more pay off from ~100 MB on.
DEFAULT_VOCAB_SIZE = 8192
PIECE_CHARS = 1 << 16  # text is encoded in pieces of about this many characters, in parallel

# Where text may be cut without changing its tokens: before a newline that follows a word
# character or common punctuation. The byte-level pre-tokenizer (GPT-2's pattern) never joins
# such a character with the whitespace after it, and a whitespace run that starts at a newline
# is split the same way whether or not text precedes it; so encoding the pieces one by one
# gives exactly the tokens of the whole (tested). Cuts elsewhere (e.g. inside a run of
# blank lines) could change how a whitespace run is split.
_SAFE_CUT = re.compile(r"(?<=[\w.,;:!?)\]}'\"])\n")


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
        from tokenizers import Tokenizer

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
        write_text_atomic(p.with_name(TOKENIZER_FILE), self.tokenizer_json)
        write_text_atomic(p, self.to_json())

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


# -- training ------------------------------------------------------------------------------


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size {vocab_size} is smaller than the byte alphabet: a byte-level BPE "
            f"needs at least {MIN_VOCAB_SIZE} (256 byte symbols + {EOS})"
        )


def train_bpe(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, *, renumber: bool = True
) -> BPEVocab:
    """Learn a byte-level BPE of at most ``vocab_size`` tokens from ``texts`` (the train split).

    Merges seen only once are not learnt (``min_frequency=2``): on a small corpus the
    vocabulary then stays below ``vocab_size`` instead of filling up with one-off strings.
    Ids are then renumbered by count in ``texts`` (see the module docstring); ``renumber=
    False`` leaves that to the caller (prepare counts while it encodes the split anyway,
    and renumbers the ids it wrote: one encoding pass instead of two).
    """
    check_vocab_size(vocab_size)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = list(texts)
    chars = sum(len(t) for t in texts)
    if chars == 0:
        raise DataError("the train split is empty: nothing to learn a BPE vocabulary from")
    first_char = next(t[0] for t in texts if t)
    if all(t.count(first_char) == len(t) for t in texts):
        raise DataError(
            f"the train split is one character ({first_char!r}) repeated {chars} times: a BPE "
            "vocabulary needs varied text"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_pieces_of(texts), trainer)
    first = BPEVocab.from_tokenizer_json(tok.to_str())
    if not renumber:
        return first
    return renumber_by_count(first, token_counts(first, texts))[0]


def _pieces_of(texts: Iterable[str]) -> Iterator[list[str]]:
    for t in texts:
        yield safe_pieces(t)


def token_counts(vocab: BPEVocab, texts: Iterable[str]) -> np.ndarray:
    counts = np.zeros(len(vocab), dtype=np.int64)
    for t in texts:
        ids = vocab.encode_array(t)
        counts += np.bincount(ids, minlength=len(vocab))
    return counts


def renumber_by_count(vocab: BPEVocab, counts: np.ndarray) -> tuple[BPEVocab, np.ndarray]:
    """The same tokenizer with ids by decreasing count (``<eos>`` first, ties by token),
    and the map old id -> new id (``new_ids = lut[old_ids]``)."""
    assert vocab.eos_id is not None
    rest = [i for i in range(len(vocab)) if i != vocab.eos_id]
    rest.sort(key=lambda i: (-int(counts[i]), vocab.symbols[i]))
    order = [vocab.eos_id, *rest]
    lut = np.empty(len(vocab), dtype=np.int64)
    lut[order] = np.arange(len(vocab))
    data = json.loads(vocab.tokenizer_json)
    data["model"]["vocab"] = {s: int(lut[i]) for s, i in data["model"]["vocab"].items()}
    for added in data.get("added_tokens") or []:
        added["id"] = int(lut[added["id"]])
    return BPEVocab.from_tokenizer_json(json.dumps(data, ensure_ascii=False)), lut


def suggest_cutoffs(counts: np.ndarray, coverage: tuple[float, ...] = (0.8, 0.95)) -> list[int]:
    """Adaptive-softmax cutoffs for frequency-sorted ids: the head cluster ends where the
    most frequent tokens cover ``coverage[0]`` of the train tokens, the next at ``[1]``
    (rounded up to multiples of 256). Below ~16k tokens a full softmax is cheap enough that
    ``[]`` is the better choice (see the README)."""
    total = counts.sum()
    if total == 0:
        return []
    cum = np.cumsum(np.sort(counts)[::-1]) / total
    out: list[int] = []
    for c in coverage:
        k = int(np.searchsorted(cum, c) + 1)
        k = -(-k // 256) * 256
        if 0 < k < len(counts) and (not out or k > out[-1]):
            out.append(k)
    return out
