"""``txlm prepare DATASET``: download (if needed), tokenise and write a dataset to disk."""

from __future__ import annotations

import argparse
import json
import time

DATASETS = "shakespeare (default, offline) | wt2 | wt103 | ptb | enwik8 | text8 | lm1b | text:PATH"
EPILOG = """\
output: DATA_DIR/NAME/{train,valid,test}.bin (token ids), vocab.json, meta.json
  NAME is the dataset, plus -LEVEL for a non-default level; text:PATH gives text-STEM.
splits: shakespeare holds out two works for valid and two for test (see meta.json);
  enwik8/text8 the paper's 90M/5M/5M; lm1b tests on heldout shard 00000, validates on 00001;
  text:PATH: with 10+ documents the last n/20 are test and the n/20 before valid, else the
  text is cut 90/5/5 at line starts.
documents: text:PATH folder = one per .txt file; in one file, 2+ blank lines end a document.
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
    p.add_argument("--level", choices=["char", "word", "byte"], default=None)
    p.add_argument("--force", action="store_true", help="rebuild even if an up-to-date copy exists")
    p.add_argument("--mirror", default=None, help="base URL replacing the download hosts")
    p.add_argument("--min-freq", type=int, default=1, help="word level: drop rarer words")
    p.add_argument("--max-size", type=int, default=None, help="word level: vocabulary cap")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print one JSON summary object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from txlm.data.prepare import default_data_dir, load_prepared, prepare_dataset

    start = time.perf_counter()
    path = prepare_dataset(
        args.dataset,
        args.data_dir or default_data_dir(),
        level=args.level,
        force=args.force,
        mirror=args.mirror,
        progress=not args.no_progress,
        min_freq=args.min_freq,
        max_size=args.max_size,
    )
    seconds = time.perf_counter() - start
    corpus = load_prepared(path)
    splits = {name: info["tokens"] for name, info in corpus.meta["splits"].items()}
    summary = {
        "path": str(path),
        "level": corpus.level,
        "vocab_size": len(corpus.vocab),
        "tokens": splits,
        "seconds": round(seconds, 3),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        counts = ", ".join(f"{k} {v:,}" for k, v in splits.items())
        print(f"{path}: {corpus.level} level, vocabulary {len(corpus.vocab):,}, tokens: {counts}")
    return 0
