"""Writing a corpus's splits as token ids: ``SPLIT.bin`` and its ``meta.json`` entry.

Each split is encoded piece by piece (never whole in memory) into the smallest unsigned dtype
that holds the vocabulary, little-endian, with its document offsets, UTF-8 size and
``<unk>`` count; train's token counts come back for the adaptive softmax's cutoffs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from txlm.data.bpe import renumber_by_count
from txlm.data.corpora import SPLITS, RawCorpus
from txlm.data.progress import Progress
from txlm.data.vocab import BPEVocab, Vocab
from txlm.errors import DataError

INLINE_DOC_STARTS = 1 << 16  # more document offsets than this go to SPLIT.docs.bin


def encode_splits(
    raw: RawCorpus, vocab: Vocab, folder: Path, *, progress: bool, renumber: bool = True
) -> tuple[Vocab, dict, np.ndarray]:
    """Every split written; the final vocabulary, the splits' meta.json and train's counts.

    A bpe vocabulary arrives numbered in merge order: train is encoded with it, then its ids
    are renumbered by the counts of that pass (renumber_by_count) and train.bin is
    rewritten through the map, before valid and test are encoded with the final numbering.
    ``renumber=False`` keeps a given vocabulary's ids (a checkpoint's: its model reads them).
    """
    splits: dict = {}
    splits["train"], counts = encode_split(raw, "train", vocab, folder, progress=progress)
    if renumber and isinstance(vocab, BPEVocab):
        vocab, lut = renumber_by_count(vocab, counts)
        file = folder / splits["train"]["file"]
        ids = np.fromfile(file, dtype=np.dtype(vocab.dtype).newbyteorder("<"))
        lut.astype(ids.dtype)[ids].tofile(file)
        counts = counts[np.argsort(lut)]  # counts[new id]
    for split in SPLITS[1:]:
        splits[split] = encode_split(raw, split, vocab, folder, progress=progress)[0]
    return vocab, splits, counts


def encode_split(
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
    # a bar on a terminal; in a log a line every 30 s (the total is known only at the end)
    bar = Progress(
        f"{folder.name.lstrip('.').rsplit('.', 3)[0]} {split}",  # .NAME.PID.XXXX.tmp
        None,
        unit="tokens",
        enabled=progress,
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
