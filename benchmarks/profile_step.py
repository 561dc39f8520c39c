"""Where a txlm training step / evaluation forward spends its time (torch.profiler, CPU), and
how many operations a training step and a decoded token launch.

    python benchmarks/profile_step.py                    # cpu config, fp32, train + eval
    python benchmarks/profile_step.py --config d512 --threads 1
    python benchmarks/profile_step.py --ops              # operation counts, wt103-base shape

``--ops``: every aten operation that does work (views and other metadata-only operations
left out), counted with a dispatch mode in one training step (batch 2 x 150, mem 150: the
count does not depend on the batch) and per decoded token (batch 1, mem 512, greedy) of the
wt103-base shape, vocabulary cut to 32k (cutoffs 8k/16k) to fit a CPU. On a GPU each is
roughly one kernel launch: fewer is the CPU-visible proxy for launch overhead. ``--compiled``
adds the traced step: the decoding step compiled by inductor (as ``txlm generate --compile``
builds it), counted as the kernels its generated code calls per token (fused C++ kernels
and library calls such as the matrix products; a few minutes to compile on a CPU), and as
the outermost loop nests of its fused kernels (the CPU backend puts many nests into one
kernel function; on a GPU each is about one kernel: see ``loop_nests``), and as the Triton
kernels inductor partitions the same step into for a GPU (``triton_partition``: generated
here, not run), for the scores step and for the token step with a top-k 40 draw. Writes
runs/bench/profile_ops.json (``--out``). ``PYTHONPATH=<another checkout>/src`` counts
that code instead (the before/after figures of a change).

Self CPU time of every aten op, summed into groups (matmul, dropout RNG, softmax, ...), as
shares of the profiled total, plus the ten most expensive ops. Writes
runs/bench/profile_<config>.json (``--out``). The groups answer "what is left besides the
matmuls": on a machine whose matmuls run near peak, the non-matmul share bounds the MFU.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import torch
from torch._C import DispatchKey
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from compare import SHAPES, build_pair, make_eval, make_train
from inductor_code import compiled_code, kernel_counts, loop_nests, triton_partition

# a scratch folder by default; --out benchmarks/results/... updates the committed file
SCRATCH = Path("runs") / "bench"

GROUPS = {
    "matmul": ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::baddbmm_"),
    "fused_attention": ("aten::_scaled_dot_product",),
    # bernoulli_: F.dropout's mask; random_ / shifts / and: txlm.model.dropout's packed mask
    "dropout_rng": ("aten::bernoulli_", "aten::random_", "aten::__rshift__", "aten::bitwise_and"),
    "softmax": (
        "aten::_softmax",
        "aten::_softmax_backward_data",
        "aten::_log_softmax",
        "aten::_log_softmax_backward_data",
    ),
    "layer_norm": ("aten::native_layer_norm", "aten::native_layer_norm_backward"),
    "copies": ("aten::copy_", "aten::cat", "aten::fill_", "aten::zero_", "aten::index_select"),
    "optimizer": ("aten::_foreach", "aten::lerp", "aten::addcmul", "aten::addcdiv", "aten::sqrt"),
}


def group_of(name: str) -> str:
    for group, prefixes in GROUPS.items():
        if any(name.startswith(p) for p in prefixes):
            return group
    return "other_elementwise"


def summarise(fn, steps: int) -> dict:
    fn()  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    groups: dict[str, float] = {}
    for e in events:
        g = group_of(e.key)
        groups[g] = groups.get(g, 0.0) + e.self_cpu_time_total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
    return {
        "ms_per_step": round(total / steps / 1e3, 1),
        "groups_share": {
            g: round(t / total, 3) for g, t in sorted(groups.items(), key=lambda x: -x[1])
        },
        "top_ops_share": {e.key: round(e.self_cpu_time_total / total, 3) for e in top},
    }


# operations that only make a new view or read metadata: no kernel on a GPU
_METADATA_OPS = {
    "view", "_unsafe_view", "as_strided", "transpose", "t", "unsqueeze", "squeeze", "expand",
    "slice", "select", "permute", "reshape", "split", "split_with_sizes", "chunk", "unflatten",
    "flatten", "detach", "alias", "unbind", "narrow", "empty", "empty_strided", "lift_fresh",
    "_reshape_alias", "view_as", "expand_as", "numpy_T", "sym_size", "sym_stride", "is_same_size",
}  # fmt: skip


class CountOps(TorchDispatchMode):
    """Counts the aten operations that do work, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.has_kernel_for_dispatch_key(DispatchKey.CompositeImplicitAutograd):
            # a composite operation (linear, matmul, to, ...; they reach a dispatch mode
            # under inference_mode): count the operations it is made of, not itself
            with self:
                return func.decompose(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name not in _METADATA_OPS:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **kwargs)


def triton_kernels(model, opts: dict, prompt: list[int], sampling) -> dict:
    """Kernels a GPU runs per decoded token: the compiled step (scores, ``sampling`` None,
    or the token step with its draw) partitioned into Triton kernels (``triton_partition``),
    by kind (``kernel_counts``)."""
    from txlm.inference.decode import Decoder

    dec = Decoder(model, compile=True, cuda_graph=False, **opts)
    logp = dec.prefill([prompt])
    inputs: tuple = (logp.argmax(-1),)
    if sampling is not None:
        from txlm.inference.sampling import draw_noise

        inputs += (draw_noise(sampling, 1, model.config.vocab_size, None),)
    with triton_partition():
        codes = compiled_code(dec._stepper(*([] if sampling is None else [sampling])), *inputs)
    return kernel_counts(codes)


