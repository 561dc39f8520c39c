"""Each decoding path's log-probabilities against the float32 eager step's, on a trained model.

A checkpoint and a split of its prepared corpus: the split's first ``--tokens`` tokens are
read one a step by a ``Decoder`` of each path, teacher-forced (each step is given the split's
next token, and its log-probabilities of the one after are kept), from the first token on:
the cache fills, then wraps, as in a long generation. For each path: the loss and the
corpus's metric over those tokens, the change of the metric against the float32 eager
step's, and the largest and mean absolute difference of its log-probabilities from that
step's. The paths:

    fp32                the eager float32 step (the reference)
    package             the packaged float32 step (``compile="package"``)
    bf16_package        bf16 weights and cache, packaged
    int8                int8 weights, eager (a float32 cache)
    int8_package        int8 weights, packaged (as shipped: a bf16 cache)
    int8_package_f32kv  int8 weights, packaged over a float32 cache

Packages are made in a scratch TXLM_HOME.

    python benchmarks/decode_accuracy.py CKPT [--data data/shakespeare] [--split test]
                                         [--tokens 4000] [--paths fp32,package,...]

Writes runs/bench/decode_accuracy.json (--out) and prints each row.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_floor import machine, write_result
from decode_package import with_float32_cache
from txlm.checkpoints.checkpoint import load
from txlm.data.prepared import default_data_dir, load_prepared
from txlm.inference.decode import Decoder

RESULTS = Path("runs") / "bench" / "decode_accuracy.json"
PATHS = {
    "fp32": {},
    "package": {"compile": "package"},
    "bf16_package": {"compile": "package", "dtype": torch.bfloat16},
    "int8": {"int8": True},
    "int8_package": {"compile": "package", "int8": True},
    "int8_package_f32kv": {"compile": "package", "int8": True},
}


def log_probs(model, path: str, ids: list[int]) -> torch.Tensor:
    """[N - 1, V]: row i the path's log-probabilities of the token after ids[i]."""
    dec = Decoder(model, **PATHS[path])
    if path.endswith("_f32kv"):
        with_float32_cache(dec)
    rows = [dec.prefill([ids[:1]])[0]]
    rows += [dec.step(torch.tensor([t]))[0] for t in ids[1:-1]]
    return torch.stack(rows).float()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument(
        "--data",
        type=Path,
        default=default_data_dir() / "shakespeare",
        help="the checkpoint's prepared corpus (default: the default corpus's)",
    )
    ap.add_argument("--split", default="test")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    corpus = load_prepared(args.data)
    ids = [int(t) for t in corpus.split(args.split)[: args.tokens]]
    target = torch.tensor(ids[1:])
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    rows, reference = [], None
    try:
        model = load(args.checkpoint)
        with tempfile.TemporaryDirectory() as home, mock.patch.dict(os.environ, TXLM_HOME=home):
            for path in args.paths.split(","):
                lp = log_probs(model, path, ids)
                reference = lp if reference is None else reference
                loss = -lp.gather(1, target[:, None]).mean().item()
                metric = corpus.metric_value(loss, args.split)
                diff = (lp - reference).abs()
                row = {"path": path, "loss": round(loss, 5), corpus.metric: round(metric, 5),
                       "max_abs_diff": float(f"{diff.max().item():.3g}"),
                       "mean_abs_diff": float(f"{diff.mean().item():.3g}")}  # fmt: skip
                if rows:
                    row["metric_change"] = f"{metric / rows[0][corpus.metric] - 1:+.4%}"
                rows.append(row)
                print(row, flush=True)
    finally:
        torch.set_num_threads(saved)
    result = {**machine(args.threads), "checkpoint": str(args.checkpoint), "split": args.split,
              "tokens": len(ids), "rows": rows}  # fmt: skip
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
