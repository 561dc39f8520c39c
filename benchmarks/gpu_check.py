"""One prepared run for a lent GPU: the CUDA path checked and timed against txlm's GPU targets.

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json   # cuda, ~5 min with compiles
    python benchmarks/gpu_check.py --device cpu --quick        # the same code, tiny shape (CI)

Sections run in order of importance; each one is guarded (an error is recorded and the run
goes on) and the JSON is rewritten after each, so a run cut short still reports what it
measured. A section starts only while ``--budget-s`` seconds have not passed.

1. parity: the same weights on the CPU and on the device in float32 (TF32 off), two segments
   with memory: the largest |log p| difference (target <= 1e-4);
2. the matmul peak per precision, measured here (the MFU denominator);
3. per shape (wt103-base at 60 x 150, enwik8-base at 22 x 512, the paper's batches):
   training in bf16 the way ``txlm train`` does it (bf16 compute copies of the fp32 master
   weights, Adam fused, clip 0.25, memory carried) on a synthetic stream whose next token is
   a fixed function of the current one, so the loss must fall on a working device path:
   tokens/s, FLOPs per step (torch's counter), MFU, peak memory, first and last loss;
   evaluation with 4x the training memory, plain and with the K/V cache;
4. decoding, batch 1, after a 512-token context, wt103-base shape, fp32 and bf16, op by op
   and replayed from a CUDA graph: tokens/s, bf16 against fp32, the device against the CPU;
5. ``txlm generate`` end to end (a subprocess, as a user runs it) on the default
   shakespeare-char shape with random weights, eager and ``--compile``: the decoding rate
   after the first token, and the first token's time;
6. a profile: device kernels per bf16 training step and per decoded token, the top kernels;
7. training compiled (``run.compile=auto`` is on for CUDA): compile seconds and tokens/s;
   decoding compiled (``txlm generate --compile``); decoding batches of 1, 8 and 64 rows
   (memory 512, bf16, compiled and captured, and eager captured): tokens/s over all rows;
   the same batches with the draw inside the compiled, captured step (greedy and top-k 40,
   through the pruned adaptive softmax: ``step(ids, sampling)``); the kernels and library calls of
   each compiled step's generated code (``decode_kernels_per_token_compiled``, the count
   the budget of 100 per token is about);
8. the attention candidates (SDPA with the position term as a bias, txlm's math, or on CUDA
   txlm's Triton kernel; heads as they are or padded to a multiple of 8), and training in
   fp32 (TF32 off) and tf32.
Correctness sections, failing like a missed target: the padded model against the plain one
(``aligned_parity``) and the Triton attention against the math path, fp32, bf16 and compiled
(``triton_attention_parity``).
Models are built as txlm builds them on the device: on CUDA, heads padded to a multiple of 8
(``txlm.model.align``, chosen by section 8's measurement) unless a row says otherwise.
Every figure is the device's own; nothing here compares against another library. ``targets``
at the end sets each target (the bars that ``targets()`` lists) beside the figure that
measures it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import txlm
from inductor_code import generated_code, kernel_counts
from txlm import atomic
from txlm.config import ModelConfig
from txlm.data.vocab import Vocab
from txlm.devices import wanted
from txlm.inference.decode import Decoder
from txlm.inference.kv_eval import CachedEvaluator
from txlm.inference.sampling import SamplingConfig
from txlm.model import align
from txlm.training.loop import graphs_compiled
from txlm.training.precision import ComputeCopy
from txlm.training.step import TailBuckets

# scratch by default (under the current directory, as txlm train's runs/); --out
# benchmarks/results/gpu_check.json updates the committed one
RESULTS = Path("runs") / "bench" / "gpu_check.json"
SHAPES = {"wt103-base": 60, "enwik8-base": 22}  # preset: batch rows (the paper's)
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
    """[batch, length] ids over the whole vocabulary with Zipfian frequencies (id = rank,
    p ~ 1/(id+1), as a frequency-sorted word vocabulary: every adaptive-softmax cluster gets
    its real share of the tokens), where each token repeats the one before with probability
    1/2 (the distribution stays Zipfian): the loss falls below the unigram entropy within a
    few dozen steps on a working device path."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    draws = torch.multinomial(weights, batch * length, replacement=True, generator=g)
    draws = draws.view(batch, length)
    fresh = torch.rand(batch, length, generator=g) < 0.5
    fresh[:, 0] = True
    t = torch.arange(length).expand(batch, length)
    last_fresh = torch.where(fresh, t, 0).cummax(dim=1).values
    return draws.gather(1, last_fresh)


