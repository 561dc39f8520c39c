"""The packaged decoding step's settings, each against the one txlm ships, side by side.

A shape of ``decode_floor.py`` (``--shape``: the decoding issue's, d_model 256, 4 layers, a
10k full softmax, memory 512, or wt103-base's), the prompt filling the memory, greedy draws,
for each batch size: one packaged decoder (``Decoder(compile="package")``,
txlm.inference.packaged) per variant of how its step is compiled, each packaged in a scratch
TXLM_HOME of its own, then rounds of ``--steps`` steps interleaved across the variants:

    shipped     ``packaged.options``: the weights frozen and packed; one row through
                inductor's C++ template, more rows through the library's packed products
                (bf16 weights at one row: ``packaged.weights_as_reductions``)
    library     the library's packed products at every batch size (freezing alone)
    timed       inductor times its C++ template against the library's packed product for
                each weight product as it packages (max-autotune, "CPP,ATEN")
    unfrozen    AOTInductor's defaults: the weights as constants, not packed
    fused, int8_fused  ``shipped``, ``int8`` with the C++ template's products fused with
                what follows them (``epilogue_fusion``; not shipped: it fails to lower for
                some models, ``packaged.options``)
    reductions  the shipped settings, but a one-row step's weight products traced as
                reductions too (as a bf16 package's are), not only the attention's
    bf16        ``--precision bf16`` as shipped: bf16 weights and a bf16 cache; one row:
                the weight products traced as reductions, each weight read along rows
    bf16_f32kv  bf16 weights over a float32 cache
    bf16_library  bf16 weights through the library's packed product at one row
    bf16_template  bf16 weights as fp32's are shipped (one row: inductor's C++ template)
    int8        ``--precision int8`` as shipped: int8 weights and a bf16 cache
    int8_f32kv  int8 weights over a float32 cache
    int8_library  int8 as ``library``
    gathered_after, bf16_gathered_after  ``shipped``, ``bf16`` with a one-row step's position
                scores traced in the eager order: each query against every distance, then
                gathered per slot (shipped: the keys gathered per slot, one sum per pair)
    branch_free, bf16_branch_free  ``shipped``, ``bf16`` with an adaptive softmax's tail
                clusters chosen as a GPU's step chooses them: each computed, then its values
                or the skipped ones taken by ``torch.where`` (shipped: a ``torch.cond`` per
                cluster, a skipped one's product not run); the same step without clusters

and reports each variant's packaging time, its step (best round) and its speed against the
shipped fp32 step's (median of the per-round ratios, above 1: faster).

    python benchmarks/decode_package.py [--shape issue|wt103-base] [--threads 1]
                                        [--batches 1,16] [--variants shipped,library,...]

Writes runs/bench/decode_package.json (--out) and prints each row.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_floor import GREEDY, SHAPES, machine, write_result
from txlm.config import ModelConfig
from txlm.inference import decode, packaged, reductions
from txlm.inference.decode import Decoder
from txlm.model import TransformerXL
from txlm.model.cache import slot_scores

RESULTS = Path("runs") / "bench" / "decode_package.json"
LIBRARY = {"freezing": True}
SHIPPED = packaged.options  # (the shipped settings, as the variants patch them)
TIMED = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "max_autotune_report_choices_stats": False,
    "epilogue_fusion": False,
}
REDUCED = packaged.weights_as_reductions  # (the shipped choice, as the variants patch it)
BF16 = {"dtype": torch.bfloat16}
# variant: (the decoder's arguments, inductor's settings by bucket, a one-row package's
# weight products as reductions by precision)
VARIANTS = {
    "shipped": ({}, SHIPPED, REDUCED),
    "library": ({}, lambda bucket, precision: LIBRARY, REDUCED),
    "timed": ({}, lambda bucket, precision: TIMED, REDUCED),
    "unfrozen": ({}, lambda bucket, precision: {}, REDUCED),
    "reductions": ({}, SHIPPED, lambda precision: True),
    "bf16": (BF16, SHIPPED, REDUCED),
    "bf16_f32kv": (BF16, SHIPPED, REDUCED),
    "bf16_library": (BF16, lambda bucket, precision: LIBRARY, lambda precision: False),
    "bf16_template": (
        BF16,
        lambda bucket, precision: SHIPPED(bucket, "fp32"),
        lambda precision: False,
    ),
    "fused": ({}, lambda bucket, precision: fused(SHIPPED(bucket, precision)), REDUCED),
    "int8_library": ({"int8": True}, lambda bucket, precision: LIBRARY, REDUCED),
    "int8": ({"int8": True}, SHIPPED, REDUCED),
    "int8_f32kv": ({"int8": True}, SHIPPED, REDUCED),
    "int8_fused": (
        {"int8": True},
        lambda bucket, precision: fused(SHIPPED(bucket, precision)),
        REDUCED,
    ),
    "gathered_after": ({}, SHIPPED, REDUCED),
    "bf16_gathered_after": (BF16, SHIPPED, REDUCED),
    "branch_free": ({}, SHIPPED, REDUCED),
    "bf16_branch_free": (BF16, SHIPPED, REDUCED),
}


def fused(options: dict) -> dict:
    """``options`` with the C++ template's products fused with what follows them."""
    return {**options, "epilogue_fusion": True} if options.get("max_autotune") else options


