"""txlm against the Hugging Face anchor (transformers 4.37.2 TransfoXLLMHeadModel), same weights.

    .venv/bin/python benchmarks/bench_hf_baseline.py [--rounds 7] [--threads 2]

The project's CPU anchor config: 4 layers, d_model 256, 8 heads x 32, d_inner 1024, a full softmax
over a 10,000-word vocabulary (no cutoffs: the PTB-sized vocabulary, where the softmax is
~40% of the FLOPs), batch 8 x tgt_len 128, mem_len 128, fp32, dropout 0.1, dropatt 0.

A random HF model is saved and converted with ``txlm.checkpoints.convert``, so both models start
from
identical weights. Both then run interleaved in this process, in alternating order each
round, with memory carried across steps (full 128-position memory from the first timed step):
- train: forward + backward + Adam step (lr 2.5e-4), train mode (dropout on);
- eval: forward under no_grad, eval mode;
- generate: whole ``generate`` calls as a user times them (decoder set-up, a 256-token prompt
  read, 64 new tokens drawn from the top 40: HF's ``generate(do_sample=True, top_k=40)``,
  ``txlm.generate(top_k=40)``), eval mode; tokens/s counts the new tokens.
Reported: median tokens/s over rounds (wall clock, and per CPU-second of this process, which
a shared machine disturbs less), txlm/HF ratios, and model FLOPs utilisation (wall clock)
against the fp32 matmul peak measured here. JSON to stdout and runs/bench/hf_baseline.json (--out).
Not part of the test suite; about 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import txlm
from txlm.atomic import write_json
from txlm.checkpoints.convert import convert_hf

SHAPE = dict(
    vocab_size=10000,
    cutoffs=[],
    d_model=256,
    d_embed=256,
    n_head=8,
    d_head=32,
    d_inner=1024,
    div_val=1,
    n_layer=4,
    mem_len=128,
    clamp_len=-1,
    same_length=False,
    untie_r=False,
    pre_lnorm=False,
    dropout=0.1,
    dropatt=0.0,
)
BATCH, TGT_LEN = 8, 128
GEN_PROMPT, GEN_NEW, GEN_TOP_K = 256, 64, 40


def matmul_peak_gflops(seconds: float = 2.0) -> float:
    """Best fp32 GEMM rate (1024^3) on the current thread count."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * 1024**3 / (time.perf_counter() - t))
    return best / 1e9


def forward_flops_per_token(s: dict, qlen: int, mlen: int) -> float:
    """Matmul FLOPs per predicted token of one forward (what the model must compute).

    Queries come from the segment only; keys/values and W_kR R span K = M + L positions.
    """
    d, hd, k = s["d_model"], s["n_head"] * s["d_head"], mlen + qlen
    per_layer = (
        2 * d * hd  # queries
        + 2 * 2 * d * hd * k / qlen  # keys and values of memory + segment
        + 2 * d * hd * (k + 1) / qlen  # W_kR R, one row per distance
        + 3 * 2 * hd * k  # content scores, position scores, probs @ values
        + 2 * hd * d  # output projection
        + 2 * 2 * d * s["d_inner"]  # feed-forward
    )
    return s["n_layer"] * per_layer + 2 * s["d_embed"] * s["vocab_size"]


def build(tmp: Path):
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = TransfoXLLMHeadModel(TransfoXLConfig(**SHAPE))
    hf.save_pretrained(tmp / "hf")
    convert_hf(tmp / "hf", tmp / "tx")
    tx = txlm.load(tmp / "tx")
    return hf, tx


