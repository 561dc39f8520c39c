"""txlm against transformers 4.37.2 TransfoXL: same configs, same weights, same process.

    python benchmarks/compare.py                   # both configs, fp32 + bf16, JSON to runs/bench/
    python benchmarks/compare.py --quick           # one round, small: a smoke run (~1 min)
    python benchmarks/compare.py --configs cpu --dtypes fp32 --rounds 7

What is measured, per config and dtype (bf16 = CPU autocast for both libraries):
- train     one optimisation step (forward with memory, per-token loss mean, backward, Adam)
            on a [B, L] segment with M memory, dropout as configured, tokens/s = B*L / time;
- eval_mN   evaluation forward (no_grad, eval mode) of a [B, L] segment with memory N, the
            memory already full, carried from segment to segment;
- generate  greedy decoding of one row, one token at a time with long memory (mem_len 512,
            a 512-token context read first, not timed, so the memory is full). txlm uses
            its cached decoder (txlm.inference.decode.Decoder).
- eval with txlm_kv: the same evaluation through txlm.inference.kv_eval.CachedEvaluator.
Every workload alternates between the two libraries round by round (order flipped each
round) and reports medians over rounds: the machine is shared and noisy, so only figures
taken side by side are compared. The fp32 matmul peak (2048^3, same threads) is measured in
the same rounds; model FLOPs utilisation (MFU) = model FLOPs per second / that peak.

Model FLOPs (matmul work the model needs, the causal half of the score matrices included
because both libraries compute it), per segment of B rows, L tokens, K = M + L keys, with
D d_model, I = H * Dh, F d_inner, V vocabulary, n layers:

  forward = n * [ 2BL*D*I (queries) + 2BK*D*2I (keys/values of memory and segment)
                  + 2(K+1)*D*I (W_kR R) + 2BL*K*I * 2 + 2BL*(K+1)*I (scores, positions, values)
                  + 2BL*I*D (output) + 4BL*D*F (feed-forward) ] + 2BL*D*V (softmax)
  train   = 3 * forward - n * [2BM*D*2I + 2(K+1)*D*I]   (backward = 2x forward, except
            that the detached memory needs no input gradient of its K/V projection, nor
            the constant R of W_kR R)

Peak memory is the largest number of bytes held at once by tensors created during one step
(counted by a dispatch mode that sees every op's outputs), in a separate, untimed run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import txlm
from txlm.checkpoints.convert import hf_config_to_model_config, load_hf_state_dict

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from transformers import TransfoXLConfig, TransfoXLLMHeadModel

try:
    from txlm.atomic import write_text
except ImportError:  # a revision before txlm.atomic (profile_step.py counts old code too)
    from txlm.data.vocab import write_text_atomic as write_text

try:
    from txlm.inference.decode import Decoder
# a revision before txlm.inference.decode.Decoder (profile_step.py counts old code)
except ImportError:
    try:
        from txlm.inference.decode import CachedDecoder as Decoder
    except ImportError:
        from txlm.inference.generate import CachedDecoder as Decoder
from txlm.inference.kv_eval import CachedEvaluator

# scratch by default (under the current directory, as txlm train's runs/); --out
# benchmarks/results/compare.json updates the committed one
RESULTS = Path("runs") / "bench" / "compare.json"


@dataclass(frozen=True)
class Shape:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    d_head: int
    d_inner: int
    vocab: int = 204  # enwik8's byte vocabulary: a full softmax, as the paper's enwik8 runs
    batch: int = 8
    tgt_len: int = 128
    mem_len: int = 128


SHAPES = {
    # The project's CPU anchor config (the original code ~1.7k tokens/s training on 2 cores).
    "cpu": Shape("cpu", n_layer=4, d_model=256, n_head=8, d_head=32, d_inner=1024),
    # enwik8-base's layer shape (Table 2: 512, 8x64, 2048) with 4 of its 12 layers.
    "d512": Shape("d512", n_layer=4, d_model=512, n_head=8, d_head=64, d_inner=2048),
}
GEN_MEM, GEN_CONTEXT, GEN_NEW = 512, 512, 32


# -- FLOPs ----------------------------------------------------------------------------------
def forward_flops(s: Shape, mem: int, batch: int | None = None, qlen: int | None = None) -> float:
    """Matmul FLOPs of one forward over [B, L] with ``mem`` memory (see the module doc)."""
    b = s.batch if batch is None else batch
    length = s.tgt_len if qlen is None else qlen
    k = mem + length
    inner = s.n_head * s.d_head
    d = s.d_model
    per_layer = (
        2 * b * length * d * inner  # queries
        + 2 * b * k * d * 2 * inner  # keys, values
        + 2 * (k + 1) * d * inner  # W_kR R
        + 2 * b * length * inner * (k + (k + 1) + k)  # content, position scores; values
        + 2 * b * length * inner * d  # output projection
        + 4 * b * length * d * s.d_inner  # feed-forward
    )
    return s.n_layer * per_layer + 2 * b * length * d * s.vocab


def train_flops(s: Shape) -> float:
    """3x the forward, less the input gradients nothing needs: the memory's rows of the K/V
    projection (the memory is a constant) and R in W_kR R (a constant table)."""
    inner = s.n_head * s.d_head
    klen = s.mem_len + s.tgt_len
    no_input_grad = s.n_layer * (
        2 * s.batch * s.mem_len * s.d_model * 2 * inner + 2 * (klen + 1) * s.d_model * inner
    )
    return 3 * forward_flops(s, s.mem_len) - no_input_grad


# -- models ---------------------------------------------------------------------------------
def build_pair(s: Shape, seed: int = 0) -> tuple[TransfoXLLMHeadModel, txlm.TransformerXL]:
    """An HF model with random weights and a txlm model holding exactly the same tensors."""
    torch.manual_seed(seed)
    hf_cfg = TransfoXLConfig(
        vocab_size=s.vocab,
        cutoffs=[],
        adaptive=False,
        d_model=s.d_model,
        d_embed=s.d_model,
        n_head=s.n_head,
        d_head=s.d_head,
        d_inner=s.d_inner,
        div_val=1,
        n_layer=s.n_layer,
        mem_len=s.mem_len,
        clamp_len=-1,
        same_length=False,
        untie_r=False,  # the paper's global u, v
        dropout=0.1,
        dropatt=0.0,
    )
    hf = TransfoXLLMHeadModel(hf_cfg)
    cfg = hf_config_to_model_config(hf_cfg.to_dict()).replace(tgt_len=s.tgt_len)
    tx = load_hf_state_dict(hf.state_dict(), cfg)
    return hf, tx


def set_mem_len(hf: TransfoXLLMHeadModel, tx: txlm.TransformerXL, mem_len: int) -> None:
    """HF's memory length is state of the model; txlm's lengths are passed per call."""
    hf.reset_memory_length(mem_len)


def hf_empty_mems(hf: TransfoXLLMHeadModel, batch: int) -> list[torch.Tensor]:
    """HF's mems=None means mem_len zero vectors; start it from empty memory like txlm."""
    p = next(hf.parameters())
    return [torch.empty(0, batch, hf.config.d_model, dtype=p.dtype) for _ in hf.transformer.layers]


