"""Learning a byte-level BPE vocabulary (level ``bpe``) with Hugging Face ``tokenizers``.

Byte level: text is first read as its UTF-8 bytes, each byte one of 256 base symbols, and BPE
merges frequent neighbours into longer tokens. No text is ever unknown (no ``<unk>``), and
``decode(encode(text)) == text`` for any Unicode text, whitespace included: there is no
normalisation and no prefix space. The learnt vocabulary is a ``vocab.BPEVocab`` (encoding,
decoding, files and fingerprint live there, with the other levels).

Ids. ``<eos>`` is id 0; every other token is numbered by decreasing count in the train split
(ties by the token), like the word vocabularies, so the adaptive softmax's head cluster
(``model.cutoffs``) holds the frequent tokens. ``suggest_cutoffs`` reads the counts.

``<eos>`` opens every document of a prepared corpus (GPT-2 puts its separator between
documents the same way): the model learns where a text starts and ends, an empty prompt
starts from it, and ``--stop-at-eos`` stops where the model ends a document. Text never
encodes to it: a literal "<eos>" in a file is read as the five characters it is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from txlm.data.vocab import EOS, BPEVocab, safe_pieces
from txlm.errors import DataError

BYTE_ALPHABET = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET + 1  # the 256 byte symbols and <eos>
# Small corpora (1-10 MB, the "your own folder of text" case) give each of 8k tokens a few
# hundred occurrences to learn its embedding from; 16k and more pay off from ~100 MB on.
DEFAULT_VOCAB_SIZE = 8192
# Ids are 32-bit in the tokenizers library and in the prepared .bin files; the library also
# reserves memory in proportion to the size it is given before it looks at the text (about
# 70 bytes per entry: 10^12 aborts the process). Sizes above this are refused; below it the
# size handed to the library is the most that the text can give (``_learnable``).
MAX_VOCAB_SIZE = 2**31 - 1


# -- training ------------------------------------------------------------------------------


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size {vocab_size} is smaller than the byte alphabet: a byte-level BPE "
            f"needs at least {MIN_VOCAB_SIZE} (256 byte symbols + {EOS})"
        )
    if vocab_size > MAX_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size {vocab_size} is above the largest a bpe vocabulary can have "
            f"({MAX_VOCAB_SIZE}, 32-bit ids): lower --vocab-size"
        )


def _learnable(vocab_size: int, chars: int) -> int:
    """The most tokens BPE can learn from ``chars`` characters: each merge needs a pair seen
    twice (``min_frequency=2``) and removes at least two of the text's at most 4 * chars
    byte tokens, so there are at most 2 * chars merges. Asking the library for more gives
    the same vocabulary, after reserving memory for the size asked."""
    return min(vocab_size, MIN_VOCAB_SIZE + 2 * chars)


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
        vocab_size=_learnable(vocab_size, chars),
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