def build(
    config: ModelConfig,
    device: torch.device,
    seed: int = 0,
    *,
    padded: bool | None = None,
    exact: bool = False,
) -> txlm.TransformerXL:
    """A model with seeded random weights, initialised on the device itself (fast), or on the
    CPU and moved (``exact``: the same weights as a CPU build, for the parity figures).
    ``padded``: heads padded to a multiple of 8; None: as txlm does it here (on CUDA)."""
    torch.manual_seed(seed)
    with contextlib.nullcontext() if exact else torch.device(device):
        model = txlm.TransformerXL(config)
    if padded is None:
        padded = wanted("auto", device)
    return align.padded(model, align.Stored.aligned(config) if padded else None).to(device)


def timed(fn: Callable[[], object], device: torch.device, steps: int, seconds: float) -> float:
    """Median seconds per call of ``fn`` over up to ``steps`` calls or ``seconds`` of calls
    (at least 3), the first fifth dropped as warm-up."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max(steps, 3) and (len(times) < 3 or time.perf_counter() - start < seconds):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[len(times) // 5 :])


def parity(config: ModelConfig, device: torch.device) -> float:
    cpu = build(config, torch.device("cpu")).eval()
    dev = build(config, device, exact=True).eval()
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


def aligned_parity(config: ModelConfig, device: torch.device) -> dict:
    """Correctness of the aligned model on this device's kernels: the same weights stored
    unpadded and padded (txlm.model.align.Stored.aligned: heads, widths, keys), float32 with
    TF32 off, two training segments with memory and labels over every cluster: the largest
    loss and (real-shape) gradient differences. Over 1e-4: an error, like a missed target."""
    plain = build(config, device, padded=False, exact=True).train()
    padded = build(config, device, padded=True, exact=True).train()
    for m in (plain, padded):
        for module in m.modules():  # dropout draws differ between the two shapes
            if hasattr(module, "p"):
                module.p = 0.0
    ids = synthetic_stream(config.vocab_size, 2, 2 * config.tgt_len + 1, 5).to(device)
    losses = []
    with precision(device, "fp32"):
        for m in (plain, padded):
            out, total = None, 0.0
            for s in range(2):
                seg = slice(s * config.tgt_len, (s + 1) * config.tgt_len)
                labels = ids[:, seg.start + 1 : seg.stop + 1]
                out = m(ids[:, seg], mems=None if out is None else out.mems, labels=labels)
                total = total + out.losses.sum()
            total.backward()
            losses.append(total.item())
    grads = dict(padded.named_parameters())
    stripped = {n: align.strip(p.grad, *align.padded_axes(padded).get(n, ()))
                for n, p in grads.items()}  # fmt: skip
    worst = max((stripped[n] - p.grad).abs().max().item() for n, p in plain.named_parameters())
    row = {"loss_diff": abs(losses[0] - losses[1]) / max(abs(losses[0]), 1.0),
           "max_grad_diff": worst}  # fmt: skip
    if max(row.values()) > 1e-4:
        raise AssertionError(f"padded and plain models differ on {device}: {row}")
    return row


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_parity(config: ModelConfig, device: torch.device) -> dict:
    """Correctness of attn_impl triton (txlm.model.triton_attention) on this device's
    compiled kernels; on the CPU the tests prove it under Triton's interpreter (C34). A
    2-layer model of ``config``'s widths, built as txlm builds it here (on CUDA padded:
    heads, widths, keys aligned by masked slots), two training segments with memory and a
    document reset, the kernel against the math path: the relative loss difference and the
    largest gradient difference relative to the largest gradient. fp32 (TF32 off): over
    1e-4 an error, like a missed target. On CUDA also bf16 autocast, set beside the math
    path's own bf16 error against its fp32 (over 2x + 1e-2 an error), and the bf16 step
    compiled (inductor) against the eager one."""
    if not has_triton():
        return {"skipped": "no triton package"}
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "on the CPU the kernels need TRITON_INTERPRET=1"}
    cfg = config.replace(n_layer=2, vocab_size=2000, cutoffs=[500, 1000], tie_projs=None,
                         dropout=0.0, dropatt=0.0)  # fmt: skip
    qlen = cfg.tgt_len
    rows = 4 if device.type == "cuda" else 2
    ids = synthetic_stream(cfg.vocab_size, rows, 2 * qlen + 1, 7).to(device)
    reset = torch.zeros(rows, dtype=torch.bool, device=device)
    reset[1] = True

    def run(impl: str, name: str, compiled: bool = False) -> tuple[float, dict[str, Tensor]]:
        model = build(cfg.replace(attn_impl=impl), device, seed=3).train()
        fn = torch.compile(model) if compiled else model
        seg1, seg2 = ids[:, :qlen], ids[:, qlen : 2 * qlen]
        lab1, lab2 = ids[:, 1 : qlen + 1], ids[:, qlen + 1 : 2 * qlen + 1]
        with precision(device, name):
            first = fn(seg1, labels=lab1)
            second = fn(seg2, mems=first.mems, reset=reset, mem_mask=first.mem_mask, labels=lab2)
            total = first.losses.sum() + second.losses.sum()
        total.backward()
        return total.item(), {n: p.grad.float() for n, p in model.named_parameters()}

    def diff(a: tuple[float, dict], b: tuple[float, dict]) -> dict:
        scale = max(g.abs().max().item() for g in b[1].values())
        grad = max((a[1][n] - g).abs().max().item() for n, g in b[1].items())
        return {"loss_rel_diff": abs(a[0] - b[0]) / max(abs(b[0]), 1.0),
                "grad_rel_diff": grad / max(scale, 1e-30)}  # fmt: skip

    math32 = run("math", "fp32")
    out = {"fp32": diff(run("triton", "fp32"), math32)}
    if max(out["fp32"].values()) > 1e-4:
        raise AssertionError(f"triton attention differs from the math path on {device}: {out}")
    if device.type == "cuda":
        tri16 = run("triton", "bf16")
        out["bf16"] = diff(tri16, math32)
        out["bf16_math"] = diff(run("math", "bf16"), math32)
        out["bf16_compiled_vs_eager"] = diff(run("triton", "bf16", compiled=True), tri16)
        for key in ("loss_rel_diff", "grad_rel_diff"):
            if out["bf16"][key] > 2 * out["bf16_math"][key] + 1e-2:
                raise AssertionError(f"triton bf16 {key} beyond the math path's: {out}")
    return out


def count_flops(fn: Callable[[], object]) -> int:
    def baddbmm_(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.bmm_flop(a_shape, b_shape)  # the in-place form is not registered

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.baddbmm_: baddbmm_}) as c:
        fn()
    return c.get_total_flops()


class TrainStep:
    """One training step as ``txlm train`` takes it: fp32 master weights and Adam (fused on
    CUDA); bf16 runs forward and backward on the bf16 compute copy (training.precision);
    ``compiled``: the forward model under ``torch.compile`` with this backend (inductor:
    run.compile=auto on CUDA)."""

    def __init__(self, config: ModelConfig, device: torch.device, name: str, batch: int,
                 *, compiled: str | None = None, padded: bool | None = None) -> None:  # fmt: skip
        self.config, self.device, self.name, self.batch = config, device, name, batch
        self.master = build(config, device, padded=padded).train()
        self.copy = ComputeCopy(self.master, torch.bfloat16) if name == "bf16" else None
        forward = self.master if self.copy is None else self.copy.model
        self.forward = torch.compile(forward, backend=compiled) if compiled else forward
        self.opt = torch.optim.Adam(self.master.parameters(), lr=2.5e-4,
                                    fused=device.type == "cuda")  # fmt: skip
        self.length = config.tgt_len * 64
        self.host_stream = synthetic_stream(config.vocab_size, batch, self.length + 1, 1)
        self.stream = self.host_stream.to(device)
        # the tail buckets sized from the labels on the host, as the trainer sizes them on
        # CUDA (training.step.TailBuckets): no read back, no graph break
        self.buckets = None
        if config.cutoffs:
            tokens = batch * config.tgt_len
            self.buckets = TailBuckets.for_corpus(
                self.host_stream.numpy().ravel(), config.cutoffs, tokens
            )
        self.mems: list[Tensor] | None = None
        self.t = 0

    def __call__(self) -> float:
        L = self.config.tgt_len
        ids = self.stream[:, self.t : self.t + L]
        labels = self.stream[:, self.t + 1 : self.t + 1 + L]
        host = self.host_stream[:, self.t + 1 : self.t + 1 + L].numpy()
        sizes = None if self.buckets is None else self.buckets(host)
        self.t = (self.t + L) % (self.length - L)
        with precision(self.device, self.name):
            out = self.forward(ids, mems=self.mems, labels=labels, bucket_sizes=sizes)
            loss = out.loss.float()
        loss.backward()
        if self.copy is not None:
            self.copy.gradients_to_master()
        torch.nn.utils.clip_grad_norm_(self.master.parameters(), 0.25)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.copy is not None:
            self.copy.refresh()
        self.mems = out.mems
        return loss.item()  # a sync per step, as a training loop's logging makes


def train(
    config: ModelConfig,
    device: torch.device,
    name: str,
    batch: int,
    steps: int,
    seconds: float,
    peak: float,
    *,
    compiled: str | None = None,
    padded: bool | None = None,
) -> dict:
    step = TrainStep(config, device, name, batch, compiled=compiled, padded=padded)
    graphs = graphs_compiled()
    t0 = time.perf_counter()
    first = step()
    for _ in range(3 if compiled else 1):  # with memory: a compiled model's second graph
        step()
    warmup = time.perf_counter() - t0
    # FLOPs of a step with full memory (what every timed step is), counted eagerly
    flops = step_flops(config, device, name, batch, padded) if compiled else count_flops(step)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses: list[float] = []
    sec = timed(lambda: losses.append(step()), device, steps, seconds)
    row = {
        "precision": name,
        "compiled": compiled or False,
        "padded_heads": step.master.layers[0].attn.d_head != config.d_head,
        "timed_steps": len(losses),
        "tokens_per_s": round(batch * config.tgt_len / sec, 1),
        "ms_per_step": round(sec * 1e3, 2),
        "flops_per_step": flops,
        "tflops": round(flops / sec / 1e12, 4),
        "mfu": round(flops / sec / 1e9 / peak, 4),
        "loss_first": round(first, 4),
        "loss_last": round(statistics.mean(losses[-3:]), 4),
    }
    if compiled:
        row["compile_and_first_steps_s"] = round(warmup, 1)
        row["graphs_compiled"] = graphs_compiled() - graphs  # 2 expected: without, with memory
    row["loss_fell"] = row["loss_last"] < 0.9 * row["loss_first"]  # expected on a real run
    if device.type == "cuda":
        row["peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return row


def step_flops(config: ModelConfig, device: torch.device, name: str, batch: int,
               padded: bool | None) -> int:  # fmt: skip
    step = TrainStep(config, device, name, batch, padded=padded)
    step()  # the memory is full from the second step on
    return count_flops(step)


def evaluate(
    config: ModelConfig,
    device: torch.device,
    batch: int,
    mem: int,
    kv: bool,
    name: str,
    seconds: float,
    *,
    padded: bool | None = None,
) -> float:
    """Forward tokens/s with memory ``mem`` (full: timed after mem // L warm-up segments)."""
    model = build(config, device, padded=padded).eval()
    lengths = model.lengths.replace(mem_len=mem)
    runner = CachedEvaluator(model, lengths=lengths) if kv else None
    warm = -(-mem // config.tgt_len)
    segments = warm + 6
    ids = torch.randint(0, config.vocab_size, (batch, config.tgt_len * segments), device=device)
    state: dict = {"mems": None, "i": 0}

    def segment() -> None:
        seg = ids[:, (state["i"] % segments) * config.tgt_len :][:, : config.tgt_len]
        state["i"] += 1
        if runner is not None:
            runner(seg, labels=seg)
        else:
            state["mems"] = model(seg, mems=state["mems"], labels=seg, lengths=lengths).mems

    with torch.no_grad(), precision(device, name):
        for _ in range(warm):
            segment()
        sec = timed(segment, device, 6, seconds)
    return round(batch * config.tgt_len / sec, 1)


def generate(
    config: ModelConfig,
    device: torch.device,
    name: str,
    new: int,
    context: int = 512,
    *,
    graph: bool = False,
    compile: bool = False,
    padded: bool | None = None,
    batch: int = 1,
    code: list[str] | None = None,
) -> tuple[float, Tensor]:
    """Greedy decoding speed (tokens/s over all ``batch`` rows, each its own prompt), and
    row 0's log-probs [new, V] of the steps from the first (to compare precisions and
    devices on the same prompt). ``graph``: the step replayed from a CUDA graph
    (the decoder's default on CUDA), else launched op by op; ``compile``: the step under
    torch.compile (on CUDA, then captured in a graph too). Timed after 3 warm-up steps (a
    graph is captured, a compiled step built and recorded). ``code``: gets what inductor
    generates for the step (``first_call``)."""
    model = build(config, device, padded=padded, exact=True).eval()
    lengths = model.lengths.replace(mem_len=max(config.mem_len, context))
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, config.vocab_size, (batch, context), generator=g).tolist()
    backend = ("inductor" if device.type == "cuda" else "eager") if compile else False
    rows = []
    with torch.no_grad(), precision(device, name):
        captured = (graph or compile) and device.type == "cuda"  # as txlm generate does
        dec = Decoder(model, lengths=lengths, cuda_graph=captured, compile=backend)
        logp = dec.prefill(prompts)
        for i in range(3):
            rows.append(logp[0].float().cpu())
            logp = first_call(dec.step, logp.argmax(-1), into=code if i == 0 else None)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(new):
            rows.append(logp[0].clone())
            logp = dec.step(logp.argmax(-1))
        sync(device)
        rate = batch * new / (time.perf_counter() - t0)
    return round(rate, 1), torch.stack([r.float().cpu() for r in rows])


def draw_tokens(
    config: ModelConfig,
    device: torch.device,
    sampling: SamplingConfig,
    new: int,
    context: int = 512,
    *,
    batch: int = 1,
    code: list[str] | None = None,
) -> float:
    """Decoding speed with the draw inside the step (``Decoder.step(ids, sampling)``, what
    ``txlm generate`` runs): bf16, compiled and captured on CUDA, through the pruned adaptive
    softmax when ``sampling`` lets it skip clusters (greedy, top-k within the shortlist).
    Tokens/s over all ``batch`` rows, timed after 3 warm-up steps. ``code``: gets what
    inductor generates for the step (``first_call``)."""
    model = build(config, device).eval()
    lengths = model.lengths.replace(mem_len=max(config.mem_len, context))
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, config.vocab_size, (batch, context), generator=g).tolist()
    backend = "inductor" if device.type == "cuda" else "eager"
    draws = torch.Generator(device=device).manual_seed(4)
    with torch.no_grad(), precision(device, "bf16"):
        dec = Decoder(model, lengths=lengths, compile=backend)
        tokens = dec.prefill(prompts, sampling=sampling, generator=draws)
        tokens = first_call(dec.step, tokens, sampling, draws, into=code)
        for _ in range(2):
            tokens = dec.step(tokens, sampling, draws)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(new):
            tokens = dec.step(tokens, sampling, draws)
        sync(device)
    return round(batch * new / (time.perf_counter() - t0), 1)


