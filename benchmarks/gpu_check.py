"""One prepared run for a lent GPU: the CUDA path checked and timed (issue 7's GPU part).

    python benchmarks/gpu_check.py                        # cuda, the wt103-base shape, ~3 min
    python benchmarks/gpu_check.py --device cpu --quick   # the same code on a tiny shape (CI)

In order, into benchmarks/results/gpu_check.json (``--out``):
1. parity: the same weights on the CPU and on the device in float32 (TF32 off), two segments
   with memory: the largest |log p| difference;
2. training, per precision (fp32 with TF32 off, tf32, bf16 autocast): ``--steps`` steps of the
   preset's shape and batch with memory carried, Adam (fused, as ``txlm train``), clip 0.25,
   on a synthetic stream whose next token is a fixed function of the current one (so the loss
   must fall: a broken device path shows). Tokens/s over the steps after warm-up, FLOPs per
   step counted by torch's FLOP counter, MFU against the matmul peak measured here in the same
   precision, peak memory, first and last loss;
3. attention candidates (the choice is made here, by measurement): bf16 training step and
   evaluation forward with the fused kernel (SDPA, position term as an additive bias) and
   with txlm's own math, each with the heads as they are and padded to a multiple of 8
   (txlm.model.align); ms per step and the winner;
4. evaluation: forward tokens/s with 4x the training memory, plain and with the K/V cache;
5. generation: batch 1, ``--new`` tokens after a 512-token context, cached decoder, fp32 and
   bf16, with and without the decoding step captured in a CUDA graph: tokens/s; how far
   bf16's first-step log-probs are from fp32's, and the device's fp32 decoding from the CPU's;
6. ``txlm generate`` end to end (a subprocess, as a user runs it) on the default
   shakespeare-char model shape with random weights: tokens/s as the command reports it.
Every figure is the device's own; nothing here compares against another library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import txlm
from txlm.config import ModelConfig
from txlm.data.vocab import write_text_atomic
from txlm.generate import CachedDecoder
from txlm.model.align import pad_heads
from txlm.model.kv_eval import CachedEvaluator

RESULTS = Path(__file__).parent / "results" / "gpu_check.json"
PRECISIONS = ("fp32", "tf32", "bf16")
SHAPE_FIELDS = ("n_layer", "d_model", "n_head", "d_head", "d_inner", "vocab_size", "tgt_len",
                "mem_len")  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def precision(device: torch.device, name: str) -> Iterator[None]:
    """fp32: float32 matmuls ("highest"); tf32: TF32 allowed ("high"); bf16: autocast with
    float32 elsewhere. Through torch's public matmul-precision setting (no effect on CPUs)."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")
    try:
        if name == "bf16":
            with torch.autocast(device.type, dtype=torch.bfloat16):
                yield
        else:
            yield
    finally:
        torch.set_float32_matmul_precision(saved)


def matmul_peak(device: torch.device, name: str, n: int) -> float:
    """Best GFLOP/s of an n^3 matmul in this precision (bf16: bf16 operands)."""
    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    with precision(device, "tf32" if name == "tf32" else "fp32"):
        for _ in range(5):
            sync(device)
            t = time.perf_counter()
            a @ b
            sync(device)
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def synthetic_stream(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """[batch, length] ids where each next id is (7 * id + 3) mod a 1000-word subset: easy to
    learn, so the loss falls within a few hundred steps on a working device path."""
    g = torch.Generator().manual_seed(seed)
    period = min(vocab, 1000)
    ids = torch.empty(batch, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, period, (batch,), generator=g)
    for t in range(1, length):
        ids[:, t] = (7 * ids[:, t - 1] + 3) % period
    return ids


def build(
    config: ModelConfig, device: torch.device, seed: int = 0, *, padded: bool = False
) -> txlm.TransformerXL:
    torch.manual_seed(seed)
    model = txlm.TransformerXL(config)
    if padded:
        pad_heads(model, multiple=8)
    return model.to(device)


def parity(config: ModelConfig, device: torch.device) -> float:
    cpu = build(config, torch.device("cpu")).eval()
    dev = build(config, torch.device("cpu")).to(device).eval()
    ids = torch.randint(0, config.vocab_size, (2, 2 * config.tgt_len))
    worst = 0.0
    with torch.no_grad(), precision(device, "fp32"):
        mc = md = None
        for seg in ids.split(config.tgt_len, dim=1):
            oc = cpu(seg, mems=mc)
            od = dev(seg.to(device), mems=md)
            mc, md = oc.mems, od.mems
            worst = max(worst, (oc.log_probs - od.log_probs.cpu()).abs().max().item())
    return worst


def count_flops(fn: Callable[[], object]) -> int:
    def baddbmm_(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.bmm_flop(a_shape, b_shape)  # the in-place form is not registered

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.baddbmm_: baddbmm_}) as c:
        fn()
    return c.get_total_flops()


