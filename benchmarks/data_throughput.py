"""Data pipeline throughput: ``prepare`` in MB/s, tokenizers and stream iterators in tokens/s.

    python benchmarks/data_throughput.py [--out FILE.json] [--synthetic-mb 100] [--word]
        [--sections prepare,iterators,tokenize] [--corpus PATH] [--tokenize-mb 10]
        [--vocab-size 16384]

Measures, in one process on this machine:

* ``tokenize``: the vocabulary levels side by side on one text corpus (``--corpus`` file or
  folder of .txt, default ``--tokenize-mb`` MB of Shakespeare): ``prepare`` from scratch
  at char, word and bpe level (bpe: learning the ``--vocab-size`` BPE on train, then
  encoding every split), and encoding alone (``Vocab.encode_array`` over the whole text with
  the learnt vocabulary): tokens/s and bytes per token for each level;

* ``prepare`` on the default corpus (Shakespeare, char level; ``--word``: also word level),
  from scratch (``force=True``): source MB / wall second;
* ``prepare`` on a synthetic ``text:PATH`` file of ``--synthetic-mb`` MB made by repeating
  the Shakespeare works (same character statistics, realistic document breaks);
* ``StreamIterator`` (continue and reset mode) and ``SentenceStreamIterator`` over the
  prepared memmaps: tokens per second produced, batches of 32 x 512 on the CPU. The iterator
  must never be the bottleneck: the model trains at thousands of tokens/s on this machine.

Prints one JSON object (and writes it to ``--out`` when given).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from txlm.data import SentenceStreamIterator, StreamIterator, load_prepared, prepare_dataset
from txlm.data.corpora import shakespeare_files


def timed_prepare(name: str, data_dir: Path, **kw: object) -> dict:
    start, cpu = time.perf_counter(), time.process_time()
    path = prepare_dataset(name, data_dir, force=True, progress=False, **kw)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    corpus = load_prepared(path)
    mb = corpus.meta["source_bytes"] / 1e6
    tokens = sum(int(s["tokens"]) for s in corpus.meta["splits"].values())
    return {
        "dataset": name if not name.startswith("text:") else "text:(synthetic)",
        "level": corpus.level,
        "source_mb": round(mb, 2),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "mb_per_s": round(mb / seconds, 2),
        # the machine is shared: CPU seconds show the cost without other processes' load
        "cpu_seconds": round(cpu, 3),
        "mb_per_cpu_s": round(mb / cpu, 2),
        "path": str(path),
    }


def iterate(it, max_batches: int) -> dict:
    n_tokens = 0
    n = 0
    start, cpu = time.perf_counter(), time.process_time()
    for batch in it:
        n_tokens += batch.num_tokens
        n += 1
        if n >= max_batches:
            break
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "batches": n,
        "tokens": n_tokens,
        "tokens_per_s": round(n_tokens / seconds),
        "tokens_per_cpu_s": round(n_tokens / cpu),
    }


def synthetic_file(folder: Path, megabytes: float) -> Path:
    works = [
        p.read_bytes().replace(b"\r\n", b"\n")
        for s in ("train", "valid", "test")
        for p in shakespeare_files()[s]
    ]
    block = b"\n\n\n".join(works) + b"\n\n\n"
    target = int(megabytes * 1e6)
    out = folder / "synthetic.txt"
    with open(out, "wb") as f:
        written = 0
        while written < target:
            piece = block[: target - written]
            f.write(piece)
            written += len(piece)
    return out


def tokenize_levels(corpus: Path, data_dir: Path, vocab_size: int) -> dict:
    """char, word and bpe on the same text: prepare (bpe: training included) and encoding."""
    files = sorted(corpus.rglob("*.txt")) if corpus.is_dir() else [corpus]
    text = "".join(f.read_text(encoding="utf-8") for f in files)
    n_bytes = len(text.encode("utf-8"))
    out: dict = {"corpus": corpus.name, "mb": round(n_bytes / 1e6, 2), "levels": {}}
    for level in ("char", "word", "bpe"):
        kw = {"vocab_size": vocab_size} if level == "bpe" else {}
        prep = timed_prepare(f"text:{corpus}", data_dir, level=level, **kw)
        vocab = load_prepared(prep["path"]).vocab
        start, cpu = time.perf_counter(), time.process_time()
        n = len(vocab.encode_array(text))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        out["levels"][level] = {
            "vocab_size": len(vocab),
            "prepare_seconds": prep["seconds"],
            "prepare_cpu_seconds": prep["cpu_seconds"],
            "encode_tokens": n,
            "encode_seconds": round(seconds, 3),
            "encode_tokens_per_s": round(n / seconds),
            "encode_tokens_per_cpu_s": round(n / cpu) if cpu > 0 else None,
            "bytes_per_token": round(n_bytes / n, 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--synthetic-mb", type=float, default=100.0)
    ap.add_argument("--word", action="store_true", help="also time word-level prepares")
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--sections", default="prepare,iterators,tokenize")
    ap.add_argument("--corpus", type=Path, default=None, help="tokenize: a .txt file or folder")
    ap.add_argument("--tokenize-mb", type=float, default=10.0)
    ap.add_argument("--vocab-size", type=int, default=16384, help="tokenize: the bpe size")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    torch.set_num_threads(1)
    result: dict = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "prepare": [],
        "iterators": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "tokenize" in sections:
            corpus = args.corpus or synthetic_file(root, args.tokenize_mb)
            result["tokenize"] = tokenize_levels(corpus, root / "tok", args.vocab_size)
            if args.corpus is None:
                corpus.unlink()
                result["tokenize"]["corpus"] = f"synthetic ({args.tokenize_mb} MB of Shakespeare)"
        if not sections & {"prepare", "iterators"}:
            _emit(result, args.out)
            return
        shakes = timed_prepare("shakespeare", root / "data")
        result["prepare"].append(shakes)
        if args.word:
            result["prepare"].append(timed_prepare("shakespeare", root / "data", level="word"))
        big = synthetic_file(root, args.synthetic_mb)
        synth = timed_prepare(f"text:{big}", root / "data")
        result["prepare"].append(synth)
        if args.word:
            result["prepare"].append(timed_prepare(f"text:{big}", root / "data", level="word"))
        big.unlink()

        corpus = load_prepared(synth["path"])
        train, docs = corpus.split("train"), corpus.doc_starts("train")
        b, length = 32, 512
        its = result["iterators"]
        its["stream_continue_32x512"] = iterate(StreamIterator(train, b, length), args.batches)
        its["stream_reset_32x512"] = iterate(
            StreamIterator(train, b, length, doc_starts=docs, doc_mode="reset"), args.batches
        )
        its["stream_varlen_32x512"] = iterate(
            StreamIterator(train, b, length, varlen=True), args.batches
        )
        # lm1b-like: sentences of about 27 tokens, as many as in the synthetic train split
        rng = np.random.default_rng(0)
        lens = rng.integers(10, 45, len(train) // 30)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        its["sentences_reset_32x512"] = iterate(
            SentenceStreamIterator(
                train[: int(lens.sum())], b, length, doc_starts=starts, doc_mode="reset"
            ),
            args.batches,
        )
    _emit(result, args.out)


def _emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