def with_float32_cache(dec: Decoder) -> None:
    """A packaged decoder over a float32 cache whatever its precision's (its own package:
    the cache dtype is in the package's key)."""
    dec.cache_dtype = torch.float32
    dec.package_key = packaged.model_key(dec._source())


class GatheredAfter(reductions.products_as_reductions):
    """The shipped rewrite, but the position scores a product over every distance (as a
    reduction) gathered per slot afterwards, as they run eagerly."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not slot_scores:
            return super().__torch_function__(func, types, args, kwargs)
        q, keys, index = args
        batch, heads, qlen, d_head = q.shape
        rows = q.transpose(0, 1).reshape(heads, batch * qlen, d_head)
        scores = reductions._matmul(rows, keys.transpose(1, 2))
        scores = scores.view(heads, batch, qlen, -1).transpose(0, 1)
        return scores.gather(-1, index.expand(batch, heads, -1, -1))


def prefilled(
    model: TransformerXL, variant: str, batch: int
) -> tuple[Decoder, torch.Tensor, float]:
    """A packaged decoder of ``variant`` after its prompts and its first step (which packages
    it): the decoder, the ids it drew, the seconds that first step took."""
    kw, options, reduced = VARIANTS[variant]
    dec = Decoder(model, compile="package", **kw)
    if variant.endswith("_f32kv"):
        with_float32_cache(dec)
    if variant.endswith("branch_free"):
        dec.traced_branch = "none"
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, model.config.mem_len), generator=g)
    ids = dec.prefill(prompts.tolist(), sampling=GREEDY)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(packaged, "options", options))
        for module in (decode, packaged):  # (where the step's trace and options ask)
            stack.enter_context(mock.patch.object(module, "weights_as_reductions", reduced))
        if variant.endswith("gathered_after"):
            stack.enter_context(mock.patch.object(decode, "products_as_reductions", GatheredAfter))
        quiet = stack.enter_context(open(os.devnull, "w"))  # (inductor's timing tables)
        stack.enter_context(contextlib.redirect_stderr(quiet))
        t = time.perf_counter()
        ids = dec.step(ids, GREEDY)
        first = time.perf_counter() - t
    return dec, ids, first


def run(model: TransformerXL, batch: int, variants: list[str], args) -> list[dict]:
    made = {}
    for v in variants:
        with tempfile.TemporaryDirectory() as home, mock.patch.dict(os.environ, TXLM_HOME=home):
            made[v] = list(prefilled(model, v, batch))
            print(f"batch {batch} {v}: packaged in {made[v][2]:.1f} s", flush=True)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            dec, ids = made[v][:2]
            t = time.perf_counter()
            for _ in range(args.steps):
                ids = dec.step(ids, GREEDY)
            times[v].append((time.perf_counter() - t) / args.steps)
            made[v][1] = ids
    anchor = times.get("shipped")
    rows = []
    for v in variants:
        row = {"batch": batch, "variant": v, "package_s": round(made[v][2], 1),
               "step_ms": round(min(times[v]) * 1e3, 3)}  # fmt: skip
        if anchor is not None:
            ratios = [a / t for a, t in zip(anchor, times[v], strict=True)]
            row["vs_shipped_fp32"] = round(statistics.median(ratios), 2)
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="issue")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; of {', '.join(VARIANTS)}")
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        preset, overrides = SHAPES[args.shape]
        torch.manual_seed(0)
        model = TransformerXL(ModelConfig.from_preset(preset, **overrides)).eval()
        rows = [r for b in args.batches.split(",") for r in run(model, int(b), variants, args)]
    finally:
        torch.set_num_threads(saved)
    result = {**machine(args.threads), "shape": args.shape, "rows": rows}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
