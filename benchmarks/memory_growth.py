"""Long-run stability: resident memory of streaming evaluation over >= 10,000 segments.

Streaming evaluation carries each layer's memory from one segment to the next for the whole
run. A leak here grows without bound: an autograd graph kept alive through the memory (the
memory must be detached, paper Eq. 1 SG), a cache keyed by segment length, or a list of
per-segment tensors that nobody frees. This script streams the ``debug`` model over N
segments with memory carried and compares resident memory (VmRSS) at the end with its value
after the first ``--warmup`` segments, by which point allocator pools and lazily built
kernels have settled.

    .venv/bin/python benchmarks/memory_growth.py                  # 10,000 segments
    .venv/bin/python benchmarks/memory_growth.py --segments 20000 --limit 0.05

Both engines run in this one process, one after the other:
  - ``model``: the model's forward under torch.no_grad() in eval mode (what txlm.evaluate does);
  - ``anchor``: transformers 4.37.2 TransfoXLLMHeadModel of the same shape (``--anchor``), for
    a side-by-side figure, in a child process so that its RSS is its own.

Writes benchmarks/results/memory_growth.json (and prints it). Exit status 1 when txlm's growth
exceeds ``--limit`` (default 5%).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def rss_kib() -> int:
    """Resident set size of this process in KiB, from /proc (psutil is not a dependency)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def settle() -> int:
    """RSS after a garbage collection: what is still referenced, not what awaits collection."""
    gc.collect()
    return rss_kib()


def stream_txlm(args: argparse.Namespace, tokens: torch.Tensor) -> dict:
    from txlm.config import ModelConfig
    from txlm.model import TransformerXL

    torch.manual_seed(0)
    config = ModelConfig.from_preset("debug")
    # Evaluate with the preset's evaluation lengths (longer memory than training).
    model = TransformerXL(config).eval()
    model.set_lengths(tgt_len=args.tgt_len, mem_len=args.mem_len)
    B, L = args.batch_size, args.tgt_len
    mems = None
    mem_mask = None
    total_nll = 0.0
    samples: list[tuple[int, int]] = []
    leak: list[list[torch.Tensor]] = []  # only filled with --inject-leak
    base = None
    t0 = time.perf_counter()
    with torch.no_grad():
        for s in range(args.segments):
            # Row b reads its own contiguous stretch of the token stream (Sec. 3.2 layout).
            start = s * L
            x = tokens[:, start : start + L]
            y = tokens[:, start + 1 : start + L + 1]
            out = model(x, mems=mems, labels=y, mem_mask=mem_mask)
            mems, mem_mask = out.mems, out.mem_mask
            if args.inject_leak:  # the "growing cache" bug this benchmark exists to catch
                leak.append(out.mems)
            # .item(): the running figure is a Python float, never a tensor chained across
            # segments (a tensor sum would be harmless under no_grad, but a float is the habit
            # that stays harmless when someone removes the no_grad).
            total_nll += out.loss.sum().item()
            done = s + 1
            if done == args.warmup:
                base = settle()
            if done % args.sample_every == 0 or done == args.segments:
                samples.append((done, settle()))
    elapsed = time.perf_counter() - t0
    end = settle()
    assert base is not None
    n_tok = args.segments * B * L
    return {
        "engine": "txlm",
        "segments": args.segments,
        "rss_kib_after_warmup": base,
        "rss_kib_end": end,
        "growth": (end - base) / base,
        "growth_kib": end - base,
        "rss_kib_max_sampled": max(r for _, r in samples),
        "injected_leak": args.inject_leak,
        "samples": samples,
        "mem_shape": list(mems[0].shape),
        "nll_per_token": total_nll / n_tok,
        "tokens_per_s": n_tok / elapsed,
        "seconds": elapsed,
    }


def stream_anchor(args: argparse.Namespace, tokens: torch.Tensor) -> dict:
    """The same stream through transformers' TransfoXL with the debug shape."""
    import warnings

    warnings.filterwarnings("ignore")
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    from txlm.config import ModelConfig

    c = ModelConfig.from_preset("debug")
    hf = TransfoXLConfig(
        vocab_size=c.vocab_size,
        cutoffs=[],
        d_model=c.d_model,
        d_embed=c.d_model,
        n_head=c.n_head,
        d_head=c.d_head,
        d_inner=c.d_inner,
        n_layer=c.n_layer,
        mem_len=args.mem_len,
        tgt_len=args.tgt_len,
        dropout=0.0,
        dropatt=0.0,
        adaptive=True,
        div_val=1,
    )
    torch.manual_seed(0)
    model = TransfoXLLMHeadModel(hf).eval()
    L = args.tgt_len
    mems = None
    samples = []
    base = None
    t0 = time.perf_counter()
    with torch.no_grad():
        for s in range(args.segments):
            x = tokens[:, s * L : s * L + L]
            out = model(input_ids=x, mems=mems)
            mems = out.mems
            done = s + 1
            if done == args.warmup:
                base = settle()
            if done % args.sample_every == 0 or done == args.segments:
                samples.append((done, settle()))
    elapsed = time.perf_counter() - t0
    end = settle()
    assert base is not None
    return {
        "engine": "transformers-4.37.2 TransfoXL",
        "segments": args.segments,
        "rss_kib_after_warmup": base,
        "rss_kib_end": end,
        "growth": (end - base) / base,
        "samples": samples,
        "tokens_per_s": args.segments * args.batch_size * L / elapsed,
        "seconds": elapsed,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--segments", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=100, help="baseline after this many segments")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--tgt-len", type=int, default=16)
    p.add_argument("--mem-len", type=int, default=32)
    p.add_argument("--sample-every", type=int, default=1000)
    p.add_argument("--limit", type=float, default=0.05, help="allowed relative RSS growth")
    p.add_argument("--anchor", action="store_true", help="also measure transformers' TransfoXL")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--inject-leak",
        action="store_true",
        help="self-check: keep every segment's memory alive; the script must then fail",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "memory_growth.json")
    p.add_argument("--_child-anchor", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.segments < args.warmup or args.warmup < 1:
        p.error("need 1 <= --warmup <= --segments")
    torch.set_num_threads(args.threads)

    # The whole token stream is built before the baseline so it is part of both figures.
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 64, (args.batch_size, args.segments * args.tgt_len + 1), generator=g)

    if args._child_anchor:
        print(json.dumps(stream_anchor(args, tokens)))
        return 0

    result = {
        "benchmark": "memory_growth",
        "model": "debug",
        "batch_size": args.batch_size,
        "tgt_len": args.tgt_len,
        "mem_len": args.mem_len,
        "warmup_segments": args.warmup,
        "limit": args.limit,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    result["txlm"] = stream_txlm(args, tokens)
    if args.anchor:
        cmd = [sys.executable, __file__, "--_child-anchor"]
        for flag in ("segments", "warmup", "batch_size", "tgt_len", "mem_len", "sample_every"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        child = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if child.returncode == 0:
            result["anchor"] = json.loads(child.stdout.strip().splitlines()[-1])
        else:
            result["anchor"] = {"error": child.stderr.strip().splitlines()[-1:]}
    growth = result["txlm"]["growth"]
    result["passed"] = growth <= args.limit
    text = json.dumps(result, indent=1)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, args.out)
    print(
        f"txlm RSS growth after {args.warmup} -> {args.segments} segments: {growth:+.2%} "
        f"(limit {args.limit:.0%}) {'OK' if result['passed'] else 'FAILED'}",
        file=sys.stderr,
    )
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