def first_call(fn: Callable[..., Tensor], *args, into: list[str] | None) -> Tensor:
    """``fn(*args)``; with ``into``, the code inductor generates during the call (a compiled
    step's first) is appended to it: on CUDA the Triton kernels and library calls a decoded
    token launches, to count beside the CPU's count of the same step partitioned for a GPU
    (``profile_step.py --ops --compiled``). A CUDA graph's first call runs the step without
    capturing, so the capture is untouched."""
    if into is None:
        return fn(*args)
    with generated_code() as codes:
        out = fn(*args)
    into.extend(codes)
    return out


# kernel (CUDA) or operator (CPU) name fragments per class, matched in this order
KERNEL_CLASSES = {
    "optimizer": ("adam", "multi_tensor", "foreach"),
    "attention": ("fmha", "flash", "attention", "mem_eff", "sdpa"),
    "gemm": ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "s16816", "cublas", "triton_tem",
             "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
             "aten::linear"),
    "copies_and_casts": ("copy", "memcpy", "memset", "cat", "pad", "_to_copy", "fill",
                         "index", "gather", "scatter", "transpose", "contiguous"),
}  # fmt: skip


def kernel_class(name: str) -> str:
    """GEMM, attention, copies and casts, optimizer, or element-wise (everything else:
    activations, reductions, softmax, norms, inductor's fused point-wise kernels)."""
    low = name.lower()
    for cls, fragments in KERNEL_CLASSES.items():
        if any(f in low for f in fragments):
            return cls
    return "elementwise"