def count_ops(compiled: bool = False) -> dict:
    """Operations per training step and per decoded token at the wt103-base shape."""
    import txlm
    from txlm.config import ModelConfig

    try:
        from txlm.inference.decode import Decoder
    except ImportError:  # a revision from before txlm.inference.decode.Decoder
        try:
            from txlm.inference.decode import CachedDecoder as Decoder
        except ImportError:  # from before txlm.inference.decode
            from txlm.inference.generate import CachedDecoder as Decoder

    config = ModelConfig.from_preset(
        "wt103-base", vocab_size=32000, cutoffs=[8000, 16000], dropout=0.1, dropatt=0.0
    )
    torch.manual_seed(0)
    model = txlm.TransformerXL(config)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)  # as txlm train
    ids = torch.randint(0, config.vocab_size, (2, config.tgt_len + 1))
    state: dict = {"mems": None}

    def train_step() -> None:
        out = model(ids[:, :-1], mems=state["mems"], labels=ids[:, 1:])
        loss = out.loss if out.loss.dim() == 0 else out.loss.mean()  # either API
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        state["mems"] = out.mems

    train_step()  # memory filled: the counted step is a steady-state one
    with CountOps() as train_ops:
        train_step()

    model.eval()
    if hasattr(model, "set_lengths"):  # a revision with lengths held in the model
        model.set_lengths(mem_len=512)
        opts: dict = {}
    else:
        opts = {"lengths": model.lengths.replace(mem_len=512)}
    prompt = torch.randint(0, config.vocab_size, (512,)).tolist()
    tokens = 8

    def decode(**extra) -> dict:
        with torch.no_grad():
            dec = Decoder(model, **opts, **extra)
            logp = dec.prefill([prompt])
            for _ in range(3):  # past the first step (a CUDA graph captures on the second)
                logp = dec.step(logp.argmax(-1))
            with CountOps() as decode_ops:
                for _ in range(tokens):
                    logp = dec.step(logp.argmax(-1))
        return {k: v / tokens for k, v in decode_ops.counts.items()}

    per_token = decode()
    # through the modules only, where the code has the CPU one-token step (txlm.model.one_token)
    modules = (
        decode(one_token=False) if "one_token" in inspect.signature(Decoder).parameters else None
    )

    def top(counts: dict) -> dict:
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    traced, nests, partition = None, None, None
    if compiled:
        with torch.no_grad():
            dec = Decoder(model, compile=True, cuda_graph=False, **opts)
            logp = dec.prefill([prompt])
            ids = logp.argmax(-1)
            codes = compiled_code(dec._stepper(), ids)
            traced, nests = kernel_counts(codes), loop_nests(codes)
            partition = {"scores": triton_kernels(model, opts, prompt, None)}
            if "sampling" in inspect.signature(dec._stepper).parameters:  # the draw inside
                from txlm.inference.sampling import SamplingConfig

                top_k = SamplingConfig(top_k=40)
                partition["top_k_40"] = triton_kernels(model, opts, prompt, top_k)

    return {
        "shape": "wt103-base (16 layers, d_model 410, 10 x 41 heads, vocab 32k adaptive)",
        "train_batch": "2 x 150, mem 150, dropout 0.1, fused Adam",
        "train_ops_per_step": sum(train_ops.counts.values()),
        "decode_ops_per_token": round(sum(per_token.values()), 1),
        "decode_ops_per_token_modules": None
        if modules is None
        else round(sum(modules.values()), 1),
        "decode_kernels_per_token_compiled": None if traced is None else sum(traced.values()),
        "decode_kernels_compiled": traced,
        "decode_loop_nests_per_token_compiled": nests,
        "decode_kernels_per_token_triton": None
        if partition is None
        else {k: sum(v.values()) for k, v in partition.items()},
        "decode_kernels_triton": partition,
        "train_ops": top(train_ops.counts),
        "decode_ops": top(per_token),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", action="store_true", help="operation counts (wt103-base shape)")
    ap.add_argument("--compiled", action="store_true", help="with --ops: the compiled step too")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--config", default="cpu", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.ops:
        result = count_ops(compiled=args.compiled)
        out = args.out or SCRATCH / "profile_ops.json"
        if out.exists():  # keep the counts of other revisions recorded there
            result.update({k: v for k, v in json.loads(out.read_text()).items() if "before" in k})
        text = json.dumps(result, indent=2)
        print(text)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        return 0
    s = SHAPES[args.config]
    _, tx = build_pair(s)
    result = {
        "config": args.config,
        "dtype": args.dtype,
        "threads": args.threads,
        "train": summarise(make_train("txlm", tx, s, args.dtype), args.steps),
        "eval_m512": summarise(make_eval("txlm", tx, s, args.dtype, 512), args.steps),
    }
    text = json.dumps(result, indent=2)
    print(text)
    out = args.out or SCRATCH / f"profile_{args.config}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
