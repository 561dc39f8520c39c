"""Long-run stability: resident memory of streaming evaluation over >= 10,000 segments.

Streaming evaluation carries each layer's memory from one segment to the next for the whole
run. A leak here grows without bound: an autograd graph kept alive through the memory (the
memory must be detached, paper Eq. 1 SG), a cache keyed by segment length, or a list of
per-segment tensors that nobody frees. This script streams the ``debug`` model over N
segments with memory carried and compares resident memory at the end with its value after
the first ``--warmup`` segments.

    .venv/bin/python benchmarks/memory_growth.py --anchor      # 10,000 segments, all engines

Engines, each in its own child process so that its resident memory is its own:
  - ``evaluate``: txlm.inference.evaluate.evaluate_tokens, the library's streaming evaluation (what
    ``txlm eval`` and validation during training run), and ``score``: txlm.inference.score.score
    (one
    row; its per-token log-probs, 4 bytes a token, grow by design and are reported apart).
    The figure is resident memory (VmRSS) sampled inside one 10,000-segment call by a
    forward hook, after the warm-up segments and at the end: what a call allocates once
    for its whole stream (the rows' inputs and labels, the labelled counts per column,
    proportional to the stream's length and freed on return) is in both samples, so only
    growth with the number of segments shows. Beside it, ``peak_vs_short_call``: the call's
    peak (VmHWM) against a call over the first --warmup segments, which counts those
    one-off allocations too (score's short call reads a shorter text);
  - ``model``: the bare forward loop under torch.no_grad() in eval mode, RSS (VmRSS) sampled
    after the warm-up segments and at the end;
  - ``anchor`` (``--anchor``): transformers 4.37.2 TransfoXLLMHeadModel, same shape and loop.

Writes runs/bench/memory_growth.json (--out) and prints it. Exit status 1 when any txlm
engine's growth exceeds ``--limit`` (default 5%). ``--inject-leak`` keeps every segment's
memory alive in the ``model`` loop: a self-check that the measurement catches a leak.
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

# scratch by default (under the current directory, as txlm train's runs/); --out
# benchmarks/results/memory_growth.json updates the committed one
RESULTS = Path("runs") / "bench"


def rss_kib() -> int:
    """Resident set size of this process in KiB, from /proc (psutil is not a dependency)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def reset_peak() -> None:
    """Reset VmHWM (the peak resident set) to the current RSS (Linux >= 4.0)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_kib() -> int:
    return _status("VmHWM")


def settle() -> int:
    """RSS after a garbage collection: what is still referenced, not what awaits collection."""
    gc.collect()
    return rss_kib()


def stream_model(args: argparse.Namespace, tokens: torch.Tensor) -> dict:
    model = _debug_model()
    # Evaluate with the preset's evaluation lengths (longer memory than training).
    lengths = model.lengths.replace(tgt_len=args.tgt_len, mem_len=args.mem_len)
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
            out = model(x, mems=mems, labels=y, mem_mask=mem_mask, lengths=lengths)
            mems, mem_mask = out.mems, out.mem_mask
            if args.inject_leak:  # the "growing cache" bug this benchmark exists to catch
                leak.append(out.mems)
            # .item(): the running figure is a Python float, never a tensor chained across
            # segments (a tensor sum would be harmless under no_grad, but a float is the habit
            # that stays harmless when someone removes the no_grad).
            total_nll += out.losses.sum().item()
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
        "engine": "txlm model forward loop",
        "measure": "VmRSS",
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


def _debug_model():
    from txlm.config import ModelConfig
    from txlm.model import TransformerXL

    torch.manual_seed(0)
    return TransformerXL(ModelConfig.from_preset("debug")).eval()


def sample_inside(model: torch.nn.Module, args: argparse.Namespace, n_segments: int):
    """A forward hook that records (segments read, settled VmRSS) after the warm-up segments,
    every --sample-every segments and after the last: resident memory inside one call, so
    what the call allocates once up front is in every sample and only growth shows."""
    samples: list[tuple[int, int]] = []
    seen = 0

    def hook(module, inputs, output) -> None:
        nonlocal seen
        seen += 1
        if seen in (args.warmup, n_segments) or seen % args.sample_every == 0:
            samples.append((seen, settle()))

    return model.register_forward_hook(hook), samples


def stream_evaluate(args: argparse.Namespace, tokens: torch.Tensor) -> dict:
    """txlm.inference.evaluate.evaluate_tokens: resident memory inside the one call, after the
    warm-up
    segments vs at the end (``sample_inside``). ``peak_vs_short_call`` is the call's peak
    (VmHWM) against that of a call stopped after --warmup segments over the same stream."""
    from txlm.inference.evaluate import evaluate_tokens

    model = _debug_model()
    # One stream whose B contiguous rows are exactly the rows the other engines read.
    flat = torch.cat([tokens[:, :-1].reshape(-1), tokens[-1:, -1]]).numpy()
    lengths = model.lengths.replace(tgt_len=args.tgt_len, mem_len=args.mem_len)
    kw = dict(batch_size=args.batch_size, lengths=lengths)
    reset_peak()
    short = evaluate_tokens(model, flat, max_steps=args.warmup, **kw)
    short_peak = peak_kib()
    assert short["segments"] == args.warmup, short
    hook, samples = sample_inside(model, args, args.segments)
    reset_peak()
    long = evaluate_tokens(model, flat, **kw)
    long_peak = peak_kib()
    hook.remove()
    base, end = samples[0][1], samples[-1][1]
    return {
        "engine": "txlm.inference.evaluate.evaluate_tokens",
        "measure": "VmRSS inside the call (forward hook), after warm-up vs at the end",
        "segments": long["segments"],
        "rss_kib_after_warmup": base,
        "rss_kib_end": end,
        "growth": (end - base) / base,
        "growth_kib": end - base,
        "samples": samples,
        "peak_vs_short_call": {
            "short_call_peak_kib": short_peak,
            "peak_kib": long_peak,
            "growth": (long_peak - short_peak) / short_peak,
            "growth_kib": long_peak - short_peak,
        },
        "nll_per_token": long["loss"],
        "tokens_per_s": long["tokens_per_s"],
        "seconds": long["seconds"],
    }


def stream_score(args: argparse.Namespace, tokens: torch.Tensor) -> dict:
    """txlm.inference.score.score over one row, resident memory inside the one call
    (``sample_inside``).

    The per-token output (4 bytes a token, allocated once and filled as the segments are
    read) grows by design; the growth beyond it is what a leak would add.
    ``peak_vs_short_call``: the call's peak against a call over the first --warmup segments'
    text alone, which includes the up-front allocations (they grow with the text's length).
    """
    from txlm.inference.score import score

    model = _debug_model()
    row = tokens[0]
    kw = dict(tgt_len=args.tgt_len, mem_len=args.mem_len)
    reset_peak()
    score(model, row[: args.warmup * args.tgt_len + 1], **kw)
    short_peak = peak_kib()

    n_segments = (row.numel() - 1 + args.tgt_len - 1) // args.tgt_len
    hook, samples = sample_inside(model, args, n_segments)
    reset_peak()
    t0 = time.perf_counter()
    out = score(model, row, **kw)
    elapsed = time.perf_counter() - t0
    long_peak = peak_kib()
    hook.remove()
    base = samples[0][1]
    end = samples[-1][1]
    # the output's pages filled after the warm-up sample: by design, not a leak
    filled_kib = (out.numel() - args.warmup * args.tgt_len) * out.element_size() // 1024
    return {
        "engine": "txlm.inference.score.score (batch 1)",
        "measure": "VmRSS inside the call (forward hook), after warm-up vs at the end",
        "segments": n_segments,
        "rss_kib_after_warmup": base,
        "rss_kib_end": end,
        "growth": (end - base) / base,
        "growth_kib": end - base,
        "output_kib_filled_after_warmup": filled_kib,
        "growth_beyond_output_kib": end - base - filled_kib,
        "growth_beyond_output_bytes_per_segment": (end - base - filled_kib)
        * 1024
        / max(n_segments - args.warmup, 1),
        "samples": samples,
        "peak_vs_short_call": {
            "short_call_peak_kib": short_peak,
            "peak_kib": long_peak,
            "growth": (long_peak - short_peak) / short_peak,
            "growth_kib": long_peak - short_peak,
        },
        "nll_per_token": float(-out.double().mean()),
        "tokens_per_s": out.numel() / elapsed,
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
        "measure": "VmRSS",
        "segments": args.segments,
        "rss_kib_after_warmup": base,
        "rss_kib_end": end,
        "growth": (end - base) / base,
        "growth_kib": end - base,
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
    p.add_argument("--engines", default="evaluate,score,model", help="comma-separated")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.segments < args.warmup or args.warmup < 1:
        p.error("need 1 <= --warmup <= --segments")
    torch.set_num_threads(args.threads)

    # The whole token stream is built before any baseline so it is part of every figure.
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 64, (args.batch_size, args.segments * args.tgt_len + 1), generator=g)

    if args._child:
        run = {
            "evaluate": stream_evaluate,
            "score": stream_score,
            "model": stream_model,
            "anchor": stream_anchor,
        }[args._child]
        print(json.dumps(run(args, tokens)))
        return 0

    engines = [e for e in args.engines.split(",") if e]
    if args.anchor:
        engines.append("anchor")
    result = {
        "benchmark": "memory_growth",
        "model": "debug",
        "batch_size": args.batch_size,
        "tgt_len": args.tgt_len,
        "mem_len": args.mem_len,
        "segments": args.segments,
        "warmup_segments": args.warmup,
        "limit": args.limit,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
        "command": " ".join(["python", *sys.argv]),
        "engines": {},
    }
    for engine in engines:
        cmd = [sys.executable, __file__, "--_child", engine]
        for flag in ("segments", "warmup", "batch_size", "tgt_len", "mem_len", "sample_every"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        cmd += ["--threads", str(args.threads)]
        if args.inject_leak:
            cmd.append("--inject-leak")
        child = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if child.returncode == 0:
            result["engines"][engine] = json.loads(child.stdout.strip().splitlines()[-1])
        else:
            result["engines"][engine] = {"error": child.stderr.strip().splitlines()[-3:]}
    ours = {k: v for k, v in result["engines"].items() if k != "anchor"}
    result["passed"] = all("growth" in v and v["growth"] <= args.limit for v in ours.values())
    text = json.dumps(result, indent=1)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, args.out)
    for name, v in result["engines"].items():
        figure = f"{v['growth']:+.2%} ({v['growth_kib']:+} KiB)" if "growth" in v else v
        print(
            f"{name}: resident memory {args.warmup} -> {v.get('segments')} segments: {figure}",
            file=sys.stderr,
        )
    print(f"limit {args.limit:.0%}: {'OK' if result['passed'] else 'FAILED'}", file=sys.stderr)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