def kernels(fn: Callable[[], object], device: torch.device, top: int = 8) -> dict:
    """Device kernels (CPU: operators) one call of ``fn`` launches, and the costliest."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()  # warm
    sync(device)
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    if cuda:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        cost = Counter({e.name: 0.0 for e in events})
        for e in events:
            cost[e.name] += e.self_device_time_total
    else:
        events = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
        cost = Counter({e.name: 0.0 for e in events})
        for e in events:
            cost[e.name] += e.cpu_time_total
    total = sum(cost.values())
    by_class = Counter({c: 0.0 for c in KERNEL_CLASSES})
    for name, us in cost.items():
        by_class[kernel_class(name)] += us
    return {
        "count": len(events),
        "busy_ms": round(total / 1e3, 3),
        "by_class_ms": {c: round(us / 1e3, 3) for c, us in by_class.items()},
        "top": [
            {"name": k[:120], "ms": round(v / 1e3, 3), "share": round(v / max(total, 1e-9), 3)}
            for k, v in cost.most_common(top)
        ],
    }


def profile(config: ModelConfig, device: torch.device, batch: int, context: int) -> dict:
    step = TrainStep(config, device, "bf16" if device.type == "cuda" else "fp32", batch)
    step()
    model = build(config, device).eval()
    lengths = model.lengths.replace(mem_len=max(config.mem_len, context))
    prompt = torch.randint(0, config.vocab_size, (context,)).tolist()
    with torch.no_grad():
        dec = Decoder(model, lengths=lengths, cuda_graph=False)
        state = {"logp": dec.prefill([prompt])}

        def token() -> None:
            state["logp"] = dec.step(state["logp"].argmax(-1))

        decoded = kernels(token, device)
    return {"train_step_bf16": kernels(step, device), "decode_token_fp32_eager": decoded}


def attention_choice(
    config: ModelConfig, device: torch.device, batch: int, steps: int, seconds: float, peak: float
) -> dict:
    """bf16 (fp32 on a CPU) training step and 4x-memory evaluation, per attention kernel
    and head padding; the fastest of each wins."""
    name = "bf16" if device.type == "cuda" else "fp32"
    rows = []
    # txlm's Triton kernel where it compiles (on a CPU only its interpreter runs: no timing)
    impls = ("sdpa", "math") + (("triton",) if device.type == "cuda" and has_triton() else ())
    for impl in impls:
        cfg = config.replace(attn_impl=impl)
        for padded in (False, True):
            if padded and config.d_head % 8 == 0:
                continue
            t = train(cfg, device, name, batch, steps, seconds, peak, padded=padded)
            e = evaluate(cfg, device, batch, 4 * config.mem_len, False, name, seconds,
                         padded=padded)  # fmt: skip
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
                out[key] = {"error": run.stderr.strip().splitlines()[-3:]}
                continue
            report = json.loads(run.stdout)
            out[key] = {"tokens_per_s": report["tokens_per_s"],
                        "first_token_s": report["first_token_s"],
                        "process_wall_s": round(wall, 2)}  # fmt: skip
    return out


def targets(result: dict) -> list[dict]:
    """The GPU targets beside the figures measured here (None: not measured)."""

    def best_train(shape: str, key: str) -> float | None:
        rows = result.get("shapes", {}).get(shape, {}).get("train", [])
        return max((r[key] for r in rows if r.get("precision") == "bf16"), default=None)

    decode = list(result.get("generate_tokens_per_s", {}).values())
    cli = result.get("txlm_generate_cli", {})
    cli_rates = [v["tokens_per_s"] for v in cli.values() if isinstance(v, dict) and
                 "tokens_per_s" in v]  # fmt: skip
    rows = [
        ("wt103-base training bf16, tokens/s", ">=", 300_000,
         best_train("wt103-base", "tokens_per_s")),
        ("wt103-base training bf16, MFU", ">=", 0.15, best_train("wt103-base", "mfu")),
        ("enwik8-base training bf16, MFU", ">=", 0.30, best_train("enwik8-base", "mfu")),
        ("decoding, batch 1, mem 512, wt103-base, tokens/s", ">=", 3000, max(decode, default=None)),
        ("decoding, batch 64, mem 512, wt103-base, tokens/s", ">=", 50_000,
         max((m.get("64", 0) for m in result.get("generate_batch_tokens_per_s", {}).values()),
             default=None)),
        ("txlm generate, default model, tokens/s", ">=", 1000, max(cli_rates, default=None)),
        ("eval 4x memory wt103-base bf16, tokens/s (2x of 83k)", ">=", 166_000,
         _best_eval(result, "wt103-base")),
        ("eval 4x memory enwik8-base bf16, tokens/s (2x of 121k)", ">=", 242_000,
         _best_eval(result, "enwik8-base")),
        ("fp32 parity with the CPU, max |log p| diff", "<=", 1e-4,
         result.get("parity_max_abs_logprob_diff_vs_cpu")),
    ]  # fmt: skip
    out = []
    for what, op, want, got in rows:
        met = None if got is None else (got >= want if op == ">=" else got <= want)
        out.append({"target": what, "want": f"{op} {want}", "measured": got, "met": met})
    return out


def _best_eval(result: dict, shape: str) -> float | None:
    ev = result.get("shapes", {}).get(shape, {}).get("eval", {})
    rates = [v for k, row in ev.items() if k.startswith("bf16") and isinstance(row, dict)
             for v in row.values() if isinstance(v, int | float)]  # fmt: skip
    return max(rates, default=None)


class Run:
    """The sections, each guarded and timed, the JSON rewritten after each."""

    def __init__(self, out: Path, budget_s: float, *, targets: bool, only: list[str]) -> None:
        self.out, self.budget_s, self.targets, self.only = out, budget_s, targets, only
        self.start = time.perf_counter()
        self.result: dict = {"budget_s": budget_s, "sections_s": {}, "errors": {}, "skipped": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def section(self, name: str, fn: Callable[[], object], into: dict | None = None) -> None:
        """``into[name] = fn()`` (``into``: the result by default; a None result is not
        stored) unless the budget is spent; an exception is recorded and the run goes on."""
        if self.only and not any(word in name for word in self.only):
            return
        if self.elapsed() > self.budget_s:
            self.result["skipped"].append(name)
            return
        t0 = time.perf_counter()
        try:
            value = fn()
            if value is not None:
                (self.result if into is None else into)[name] = value
        except Exception as exc:  # a device failure is a finding, not the end of the run
            self.result["errors"][name] = traceback.format_exception_only(exc)[-1].strip()
            print(traceback.format_exc(), file=sys.stderr)
        self.result["sections_s"][name] = round(time.perf_counter() - t0, 1)
        print(f"gpu_check: {name} ({self.result['sections_s'][name]} s)", file=sys.stderr)
        self.save()

    def save(self) -> None:
        if self.targets:  # the targets' shapes only (not --quick's)
            self.result["targets"] = targets(self.result)
        self.result["wall_s"] = round(self.elapsed(), 1)
        atomic.write_text(self.out, json.dumps(self.result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=4.0, help="timing per measurement")
    ap.add_argument("--new", type=int, default=256, help="generated tokens per measurement")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="no section starts after this many seconds")  # fmt: skip
    ap.add_argument("--only", nargs="*", default=[],
                    help="run only the sections whose names hold one of these words")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="tiny shape, few steps (a smoke run)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    if args.quick:
        # d_head 6: the padded heads run too
        shapes = {"debug": (ModelConfig.from_preset("debug", d_head=6), 2)}
        steps, seconds, new, peak_n, context = 3, 0.0, 4, 256, 32
    else:
        shapes = {p: (ModelConfig.from_preset(p), b) for p, b in SHAPES.items()}
        steps, seconds, new, peak_n, context = 200, args.seconds, args.new, 8192, 512
    first = next(iter(shapes))
    cuda = device.type == "cuda"
    precisions = ("fp32", "tf32", "bf16") if cuda else ("fp32", "bf16")
    run = Run(args.out, args.budget_s, targets=not args.quick, only=args.only)
    r = run.result
    r.update(device=torch.cuda.get_device_name(device) if cuda else "cpu",
             torch=torch.__version__, machine=platform.machine())  # fmt: skip
    r["shapes"] = {p: {"model": {k: getattr(c, k) for k in SHAPE_FIELDS}, "batch": b, "train": []}
                   for p, (c, b) in shapes.items()}  # fmt: skip
    config0, batch0 = shapes[first]

    run.section("parity_max_abs_logprob_diff_vs_cpu", lambda: parity(config0, device))
    run.section("aligned_parity", lambda: aligned_parity(config0, device))
    run.section("triton_attention_parity", lambda: triton_parity(config0, device))
    peaks_of = lambda: {p: round(matmul_peak(device, p, peak_n), 1) for p in precisions}  # noqa: E731
    run.section("matmul_peak_gflops", peaks_of)
    peaks = r.get("matmul_peak_gflops") or {p: math.nan for p in precisions}

    def add_train(shape: str, name: str, compiled: str | None = None) -> Callable[[], None]:
        config, batch = shapes[shape]

        def go() -> None:
            row = train(config, device, name, batch, steps, seconds, peaks[name],
                        compiled=compiled)  # fmt: skip
            r["shapes"][shape]["train"].append(row)

        return go

    def add_eval(shape: str) -> Callable[[], None]:
        config, batch = shapes[shape]
        m = 4 * config.mem_len

        def go() -> None:
            r["shapes"][shape]["eval"] = {
                f"{p}_mem{m}": {
                    "tokens_per_s": evaluate(config, device, batch, m, False, p, seconds),
                    "kv_cache_tokens_per_s": evaluate(config, device, batch, m, True, p, seconds),
                }
                for p in ("bf16", "fp32")
            }

        return go

    for shape in shapes:
        run.section(f"{shape} train bf16", add_train(shape, "bf16"))
        run.section(f"{shape} eval", add_eval(shape))

    decoded: dict = {}  # (precision, graph) -> (tokens/s, log-probs [new, V])
    rates = r.setdefault("generate_tokens_per_s", {})
    graphs = (False, True) if cuda else (False,)
    for p in ("fp32", "bf16"):
        for g in graphs:
            key = p + ("_cuda_graph" if g else "")

            def decode(p: str = p, g: bool = g, key: str = key) -> None:
                decoded[p, g] = generate(config0, device, p, new, context, graph=g)
                rates[key] = decoded[p, g][0]

            run.section(f"decode {key}", decode)

    def decode_parity() -> None:
        first_rows = [decoded[p, False][1][0] for p in ("fp32", "bf16")]
        r["generate_bf16_first_step_max_abs_logprob_diff"] = (
            (first_rows[0] - first_rows[1]).abs().max().item()
        )
        _, cpu_logp = generate(config0, torch.device("cpu"), "fp32", min(new, 16), context)
        for g in graphs:  # the device's fp32 decoding, op by op and replayed, against the CPU's
            dev_logp = decoded["fp32", g][1][: cpu_logp.size(0)]
            key = "generate_parity_max_abs_logprob_diff_vs_cpu" + ("_cuda_graph" if g else "")
            r[key] = (dev_logp - cpu_logp).abs().max().item()

    run.section("decode parity", decode_parity)
    run.section("profile", lambda: profile(config0, device, batch0, context))
    # compiled: inductor on CUDA; on the CPU (--quick) dynamo alone, so the code runs fast
    backend = "inductor" if cuda else "eager"
    run.section(f"{first} train bf16 compiled", add_train(first, "bf16", compiled=backend))

    # the kernels of the compiled steps (inductor on CUDA; none from dynamo alone on a CPU)
    step_kernels = r.setdefault("decode_kernels_per_token_compiled", {})

    def decode_compiled() -> None:
        for p in ("fp32", "bf16"):
            code: list[str] = []
            rates[p + "_compiled"] = generate(
                config0, device, p, new, context, compile=True, code=code
            )[0]
            if code:
                step_kernels[p] = kernel_counts(code)

    run.section("decode compiled", decode_compiled)

    def decode_batches() -> None:
        # one capture per batch size; rows of one batch decode together (txlm generate
        # --num-samples N, several prompts)
        by_batch = r.setdefault("generate_batch_tokens_per_s", {})
        modes = {"bf16_compiled": dict(compile=True), "bf16_cuda_graph": dict(graph=cuda)}
        for mode, kw in modes.items():
            by_batch[mode] = {
                str(b): generate(config0, device, "bf16", new, context, batch=b, **kw)[0]
                for b in ((1, 2) if args.quick else (1, 8, 64))
            }

    run.section("decode batch", decode_batches)

    def decode_pruned() -> None:
        # the draw inside the compiled, captured step; with clusters (wt103-base) through
        # the pruned softmax: the tail clusters a batch's candidates cannot reach are skipped
        by_batch = r.setdefault("generate_draw_tokens_per_s", {})
        for name, sampling in (("greedy", SamplingConfig(greedy=True)),
                               ("top_k40", SamplingConfig(top_k=40))):  # fmt: skip
            by_batch[name] = {}
            # (--quick: one row; "decode batch" runs a batch's bucket)
            for b in (1,) if args.quick else (1, 8, 64):
                code: list[str] = []
                rate = draw_tokens(config0, device, sampling, new, context, batch=b, code=code)
                by_batch[name][str(b)] = rate
                if code and b == 1:
                    step_kernels["bf16_draw_" + name] = kernel_counts(code)

    run.section("decode draw", decode_pruned)
    run.section("txlm_generate_cli", lambda: generate_cli(device, 64 if args.quick else 1000,
                                                          args.quick))  # fmt: skip
    for shape in list(shapes)[1:]:
        run.section(f"{shape} train bf16 compiled", add_train(shape, "bf16", compiled=backend))
    run.section("attention", lambda: attention_choice(
        config0, device, batch0, max(steps // 4, 2), seconds / 2,
        peaks["bf16" if cuda else "fp32"]))  # fmt: skip
    for p in precisions:
        if p != "bf16":
            run.section(f"{first} train {p}", add_train(first, p))
    run.save()
    print(json.dumps({"targets": r.get("targets"), "errors": r["errors"], "skipped": r["skipped"],
                      "wall_s": r["wall_s"]}, indent=2))  # fmt: skip
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
