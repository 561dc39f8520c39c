"""``txlm prepare DATASET``: download (if needed), tokenise and write a dataset to disk."""

from __future__ import annotations

import argparse
import json
import time

from txlm.data import open_corpus
from txlm.data.metrics import describe

DATASETS = (
    "shakespeare (default, offline) | wt2 | wt103 | ptb | enwik8 | text8 | lm1b | text:PATH | "
    "recall[:key=value,...]"
)
EPILOG = """\
output: DATA_DIR/NAME/{train,valid,test}.bin (token ids), vocab.json, meta.json
  NAME is the dataset, plus -LEVEL for a non-default level; text:PATH gives text-STEM.
splits: shakespeare holds out two works for valid and two for test (see meta.json);
  enwik8/text8 the paper's 90M/5M/5M; lm1b tests on heldout shard 00000, validates on 00001;
  text:PATH: with 10+ documents the last n/20 are test and the n/20 before valid, else the
  text is cut 90/5/5 at line starts.
documents: text:PATH folder = one per .txt file; in one file, 2+ blank lines end a document.
levels: char (default for text), word, byte, bpe (a byte-level BPE learnt on train with
  Hugging Face tokenizers: tokenizer.json beside vocab.json; any text round-trips, no <unk>).
  --vocab-size default 8192: on a corpus of 1-10 MB each of 8k tokens still occurs a few
  hundred times in train, enough to learn its embedding; 16k+ pays off from ~100 MB of text.
  The metric of a bpe corpus is bits per byte (comparable across levels and sizes).
word vocabularies: --min-freq N drops words seen fewer than N times in train, --max-vocab N
  keeps the N-2 most frequent (plus <unk>, <eos>; 0: no cap); the rest become <unk>, counted
  per split.
  Options not given: as the existing copy was prepared (txlm train/eval find it), else default.
recall: a generated long-range copy task (offline): random spans that recur verbatim after a
  log-uniform distance; keys alphabet, span, min_span, min_dist, max_dist, train_max_dist,
  fresh, seed, train, valid, test (recall:span=8,max_dist=128); with keys > 0 (and values) the
  associative form, values stored under keys and asked for later
  (recall:keys=32,values=8,alphabet=302,min_dist=2); SPLIT.copy.bin holds each token's copy
  distance.
downloads: DATA_DIR/downloads/, resumed when interrupted, checked against a published sha256
  (wt2, wt103, enwik8, text8) or the one recorded at first download (ptb, lm1b).
environment: TXLM_DATA_DIR, TXLM_MIRROR (base URL for every download), TXLM_SHA256_FILE
  (JSON {file name: sha256} for a mirror serving re-packed archives).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepare",
        help="prepare a corpus: token-id files, vocab.json, meta.json",
        description=f"Prepare a dataset. DATASET: {DATASETS}.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dataset", nargs="?", default="shakespeare", metavar="DATASET")
    p.add_argument("--data-dir", default=None, help="default: $TXLM_DATA_DIR or ./data")
    p.add_argument("--level", choices=["char", "word", "byte", "bpe"], default=None)
    p.add_argument("--force", action="store_true", help="rebuild even if an up-to-date copy exists")
    p.add_argument("--mirror", default=None, help="base URL replacing the download hosts")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="bpe level: vocabulary size (default 8192, for corpora of a few MB; see below)",
    )
    p.add_argument(
        "--min-freq",
        type=int,
        default=None,
        metavar="N",
        help="word level: words seen fewer than N times in train become <unk> (default 1)",
    )
    p.add_argument(
        "--max-vocab", type=int, default=None, metavar="N",
        help="word level: keep the N most frequent symbols, the rest become <unk> (0: no cap)",
    )  # fmt: skip
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bars (none off a terminal anyway)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON summary object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    corpus = open_corpus(
        args.dataset,
        args.data_dir,
        level=args.level,
        force=args.force,
        replace=True,  # the one command that rebuilds a copy that is out of date
        mirror=args.mirror,
        # a bar on a terminal, a line every 30 s in a log (txlm.data.progress)
        progress=not args.no_progress,
        min_freq=args.min_freq,
        max_vocab=args.max_vocab,
        vocab_size=args.vocab_size,
    )
    seconds = time.perf_counter() - start
    path = corpus.path
    splits = {name: info["tokens"] for name, info in corpus.meta["splits"].items()}
    summary: dict = {
        "path": str(path),
        "level": corpus.level,
        "vocab_size": len(corpus.vocab),
        "tokens": splits,
        "metric": corpus.metric,
        "bytes_per_token": {
            name: round(1 / tpb, 4)
            for name in splits
            if (tpb := corpus.tokens_per_byte(name)) is not None
        },
        "reused": corpus.reused,
        "seconds": round(seconds, 3),
    }
    options = corpus.meta.get("options") or {}
    if options:
        summary["options"] = options
    unk = {name: corpus.unk_tokens(name) for name in splits}
    if corpus.vocab.unk is not None:
        summary["unk_tokens"] = unk
    cutoffs = (corpus.meta.get("adaptive_softmax") or {}).get("suggested_cutoffs")
    if cutoffs is not None:
        summary["suggested_cutoffs"] = cutoffs
    skipped = (corpus.meta.get("corpus") or {}).get("skipped_empty") or []
    if skipped:
        summary["skipped_empty"] = skipped
    if args.json:
        print(json.dumps(summary))
        return 0
    if corpus.reused:
        print(f"{path}: an up-to-date copy was there, reused it (--force rebuilds)")
    if skipped:
        shown = ", ".join(skipped[:3]) + (
            f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        )
        print(f"skipped {len(skipped)} empty document(s) (nothing but whitespace): {shown}")
    counts = ", ".join(f"{k} {v:,}" for k, v in splits.items())
    asked = ""
    if "vocab_size" in options and options["vocab_size"] != len(corpus.vocab):
        asked = f" (asked {options['vocab_size']:,}: no more pairs occur twice in train)"
    print(
        f"{path}: {corpus.level} level, vocabulary {len(corpus.vocab):,}{asked}, tokens: {counts}"
    )
    bpt = summary["bytes_per_token"].get("train")
    line = f"metric: {corpus.metric} ({describe(corpus.metric)})"
    if bpt is not None and corpus.level in ("bpe", "word"):
        line += f"; {bpt:.2f} bytes per token in train"
    print(line)
    if corpus.vocab.unk is not None:
        parts = []
        for name, n in splits.items():
            k = unk[name] or 0
            parts.append(f"{name} {k:,} ({100 * k / n:.2f}%)")
        print(f"<unk> tokens: {', '.join(parts)}")
    if cutoffs is not None:
        hint = f"--set model.cutoffs={json.dumps(cutoffs)}" if cutoffs else "none"
        print(
            f"adaptive softmax (ids sorted by train count): cutoffs covering 80%/95% of train "
            f"tokens: {hint}; below ~16k symbols a full softmax (cutoffs []) costs little"
        )
    return 0