def parity(hf: TransfoXLLMHeadModel, tx: txlm.TransformerXL, s: Shape) -> float:
    """Max |log p| difference over two eval segments with memory (fp32)."""
    hf.eval()
    tx.eval()
    ids = torch.randint(0, s.vocab, (2, 2 * 16))
    worst = 0.0
    with torch.no_grad():
        hm, tm = hf_empty_mems(hf, 2), None
        for seg in ids.split(16, dim=1):
            ho = hf(seg, mems=hm)
            to = tx(seg, mems=tm)
            hm, tm = ho.mems, to.mems
            worst = max(worst, (ho.prediction_scores - to.log_probs).abs().max().item())
    return worst


# -- workloads: each returns a callable that runs `reps` units and the tokens per unit -------
class Workload:
    def __init__(self, name: str, tokens: int, flops: float | None) -> None:
        self.name, self.tokens, self.flops = name, tokens, flops


def autocast(dtype: str):
    if dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_train(lib: str, model, s: Shape, dtype: str) -> Callable[[], None]:
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    state: dict = {"mems": hf_empty_mems(model, s.batch) if lib == "hf" else None}

    def step() -> None:
        ids = torch.randint(0, s.vocab, (s.batch, s.tgt_len), generator=gen)
        opt.zero_grad(set_to_none=True)
        with autocast(dtype):
            if lib == "hf" and dtype == "bf16":
                # HF's loss path fails under bf16 autocast (index_put of bf16 losses into a
                # float32 buffer): same full log-softmax through its log-prob path instead.
                out = model(ids, mems=state["mems"])
                logp = out.prediction_scores[:, :-1].float()
                loss = -logp.gather(-1, ids[:, 1:, None]).mean()
            elif lib == "hf":  # HF shifts labels inside and returns the mean
                out = model(ids, mems=state["mems"], labels=ids)
                loss = out.loss
            else:  # txlm: per-token NLL
                out = model(ids, mems=state["mems"], labels=ids)
                loss = out.loss
        loss.backward()
        opt.step()
        state["mems"] = out.mems

    return step