class Runner:
    """One model's training and evaluation loops, memory carried across calls."""

    def __init__(self, name: str, model, data: torch.Tensor) -> None:
        self.name, self.model, self.data = name, model, data
        self.opt = torch.optim.Adam(model.parameters(), lr=2.5e-4)
        self.pos = 0
        self.train_mems = None
        self.eval_mems = None

    def _segment(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.data.size(1) - 1
        if self.pos + TGT_LEN > n:
            self.pos = 0
        x = self.data[:, self.pos : self.pos + TGT_LEN]
        y = self.data[:, self.pos + 1 : self.pos + TGT_LEN + 1]
        self.pos += TGT_LEN
        return x, y

    def train_step(self) -> None:
        self.model.train()
        x, y = self._segment()
        if self.name == "hf":
            # HF predicts labels[:, t + 1] at position t: hand it the targets shifted right.
            labels = torch.cat([x[:, :1], y], dim=1)[:, :TGT_LEN]
            out = self.model(x, mems=self.train_mems, labels=labels)
            loss = out.loss
        else:
            out = self.model(x, mems=self.train_mems, labels=y)
            loss = out.loss
        self.train_mems = out.mems
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    @torch.no_grad()
    def generate_call(self) -> None:
        self.model.eval()
        prompt = self.data[0, :GEN_PROMPT]
        self.calls = getattr(self, "calls", 0) + 1
        if self.name == "hf":
            torch.manual_seed(self.calls)
            self.model.generate(
                prompt[None], max_new_tokens=GEN_NEW, min_new_tokens=GEN_NEW, do_sample=True,
                top_k=GEN_TOP_K, pad_token_id=0,
            )  # fmt: skip
        else:
            txlm.generate(
                self.model, prompt, max_new_tokens=GEN_NEW, top_k=GEN_TOP_K, seed=self.calls
            )

    @torch.no_grad()
    def eval_step(self) -> None:
        self.model.eval()
        x, _ = self._segment()
        out = self.model(x, mems=self.eval_mems)
        self.eval_mems = out.mems


def timed(fn, steps: int, tokens_per_step: int = BATCH * TGT_LEN) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process).

    The machine is shared: wall-clock rates move with other people's load, CPU time much
    less (it still counts OpenMP threads that spin while waiting for a core).
    """
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    tokens = steps * tokens_per_step
    return tokens / (time.perf_counter() - t), tokens / (time.process_time() - c)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--train-steps", type=int, default=2, help="timed train steps per round")
    ap.add_argument("--eval-steps", type=int, default=4, help="timed eval steps per round")
    ap.add_argument("--generate-calls", type=int, default=1, help="timed calls per round")
    ap.add_argument("--kinds", default="train,eval,generate", help="comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    # scratch by default (under the current directory, as txlm train's runs/); --out
    # benchmarks/results/hf_baseline.json updates the committed one
    scratch = Path("runs") / "bench" / "hf_baseline.json"
    ap.add_argument("--out", type=Path, default=scratch)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        hf, tx = build(Path(tmp))
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, SHAPE["vocab_size"], (BATCH, 16 * TGT_LEN + 1), generator=g)
    runners = {"hf": Runner("hf", hf, data), "txlm": Runner("txlm", tx, data)}
    kinds = args.kinds.split(",")
    for r in runners.values():  # warm-up; fills the memory to mem_len
        for _ in range(2):
            if "train" in kinds:
                r.train_step()
            if "eval" in kinds:
                r.eval_step()

    plan = {
        "train": (args.train_steps, BATCH * TGT_LEN),
        "eval": (args.eval_steps, BATCH * TGT_LEN),
        "generate": (args.generate_calls, GEN_NEW),
    }
    if "generate" in kinds:
        for r in runners.values():  # warm-up
            r.generate_call()
    rates: dict[str, dict[str, list[float]]] = {k: {n: [] for n in kinds} for k in ("hf", "txlm")}
    cpu_rates: dict[str, dict[str, list[float]]] = {
        k: {n: [] for n in kinds} for k in ("hf", "txlm")
    }
    for rnd in range(args.rounds):
        order = ["hf", "txlm"] if rnd % 2 == 0 else ["txlm", "hf"]
        for kind in kinds:
            steps, tokens = plan[kind]
            for name in order:
                runner = runners[name]
                fn = {"train": runner.train_step, "eval": runner.eval_step,
                      "generate": runner.generate_call}[kind]  # fmt: skip
                wall, cpu = timed(fn, steps, tokens)
                rates[name][kind].append(wall)
                cpu_rates[name][kind].append(cpu)
        print(
            f"round {rnd + 1}/{args.rounds}: "
            + ", ".join(
                f"{n} " + " ".join(f"{k} {rates[n][k][-1]:.0f}" for k in kinds) + " tok/s"
                for n in ("hf", "txlm")
            ),
            file=sys.stderr,
        )

    peak = matmul_peak_gflops()
    fwd = forward_flops_per_token(SHAPE, TGT_LEN, SHAPE["mem_len"])
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in rates.items()}
    cpu_med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in cpu_rates.items()}
    result = {
        "benchmark": "hf_baseline",
        "anchor": "transformers 4.37.2 TransfoXLLMHeadModel, same converted weights",
        "config": {**SHAPE, "batch": BATCH, "tgt_len": TGT_LEN, "dtype": "float32"},
        "threads": args.threads,
        "rounds": args.rounds,
        "tokens_per_s": {n: {k: round(v, 1) for k, v in d.items()} for n, d in med.items()},
        "ratio_txlm_over_hf": {k: round(med["txlm"][k] / med["hf"][k], 3) for k in kinds},
        # each round's own ratio (the two ran back to back): the spread
        "ratio_rounds": {
            k: [round(t / h, 3) for t, h in zip(rates["txlm"][k], rates["hf"][k], strict=True)]
            for k in kinds
        },
        "generate": {"prompt": GEN_PROMPT, "new_tokens": GEN_NEW, "top_k": GEN_TOP_K},
        "tokens_per_cpu_s": {n: {k: round(v, 1) for k, v in d.items()} for n, d in cpu_med.items()},
        "cpu_ratio_txlm_over_hf": {
            k: round(cpu_med["txlm"][k] / cpu_med["hf"][k], 3) for k in kinds
        },
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        "per_round": rates,
        "matmul_peak_gflops": round(peak, 1),
        "model_gflop_per_token": {"forward": fwd / 1e9, "train": 3 * fwd / 1e9},
        "mfu": {
            n: {
                k: round(med[n][k] * (3 if k == "train" else 1) * fwd / (peak * 1e9), 3)
                for k in kinds
                if k != "generate"  # decoding is not the forward's work per token
            }
            for n in med
        },
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