def train(
    config: ModelConfig,
    device: torch.device,
    name: str,
    batch: int,
    steps: int,
    peak: float,
    *,
    padded: bool = False,
) -> dict:
    model = build(config, device, padded=padded).train()
    opt = torch.optim.Adam(model.parameters(), lr=2.5e-4, fused=True)
    length = config.tgt_len * (steps + 1)
    stream = synthetic_stream(config.vocab_size, batch, length + 1, seed=1).to(device)
    state: dict = {"mems": None, "t": 0}

    def step() -> float:
        t = state["t"]
        ids = stream[:, t : t + config.tgt_len]
        labels = stream[:, t + 1 : t + 1 + config.tgt_len]
        state["t"] = (t + config.tgt_len) % (length - config.tgt_len)
        opt.zero_grad(set_to_none=True)
        with precision(device, name):
            out = model(ids, mems=state["mems"], labels=labels)
            loss = out.loss.float()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        state["mems"] = out.mems
        return loss.item()  # a sync per step, as a training loop's logging makes

    first = step()
    flops = count_flops(step)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        losses.append(step())
        sync(device)
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times[len(times) // 5 :])  # after warm-up
    row = {
        "precision": name,
        "padded_heads": padded,
        "steps": steps + 2,
        "tokens_per_s": round(batch * config.tgt_len / sec, 1),
        "ms_per_step": round(sec * 1e3, 2),
        "flops_per_step": flops,
        "tflops": round(flops / sec / 1e12, 4),
        "mfu": round(flops / sec / 1e9 / peak, 3),
        "loss_first": round(first, 4),
        "loss_last": round(statistics.mean(losses[-5:]), 4),
    }
    row["loss_fell"] = row["loss_last"] < 0.9 * row["loss_first"]  # expected on a real run
    if device.type == "cuda":
        row["peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return row


def evaluate(
    config: ModelConfig,
    device: torch.device,
    batch: int,
    mem: int,
    kv: bool,
    name: str,
    segments: int = 6,
    *,
    padded: bool = False,
) -> float:
    model = build(config, device, padded=padded).eval()
    model.set_lengths(mem_len=mem)
    runner = CachedEvaluator(model) if kv else None
    ids = torch.randint(0, config.vocab_size, (batch, config.tgt_len * (segments + 4)))
    ids = ids.to(device)
    mems, times = None, []
    with torch.no_grad(), precision(device, name):
        for i, seg in enumerate(ids.split(config.tgt_len, dim=1)):
            sync(device)
            t0 = time.perf_counter()
            if runner is not None:
                runner(seg, labels=seg)
            else:
                mems = model(seg, mems=mems, labels=seg).mems
            sync(device)
            if i >= 4:  # memory full from here on (mem <= 4 segments in the default shapes)
                times.append(time.perf_counter() - t0)
    return round(batch * config.tgt_len / statistics.median(times), 1)


def generate(
    config: ModelConfig,
    device: torch.device,
    name: str,
    new: int,
    context: int = 512,
    *,
    graph: bool = False,
    padded: bool = False,
) -> tuple[float, Tensor]:
    """Greedy decoding speed (tokens/s), and the log-probs [new, V] of the steps (to compare
    precisions and devices on the same prompt). ``graph``: the step replayed from a CUDA
    graph (CachedDecoder's default on CUDA), else launched op by op."""
    model = build(config, device, padded=padded).eval()
    model.set_lengths(mem_len=max(config.mem_len, context))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, config.vocab_size, (context,), generator=g).tolist()
    rows = []
    with torch.no_grad(), precision(device, name):
        dec = CachedDecoder(model, cuda_graph=graph)
        logp = dec.prefill([prompt])
        logp = dec.step(logp.argmax(-1))  # the first step (with a graph: warm-up, eager)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(new):
            rows.append(logp[0])
            logp = dec.step(logp.argmax(-1))
        sync(device)
    return round(new / (time.perf_counter() - t0), 1), torch.stack(rows).float().cpu()


def attention_choice(
    config: ModelConfig, device: torch.device, batch: int, steps: int, peak: float
) -> dict:
    """bf16 (fp32 on a CPU) training step and 4x-memory evaluation, per attention kernel
    and head padding; the fastest of each wins."""
    name = "bf16" if device.type == "cuda" else "fp32"
    rows = []
    for impl in ("sdpa", "math"):
        cfg = config.replace(attn_impl=impl)
        for padded in (False, True):
            if padded and config.d_head % 8 == 0:
                continue
            t = train(cfg, device, name, batch, steps, peak, padded=padded)
            e = evaluate(cfg, device, batch, 4 * config.mem_len, False, name, padded=padded)
            rows.append(
                {"attn_impl": impl, "padded_heads": padded, "train_ms_per_step": t["ms_per_step"],
                 "train_mfu": t["mfu"], "eval_tokens_per_s": e}
            )  # fmt: skip
    best_train = min(rows, key=lambda r: r["train_ms_per_step"])
    best_eval = max(rows, key=lambda r: r["eval_tokens_per_s"])
    return {
        "precision": name,
        "candidates": rows,
        "train_winner": {k: best_train[k] for k in ("attn_impl", "padded_heads")},
        "eval_winner": {k: best_eval[k] for k in ("attn_impl", "padded_heads")},
    }


def generate_cli(device: torch.device, new: int, quick: bool) -> dict:
    """``txlm generate`` as a user runs it (a new process: imports, checkpoint load, prompt,
    decoding, text out), on the default model's shape; tokens/s as the command reports it."""
    import os
    import subprocess
    import tempfile
    from collections import Counter

    from txlm.data.vocab import Vocab

    vocab = Vocab.build_char(
        Counter("abcdefghijklmnopqrstuvwxyz ,.;:!?'\nABCDEFGHIJKLMNOPQRSTUVWXYZ")
    )
    preset = "debug" if quick else "shakespeare-char"
    config = ModelConfig.from_preset(preset, vocab_size=len(vocab))
    out: dict = {"preset": preset}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = txlm.save(build(config, torch.device("cpu")), Path(tmp) / "ckpt",
                         vocab_json=vocab.to_json())  # fmt: skip
        for compiled in (False, True) if device.type == "cuda" else (False,):
            cmd = [sys.executable, "-m", "txlm", "generate", str(ckpt), "--prompt", "ROMEO:",
                   "--max-new-tokens", str(new), "--device", str(device), "--seed", "0",
                   "--json"] + (["--compile"] if compiled else [])  # fmt: skip
            t0 = time.perf_counter()
            run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            wall = time.perf_counter() - t0
            key = "compiled" if compiled else "eager"
            if run.returncode != 0:
                out[key] = {"error": run.stderr.strip().splitlines()[-1:]}
                continue
            report = json.loads(run.stdout)
            out[key] = {"tokens_per_s": report["tokens_per_s"], "process_wall_s": round(wall, 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="wt103-base")
    ap.add_argument("--batch", type=int, default=60, help="rows per step (the paper's wt103: 60)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--new", type=int, default=128, help="generated tokens per measurement")
    ap.add_argument("--quick", action="store_true", help="tiny shape, few steps (a smoke run)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if args.quick:
        config = ModelConfig.from_preset("debug", d_head=6)  # 6: the padded heads run too
        batch, steps, new, peak_n = 2, 3, 4, 256
        precisions = ("fp32", "bf16")
    else:
        config = ModelConfig.from_preset(args.preset)
        batch, steps, new, peak_n = args.batch, args.steps, args.new, 8192
        precisions = PRECISIONS if device.type == "cuda" else ("fp32", "bf16")

    peaks = {p: round(matmul_peak(device, p, peak_n), 1) for p in precisions}
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "machine": platform.machine(),
        "preset": "debug" if args.quick else args.preset,
        "model": {k: getattr(config, k) for k in SHAPE_FIELDS},
        "batch": batch,
        "matmul_peak_gflops": peaks,
        "parity_max_abs_logprob_diff_vs_cpu": parity(config, device),
        "train": [train(config, device, p, batch, steps, peaks[p]) for p in precisions],
    }
    mem = 4 * config.mem_len
    result["eval"] = {
        f"{p}_mem{mem}": {
            "tokens_per_s": evaluate(config, device, batch, mem, False, p),
            "kv_cache_tokens_per_s": evaluate(config, device, batch, mem, True, p),
        }
        for p in precisions
    }
    result["attention"] = attention_choice(config, device, batch, max(steps // 4, 2), peaks[
        "bf16" if device.type == "cuda" else "fp32"])  # fmt: skip
    graphs = (False, True) if device.type == "cuda" else (False,)
    decoded = {
        (p, g): generate(config, device, p, new, graph=g) for p in ("fp32", "bf16") for g in graphs
    }
    result["generate_tokens_per_s"] = {
        p + ("_cuda_graph" if g else ""): rate for (p, g), (rate, _) in decoded.items()
    }
    # bf16 against fp32 on the same prompt, first step (later ones may follow other tokens)
    first = [decoded[p, False][1][0] for p in ("fp32", "bf16")]
    result["generate_bf16_first_step_max_abs_logprob_diff"] = (
        (first[0] - first[1]).abs().max().item()
    )
    # the device's fp32 decoding (graph-replayed on CUDA) against the CPU's, every step
    _, cpu_logp = generate(config, torch.device("cpu"), "fp32", min(new, 16))
    dev_logp = decoded["fp32", graphs[-1]][1][: cpu_logp.size(0)]
    result["generate_parity_max_abs_logprob_diff_vs_cpu"] = (dev_logp - cpu_logp).abs().max().item()
    result["txlm_generate_cli"] = generate_cli(device, 64 if args.quick else 1000, args.quick)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    text = json.dumps(result, indent=2)
    print(text)
    write_text_atomic(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
