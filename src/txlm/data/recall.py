"""``recall``: a synthetic long-range task that only a model with working memory can solve.

Each split is one stream of *spans* of ``span`` distinct random symbols. Every span occurs
twice: once as a source, and once more, verbatim, as its copy, ``d`` tokens later, with
other spans (sources and copies of other spans) in between::

    ..qhcxbwmr ktavzdyo ... qhcxbwmr ... ktavzdyo ..       (spaces only for the eye)
      ^ source              ^ copy, d tokens after its source

``d`` is drawn per span, log-uniformly from ``[min_dist, max_dist]``, so each octave of
distance holds about as many copies; a copy is written at the first span boundary after it
is due, and one that had to wait for others records its true, longer distance.

Once the first symbol of a copy has appeared, the rest of the copy is determined by its source
and by nothing else: a span's symbols are distinct and avoid every symbol of the ``fresh``
tokens before it and of every source still waiting for its copy, so inside that window each
symbol's earlier occurrence is unique (an induction-style lookup "find my previous occurrence,
read what followed it" has exactly one answer). A model that cannot see ``d`` tokens back can
only guess among the unused symbols. The first symbol of a copy is not predictable (nothing
says which span recurs next) and is not counted as a copy.

By default every span has ``span`` symbols, so copies lie a multiple of ``span`` back (and a
fixed-offset attention head can serve a common distance); ``min_span`` varies the lengths so
that distances take every value and only a lookup by content finds the source. Train copies
lie at most ``train_max_dist`` back, valid and test copies up to ``max_dist``: a model is
trained on what a short memory reaches and tested far beyond it.

About half of all tokens are predictable copies. The stream is one document per split and is
read like any other corpus (character level, bpc): spans and their copies cross segment
boundaries freely, and nothing is special-cased in the iterator, the memory or the model.

Per token of each split, ``SPLIT.copy.bin`` (int32, little-endian, as long as the split)
holds the distance back to the source when the token is a predictable copy, else 0. Token
``t`` of the split is the label of input position ``t - 1``.

The associative form (``keys`` > 0, ``generate_pairs``) replaces spans by stored pairs: a
pair symbol stores one of ``values`` values under one of ``keys`` keys, and ``d`` tokens later
the key's query symbol is followed by that value, the copy; filler symbols fill the rest. Its
lookup is one step by content (the query matches its key's pair symbol, whose value is the
answer), where the span form needs two composed steps (find the previous occurrence of the
current symbol, then read what followed it): an induction circuit, which small models take
far longer to form.

Name and parameters: ``recall`` with the defaults, or ``recall:key=value,...`` with any of
the fields of ``RecallSpec`` (``recall:span=12,max_dist=256,train=500000``). The folder is
``recall`` for the defaults, else ``recall-`` plus the changed settings.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from txlm import atomic
from txlm.data.building import building
from txlm.data.prepared import FORMAT, FORMAT_VERSION, is_current
from txlm.data.vocab import Vocab
from txlm.errors import DataError

GENERATOR_VERSION = 1
# Letters and digits, then Greek, Cyrillic and Latin Extended-A letters: 290 span symbols,
# each one printable character.
SYMBOLS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩ"
    + "".join(chr(c) for c in range(0x0410, 0x0450))
    + "".join(chr(c) for c in range(0x0100, 0x0180))
)
COPY_SUFFIX = ".copy.bin"


@dataclass(frozen=True)
class RecallSpec:
    alphabet: int = 256  # span symbols (at most 302)
    span: int = 16  # symbols per span, distinct; the last span - 1 of a copy are predictable
    # None: every span has ``span`` symbols, so copies lie a multiple of it back. Else lengths
    # vary in [min_span, span] and distances take every value (a harder task: no fixed set
    # of offsets, only a lookup by content, finds the source).
    min_span: int | None = None
    min_dist: int = 16  # distance from a copy token back to its source, >= span
    max_dist: int = 256  # valid and test
    train_max_dist: int = 64  # train: copies within reach of a short memory
    fresh: int | None = None  # a span avoids the symbols of this many preceding tokens
    # > 0: the associative form (``generate_pairs``): this many keys, ``values`` values
    keys: int = 0
    values: int = 8
    seed: int = 0
    train: int = 1_000_000  # tokens per split
    valid: int = 100_000
    test: int = 100_000

    @property
    def fresh_window(self) -> int:
        return self.max_dist if self.fresh is None else self.fresh

    def check(self) -> None:
        def bad(msg: str) -> DataError:
            return DataError(f"recall: {msg}")

        if not 2 <= self.alphabet <= len(SYMBOLS):
            raise bad(f"alphabet must be in [2, {len(SYMBOLS)}], got {self.alphabet}")
        if not 2 <= self.span <= self.alphabet:
            raise bad(f"span must be in [2, alphabet={self.alphabet}], got {self.span}")
        if self.min_span is not None and not 2 <= self.min_span <= self.span:
            raise bad(f"min_span must be in [2, span={self.span}], got {self.min_span}")
        first = 2 if self.keys else self.span  # pair, query, value: d >= 2
        if not first <= self.min_dist <= min(self.max_dist, self.train_max_dist):
            raise bad(
                f"need {'2' if self.keys else 'span'} <= min_dist <= max_dist, train_max_dist "
                f"(a copy comes after its source), got {first}, {self.min_dist}, "
                f"{self.max_dist}, {self.train_max_dist}"
            )
        if self.fresh is not None and self.fresh < 0:
            raise bad(f"fresh must be >= 0, got {self.fresh}")
        if self.keys < 0 or self.values < 2:
            raise bad(f"keys must be >= 0 and values >= 2, got {self.keys}, {self.values}")
        if self.keys and self.keys * self.values + self.keys + self.values >= self.alphabet:
            raise bad(
                f"keys={self.keys} x values={self.values} pair symbols, the queries and the "
                f"values leave no filler symbol in alphabet={self.alphabet}"
            )
        for split in ("train", "valid", "test"):
            n = getattr(self, split)
            if n < 2 * max(self.max_dist, self.train_max_dist):
                raise bad(f"{split}={n} tokens is too short for documents up to max_dist")

    @property
    def folder_name(self) -> str:
        default = RecallSpec()
        changed = [f"{f.name}{getattr(self, f.name)}" for f in fields(self)]
        changed = [
            c
            for c, f in zip(changed, fields(self), strict=True)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return "-".join(["recall", *changed])


def is_recall(name: str) -> bool:
    return name == "recall" or name.startswith("recall:")


def parse_spec(name: str) -> RecallSpec:
    """``recall`` or ``recall:key=value,...`` -> a checked RecallSpec."""
    if not is_recall(name):
        raise DataError(f"not a recall dataset name: {name!r}")
    values: dict[str, int | None] = {}
    known = {f.name for f in fields(RecallSpec)}
    for item in name.partition(":")[2].split(","):
        if not item.strip():
            continue
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise DataError(
                f"recall: expected key=value with key one of {', '.join(sorted(known))}, "
                f"got {item!r}"
            )
        try:
            values[key] = None if raw.strip().lower() in ("none", "") else int(raw)
        except ValueError:
            raise DataError(f"recall: {key} must be an integer, got {raw!r}") from None
        if values[key] is None and key not in ("fresh", "min_span"):
            raise DataError(f"recall: {key} needs a value")
    spec = RecallSpec(**values)  # type: ignore[arg-type]
    spec.check()
    return spec


def vocabulary(spec: RecallSpec) -> Vocab:
    """Every symbol the task can emit (not only those a split happens to use)."""
    return Vocab.build_char(dict.fromkeys(SYMBOLS[: spec.alphabet], 1), unk=False)


def generate(
    spec: RecallSpec, n_tokens: int, rng: np.random.Generator, *, max_dist: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One split: symbol indices [N] and copy distances [N] (0: not a copy).

    The stream is written span by span. At each span boundary the oldest copy that is due
    (its source began at least its drawn distance ago) is written; if none is due, a new
    source span is drawn and its copy scheduled. A copy written late (others were due first)
    records its true, longer distance.
    """
    s, a = spec.span, spec.alphabet
    symbols = np.zeros(n_tokens + s, dtype=np.int64)
    dist = np.zeros(n_tokens + s, dtype=np.int32)
    pending: list[tuple[int, int, np.ndarray]] = []  # (due, source position, span), by due
    never = -(1 << 40)
    last_used = np.full(a, never, dtype=np.int64)  # position of each symbol's last occurrence
    waiting = np.zeros(a, dtype=bool)  # symbols of sources whose copy is still to come
    max_dist = spec.max_dist if max_dist is None else max_dist
    lo, hi = np.log(spec.min_dist), np.log(max_dist + 1)
    pos = 0
    while pos < n_tokens:
        if pending and pending[0][0] <= pos:
            _, source, span = pending.pop(0)
            n = len(span)
            symbols[pos : pos + n] = span
            dist[pos + 1 : pos + n] = pos - source  # the first symbol of a copy is no cue
            waiting[span] = False
        else:
            free = np.flatnonzero((last_used < pos - spec.fresh_window) & ~waiting)
            if len(free) < s:  # alphabet too small for the window: least recently used
                order = np.argsort(np.where(waiting, np.iinfo(np.int64).max, last_used))
                free = order[:s]
            n = int(rng.integers(spec.min_span, s + 1)) if spec.min_span else s
            span = rng.choice(free, size=n, replace=False)
            d = max(n, min(int(np.exp(rng.uniform(lo, hi))), max_dist))
            due = pos + d
            k = next((i for i, p in enumerate(pending) if p[0] > due), len(pending))
            pending.insert(k, (due, pos, span))
            symbols[pos : pos + n] = span
            waiting[span] = True
        last_used[symbols[pos : pos + n]] = pos + n - 1
        pos += n
    return symbols[:n_tokens], dist[:n_tokens]