def make_eval(lib: str, model, s: Shape, dtype: str, mem: int) -> Callable[[], None]:
    """lib "hf", "txlm" (the plain forward) or "txlm_kv" (CachedEvaluator: memory K/V kept)."""
    gen = torch.Generator().manual_seed(2)
    state: dict = {"mems": hf_empty_mems(model, s.batch) if lib == "hf" else None}
    kw = {} if lib == "hf" else {"lengths": model.lengths.replace(mem_len=mem)}
    runner = CachedEvaluator(model, **kw) if lib == "txlm_kv" else None

    def step() -> None:
        model.eval()
        if lib == "hf":
            model.reset_memory_length(mem)
        ids = torch.randint(0, s.vocab, (s.batch, s.tgt_len), generator=gen)
        with torch.no_grad(), autocast(dtype):
            if runner is not None:
                runner(ids, labels=ids)
                return
            # HF's loss path fails under bf16 autocast (index_put of bf16 losses into a
            # float32 buffer); its log-prob path costs the same at this vocabulary size.
            labels = None if lib == "hf" and dtype == "bf16" else ids
            out = model(ids, mems=state["mems"], labels=labels, **kw)
        state["mems"] = out.mems

    # fill the memory first: timed segments all see `mem` memory positions
    for _ in range(math.ceil(mem / s.tgt_len)):
        step()
    return step


def make_generate(lib: str, model, s: Shape, dtype: str, new: int) -> Callable[[], None]:
    """Decode ``new`` tokens greedily after a GEN_CONTEXT-token context (read untimed)."""
    gen = torch.Generator().manual_seed(3)
    context = torch.randint(0, s.vocab, (1, GEN_CONTEXT), generator=gen)

    def run() -> None:
        model.eval()
        with torch.no_grad(), autocast(dtype):
            if lib == "hf":
                model.reset_memory_length(GEN_MEM)
                mems = hf_empty_mems(model, 1)
                # the context in tgt_len segments, as the paper's Appendix E reads it
                for seg in context.split(s.tgt_len, dim=1):
                    out = model(seg, mems=mems)
                    mems = out.mems
                tok = out.prediction_scores[:, -1].argmax(-1, keepdim=True)
                t0 = time.perf_counter()
                for _ in range(new):
                    out = model(tok, mems=out.mems)
                    tok = out.prediction_scores[:, -1].argmax(-1, keepdim=True)
            else:
                dec = Decoder(model, lengths=model.lengths.replace(mem_len=GEN_MEM))
                logp = dec.prefill(context.tolist())
                t0 = time.perf_counter()
                for _ in range(new):
                    logp = dec.step(logp.argmax(-1))
        run.elapsed = time.perf_counter() - t0  # type: ignore[attr-defined]

    return run