def generate_pairs(
    spec: RecallSpec, n_tokens: int, rng: np.random.Generator, *, max_dist: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The associative form: symbol indices [N] and copy distances [N] (0: not a copy).

    Symbols: ``keys * values`` pair symbols (key k with value v is ``k * values + v``), then
    ``keys`` query symbols, ``values`` value symbols, and the rest of the alphabet as filler.
    A pair symbol stores a value under a key; ``d`` tokens later (log-uniform in
    ``[min_dist, max_dist]``, later when another query is due first) the key's query symbol
    comes, followed by the value symbol: that value token is the copy, at distance ``d`` from
    its pair symbol (the query before it, which predicts it, is ``d - 1`` after the pair).
    A key is stored again only ``fresh`` tokens after its query, so a query's only pair in
    that window is its own. The lookup is by content in one step (query symbol -> the pair
    symbol with that key -> its value); no offset finds it, and without the pair in view the
    value is a guess among ``values``. Everything else is filler, uniform over its symbols.
    """
    n_keys, n_values = spec.keys, spec.values
    query0, value0, filler0 = (
        n_keys * n_values,
        n_keys * n_values + n_keys,
        n_keys * n_values + n_keys + n_values,
    )
    max_dist = spec.max_dist if max_dist is None else max_dist
    fresh = max_dist if spec.fresh is None else spec.fresh
    lo, hi = np.log(spec.min_dist), np.log(max_dist + 1)
    symbols = np.zeros(n_tokens + 2, dtype=np.int64)
    dist = np.zeros(n_tokens + 2, dtype=np.int32)
    free_at = np.zeros(n_keys, dtype=np.int64)  # position from which each key may be stored
    pending: list[tuple[int, int, int]] = []  # (due, pair position, key), by due
    pos = 0
    while pos < n_tokens:
        if pending and pending[0][0] <= pos:
            _, source, key = pending.pop(0)
            symbols[pos] = query0 + key
            symbols[pos + 1] = value0 + symbols[source] % n_values
            dist[pos + 1] = pos + 1 - source
            free_at[key] = pos + 1 + fresh
            pos += 2
            continue
        ready = np.flatnonzero((free_at <= pos) & (free_at >= 0))
        if len(ready):
            key = int(rng.choice(ready))
            symbols[pos] = key * n_values + int(rng.integers(n_values))
            d = min(int(np.exp(rng.uniform(lo, hi))), max_dist)
            due = pos + d - 1  # the query: its value lands d after the pair
            k = next((i for i, p in enumerate(pending) if p[0] > due), len(pending))
            pending.insert(k, (due, pos, key))
            free_at[key] = -1  # pending
        else:
            symbols[pos] = filler0 + int(rng.integers(spec.alphabet - filler0))
        pos += 1
    return symbols[:n_tokens], dist[:n_tokens]


def _input_key(spec: RecallSpec) -> str:
    payload = json.dumps({"generator": GENERATOR_VERSION, **asdict(spec)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def prepare_recall(name: str, data_dir: str | Path, *, force: bool = False) -> Path:
    """Write DATA_DIR/<folder> in the prepared layout (plus SPLIT.copy.bin) and return it.

    Deterministic in the spec: the same name gives the same bytes on every machine. An
    up-to-date copy is reused; the build happens in a temporary folder renamed into place.
    """
    spec = parse_spec(name)
    data_dir = Path(data_dir)
    out = data_dir / spec.folder_name
    key = _input_key(spec)
    if not force and is_current(out, key) and _copies_present(out):
        return out
    vocab = vocabulary(spec)
    # symbol index -> token id: the vocabulary sorts by code point
    lut = np.asarray([vocab.id_of(c) for c in SYMBOLS[: spec.alphabet]])
    with building(data_dir, out) as tmp:
        splits = {}
        copies = {}
        for i, split in enumerate(("train", "valid", "test")):
            rng = np.random.default_rng([spec.seed, i])
            longest = spec.train_max_dist if split == "train" else spec.max_dist
            make = generate_pairs if spec.keys else generate
            symbols, dist = make(spec, getattr(spec, split), rng, max_dist=longest)
            ids = lut[symbols].astype(vocab.dtype)
            ids.astype(ids.dtype.newbyteorder("<")).tofile(tmp / f"{split}.bin")
            dist.astype("<i4").tofile(tmp / f"{split}{COPY_SUFFIX}")
            info: dict = {"file": f"{split}.bin", "tokens": len(ids), "bytes": ids.nbytes}
            info.update(documents=1, doc_starts=[0])  # one stream per split
            splits[split] = info
            copies[split] = {
                "file": f"{split}{COPY_SUFFIX}",
                "copy_tokens": int((dist > 0).sum()),
            }
        vocab.save(tmp / "vocab.json")
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dataset": "recall",
            "name": out.name,
            "level": "char",
            "metric": "bpc",
            "dtype": vocab.dtype.name,
            "vocab_size": len(vocab),
            "vocab_fingerprint": vocab.fingerprint,
            "input_key": key,
            "sources": [],
            "source_bytes": 0,
            "tokenizer": {"level": "char", "unknown": "no <unk>: a fixed alphabet"},
            "corpus": {
                "generator": GENERATOR_VERSION,
                "spec": asdict(spec),
                "documents": "one per split: spans that recur verbatim, log-uniform distance",
            },
            "splits": splits,
            # per token: distance back to its source when the token is a predictable copy
            "copies": {"dtype": "int32", "splits": copies},
        }
        atomic.write_text(tmp / "meta.json", json.dumps(meta, indent=1))
    return out


def _copies_present(out: Path) -> bool:
    return all((out / f"{s}{COPY_SUFFIX}").is_file() for s in ("train", "valid", "test"))


def copy_distances(corpus_path: str | Path, split: str) -> np.ndarray:
    """The per-token copy distances of a prepared recall split (0: not a copy), read-only."""
    path = Path(corpus_path)
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise DataError(f"{path} is not a prepared dataset") from None
    info = meta.get("copies", {}).get("splits", {}).get(split)
    if meta.get("dataset") != "recall" or info is None:
        raise DataError(f"{path} has no copy distances for split {split!r}: not a recall dataset")
    file = path / info["file"]
    n = int(meta["splits"][split]["tokens"])
    if not file.is_file() or file.stat().st_size != 4 * n:
        raise DataError(f"{file} is missing or truncated; run txlm prepare --force")
    return np.memmap(file, dtype="<i4", mode="r", shape=(n,))