# -- memory ---------------------------------------------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Tracks bytes of storages created by ops while active; ``peak`` is the maximum held."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen: weakref.WeakSet = weakref.WeakSet()

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st not in self.seen:
                    self.seen.add(st)
                    self.live += st.nbytes()
                    weakref.finalize(st, self._free, st.nbytes())
                    self.peak = max(self.peak, self.live)
        return out


def peak_mib(fn: Callable[[], None]) -> float:
    fn()  # warm: optimizer state etc. exist before we count
    with LiveBytes() as mode:
        fn()
    return mode.peak / 2**20


# -- timing ---------------------------------------------------------------------------------
def cpu_name() -> str:
    """The CPU's model name as the OS reports it: a speed ratio belongs to the CPU it was
    measured on as much as to the code."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def matmul_gflops(n: int = 2048, reps: int = 3, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def timed(fn: Callable[[], None], reps: int) -> float:
    """Seconds per unit; generation units time themselves (context reading excluded)."""
    total = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        elapsed = getattr(fn, "elapsed", None)
        total += elapsed if elapsed is not None else time.perf_counter() - t
    return total / reps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="cpu,d512")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--workloads", default="train,eval_m128,eval_m512,generate")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop adding rounds after")
    ap.add_argument("--quick", action="store_true", help="one round, no memory pass")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.no_memory = 1, True
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    shapes = [SHAPES[n] for n in args.configs.split(",")]
    dtypes = args.dtypes.split(",")
    kinds = args.workloads.split(",")
    pairs = {s.name: build_pair(s) for s in shapes}
    checks = {name: parity(hf, tx, SHAPES[name]) for name, (hf, tx) in pairs.items()}

    # one (hf, txlm) callable pair per workload
    jobs: list[tuple[Workload, str, str, dict[str, Callable[[], None]]]] = []
    for s in shapes:
        hf, tx = pairs[s.name]
        for dtype in dtypes:
            for kind in kinds:
                if kind == "train":
                    w = Workload(kind, s.batch * s.tgt_len, train_flops(s))
                    fns = {
                        lib: make_train(lib, m, s, dtype) for lib, m in (("hf", hf), ("txlm", tx))
                    }
                elif kind.startswith("eval_m"):
                    mem = int(kind.removeprefix("eval_m"))
                    w = Workload(kind, s.batch * s.tgt_len, forward_flops(s, mem))
                    fns = {
                        lib: make_eval(lib, m, s, dtype, mem)
                        for lib, m in (("hf", hf), ("txlm", tx), ("txlm_kv", tx))
                    }
                elif kind == "generate":
                    # no MFU: with a K/V cache the work per token is not the forward's
                    w = Workload(kind, GEN_NEW, None)
                    fns = {
                        lib: make_generate(lib, m, s, dtype, GEN_NEW)
                        for lib, m in (("hf", hf), ("txlm", tx))
                    }
                else:
                    raise SystemExit(f"unknown workload {kind!r}")
                jobs.append((w, s.name, dtype, fns))
                # leave each model in its training-time lengths for the next workload
                set_mem_len(hf, tx, s.mem_len)

    times: dict[tuple[str, str, str, str], list[float]] = {}
    peaks: list[float] = []
    peaks_bf16: list[float] = []
    for r in range(args.rounds):
        peaks.append(matmul_gflops())
        if "bf16" in dtypes:
            peaks_bf16.append(matmul_gflops(dtype=torch.bfloat16))
        for w, shape, dtype, fns in jobs:
            order = list(fns) if r % 2 == 0 else list(fns)[::-1]
            for lib in order:
                sec = timed(fns[lib], reps=1)
                times.setdefault((shape, dtype, w.name, lib), []).append(sec)
            for s in shapes:  # restore lengths the next job expects
                set_mem_len(*pairs[s.name], s.mem_len)
        elapsed = time.perf_counter() - start
        print(f"round {r + 1}/{args.rounds} done at {elapsed:.0f}s", file=sys.stderr)
        if r >= 2 and elapsed > args.budget_s:
            print("time budget reached: stopping rounds", file=sys.stderr)
            break
    peak = statistics.median(peaks)
    peak_bf16 = statistics.median(peaks_bf16) if peaks_bf16 else None

    rows = []
    for w, shape, dtype, fns in jobs:
        med = {lib: statistics.median(times[(shape, dtype, w.name, lib)]) for lib in fns}
        row = {
            "config": shape,
            "dtype": dtype,
            "workload": w.name,
            "hf_tokens_per_s": round(w.tokens / med["hf"], 1),
            "txlm_tokens_per_s": round(w.tokens / med["txlm"], 1),
            "speedup": round(med["hf"] / med["txlm"], 2),
            # each round's own ratio (the two libraries ran back to back): the spread
            "speedup_rounds": [
                round(h / t, 2)
                for h, t in zip(
                    times[(shape, dtype, w.name, "hf")],
                    times[(shape, dtype, w.name, "txlm")],
                    strict=True,
                )
            ],
            "rounds": len(times[(shape, dtype, w.name, "hf")]),
        }
        if "txlm_kv" in med:  # evaluation with the memory's keys/values kept
            row["txlm_kv_tokens_per_s"] = round(w.tokens / med["txlm_kv"], 1)
            row["speedup_kv"] = round(med["hf"] / med["txlm_kv"], 2)
        if w.flops is not None:
            row["txlm_gflops"] = round(w.flops / med["txlm"] / 1e9, 1)
            # MFU against the fp32 peak (one yardstick for both dtypes); bf16 also against its own
            row["txlm_mfu"] = round(w.flops / med["txlm"] / 1e9 / peak, 3)
            row["hf_mfu"] = round(w.flops / med["hf"] / 1e9 / peak, 3)
            if dtype == "bf16" and peak_bf16:
                row["txlm_mfu_bf16_peak"] = round(w.flops / med["txlm"] / 1e9 / peak_bf16, 3)
        if w.name == "generate":
            row["txlm_kv_cache"] = True
        rows.append(row)

    memory = []
    if not args.no_memory:
        for s in shapes:
            hf, tx = pairs[s.name]
            for kind in ("train", "eval_m512"):
                entry = {"config": s.name, "dtype": "fp32", "workload": kind}
                for lib, m in (("hf", hf), ("txlm", tx)):
                    if kind == "train":
                        fn = make_train(lib, m, s, "fp32")
                    else:
                        fn = make_eval(lib, m, s, "fp32", 512)
                    entry[f"{lib}_peak_mib"] = round(peak_mib(fn), 1)
                    set_mem_len(hf, tx, s.mem_len)
                memory.append(entry)

    result = {
        "benchmark": "txlm vs transformers TransfoXL, interleaved, medians over rounds",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": args.threads,
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "fp32_matmul_peak_gflops": round(peak, 1),
        "fp32_matmul_peak_rounds": [round(p, 1) for p in peaks],
        "bf16_matmul_peak_gflops": round(peak_bf16, 1) if peak_bf16 else None,
        "bf16_matmul_peak_rounds": [round(p, 1) for p in peaks_bf16],
        "parity_max_abs_logprob_diff": checks,
        "shapes": {s.name: s.__dict__ for s in shapes},
        "generation": {"mem_len": GEN_MEM, "context": GEN_CONTEXT, "new_tokens": GEN_NEW},
        "results": rows,
        "peak_memory": memory,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    write_text(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
