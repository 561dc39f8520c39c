"""Generation speed: txlm cached vs txlm uncached vs transformers 4.37.2 TransfoXL ``generate``.

Same weights (a random Hugging Face model converted with ``txlm.checkpoints.convert``, parity
checked
before timing), same prompt, same number of new tokens, top-k 40 sampling, one process, rounds
interleaved (HF, cached, uncached, HF, ...) so load on the machine hits all three alike.

    txlm cached    txlm.generate: memory K/V cached per layer, one token projected per step
    txlm uncached  the same loop through model(...) with the hidden-state memory, which the
                   model re-projects every step (what Transformer-XL's forward does)
    hf             TransfoXLLMHeadModel.generate: carries ``mems`` between steps (re-projects
                   them each step too) and reads the prompt as one segment

Timed: the whole call (prompt + new tokens); tokens/s = new tokens / seconds. Also the
steady-state per-token time of the two txlm decoders (steps only, after the prompt).

Shapes: "small" (4 layers, d_model 256, 8x32 heads, d_inner 1024, the design's anchor shape,
vocab 10k full softmax) and "wt103-base" (paper Table 1: 16 layers, 410, 10x41, 2100, adaptive
softmax with div_val 1 and the paper's eval lengths tgt 64 / mem 640 / clamp 400 /
same_length), its vocabulary shrunk from 267,735 to 32,000 (cutoffs 8k/16k) to keep memory and
time down. The prompt fills the memory (HF starts from mem_len zero states, so it always
attends over a full memory; a shorter prompt would flatter txlm).
Random weights: speed does not depend on them.

    .venv/bin/python benchmarks/bench_generate.py [--quick]

Writes runs/bench/generate.json (--out; benchmarks/results/ holds the committed figures)
and prints it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from txlm import atomic
from txlm.checkpoints.convert import hf_config_to_model_config, load_hf_state_dict
from txlm.inference.decode import Decoder
from txlm.inference.generate import generate as txlm_generate
from txlm.inference.sampling import SamplingConfig
from txlm.model import TransformerXL

# scratch by default (under the current directory, as txlm train's runs/); --out
# benchmarks/results/generate.json updates the committed one
RESULTS = Path("runs") / "bench" / "generate.json"

SHAPES = {
    "small": dict(
        model=dict(
            vocab_size=10000, n_layer=4, d_model=256, n_head=8, d_head=32, d_inner=1024,
            tgt_len=128, mem_len=256, clamp_len=-1, same_length=False,
        ),
        prompt=256, new=128,
    ),
    "wt103-base": dict(
        model=dict(
            vocab_size=32000, n_layer=16, d_model=410, n_head=10, d_head=41, d_inner=2100,
            cutoffs=[8000, 16000], div_val=1, tgt_len=64, mem_len=640, clamp_len=400,
            same_length=True,
        ),
        prompt=640, new=48,
    ),
}  # fmt: skip


# -- weights: a random Hugging Face TransfoXL, converted with txlm.checkpoints.convert
# -------------------
def hf_model(shape: dict):
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    m = shape["model"]
    cfg = TransfoXLConfig(
        vocab_size=m["vocab_size"], cutoffs=m.get("cutoffs", []), d_model=m["d_model"],
        d_embed=m["d_model"], n_head=m["n_head"], d_head=m["d_head"], d_inner=m["d_inner"],
        div_val=m.get("div_val", 1), n_layer=m["n_layer"], mem_len=m["mem_len"],
        tgt_len=m["tgt_len"], clamp_len=m["clamp_len"], same_length=m["same_length"],
        untie_r=True, dropout=0.0, dropatt=0.0, adaptive=True,
        tie_projs=[False] + [True] * len(m.get("cutoffs", [])), eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TransfoXLLMHeadModel(cfg).eval()
    with torch.no_grad():  # HF leaves the relative biases uninitialised: give them values
        for name, p in model.named_parameters():
            if name.endswith(("r_w_bias", "r_r_bias")):
                p.normal_(0.0, 0.02)
    return model


def convert(hf) -> TransformerXL:
    """The same weights as a txlm model (txlm.checkpoints.convert's name map, strict both ways)."""
    config = hf_config_to_model_config(hf.config.to_dict())
    return load_hf_state_dict(hf.state_dict(), config).eval()


@torch.no_grad()
def parity(hf, ours: TransformerXL, ids: torch.Tensor) -> float:
    """Max |log-prob difference| over a segment; HF starts from mem_len zero memories
    (its init_mems), so ours is given the same."""
    out_hf = hf(ids).prediction_scores
    zeros = [torch.zeros(ids.size(0), hf.config.mem_len, hf.config.d_model)] * hf.config.n_layer
    out = ours(ids, mems=zeros).log_probs
    return float((out - out_hf).abs().max())


# -- timing -------------------------------------------------------------------------------------
def time_hf(hf, prompt: torch.Tensor, new: int, seed: int) -> float:
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf.generate(
            prompt, do_sample=True, top_k=40, max_new_tokens=new, min_new_tokens=new,
            pad_token_id=0,
        )  # fmt: skip
    seconds = time.perf_counter() - t
    assert out.size(1) == prompt.size(1) + new
    return seconds


def time_txlm(model: TransformerXL, prompt: list[int], new: int, seed: int, cache: bool) -> float:
    t = time.perf_counter()
    [out] = txlm_generate(model, prompt, max_new_tokens=new, seed=seed, use_cache=cache)
    seconds = time.perf_counter() - t
    assert len(out) == new
    return seconds


@torch.no_grad()
def step_ms(model: TransformerXL, prompt: list[int], steps: int, cache: bool) -> float:
    """Steady-state milliseconds per decoding step (memory already full)."""
    dec = Decoder(model, cache=cache)
    cfg = SamplingConfig()
    gen = torch.Generator().manual_seed(0)
    tok = dec.prefill([prompt], sampling=cfg, generator=gen)
    t = time.perf_counter()
    for _ in range(steps):
        tok = dec.step(tok, cfg, gen)  # what generation runs
    return (time.perf_counter() - t) / steps * 1e3


def bench_shape(name: str, shape: dict, rounds: int) -> dict:
    torch.manual_seed(0)
    hf = hf_model(shape)
    ours = convert(hf)
    g = torch.Generator().manual_seed(1)
    vocab = shape["model"]["vocab_size"]
    prompt = torch.randint(1, vocab, (1, shape["prompt"]), generator=g)
    check = parity(hf, ours, prompt[:, : shape["model"]["tgt_len"]])
    new = shape["new"]
    times: dict[str, list[float]] = {"hf": [], "txlm_cached": [], "txlm_uncached": []}
    time_txlm(ours, prompt[0].tolist(), 2, 0, True)  # warm-up (allocator, first-call costs)
    for r in range(rounds):
        times["hf"].append(time_hf(hf, prompt, new, r))
        times["txlm_cached"].append(time_txlm(ours, prompt[0].tolist(), new, r, True))
        times["txlm_uncached"].append(time_txlm(ours, prompt[0].tolist(), new, r, False))
        print(f"  {name} round {r}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
              file=sys.stderr)  # fmt: skip
    med = {k: statistics.median(v) for k, v in times.items()}
    steps = max(8, new // 2)
    cached_ms = step_ms(ours, prompt[0].tolist(), steps, True)
    uncached_ms = step_ms(ours, prompt[0].tolist(), steps, False)
    return {
        "model": shape["model"],
        "params": ours.num_parameters(),
        "prompt_tokens": shape["prompt"],
        "new_tokens": new,
        "rounds": rounds,
        "parity_max_abs_logprob_diff": check,
        "seconds_median": {k: round(v, 4) for k, v in med.items()},
        "seconds_all": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "tokens_per_s": {k: round(new / v, 2) for k, v in med.items()},
        "speedup_cached_vs_hf": round(med["hf"] / med["txlm_cached"], 2),
        "speedup_cached_vs_uncached": round(med["txlm_uncached"] / med["txlm_cached"], 2),
        "speedup_uncached_vs_hf": round(med["hf"] / med["txlm_uncached"], 2),
        "step_ms": {"txlm_cached": round(cached_ms, 3), "txlm_uncached": round(uncached_ms, 3)},
        "step_speedup_cached_vs_uncached": round(uncached_ms / cached_ms, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, fewer tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    result = {
        "benchmark": "generate",
        "command": "python benchmarks/bench_generate.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "sampling": "top-k 40, temperature 1",
        "shapes": {},
    }
    began = time.perf_counter()
    for name in args.shapes:
        shape = dict(SHAPES[name])
        if args.quick:
            shape["new"] = max(8, shape["new"] // 4)
        result["shapes"][name] = bench_shape(name, shape, 1 if args.quick else args.rounds)
    result["seconds"] = round(time.perf_counter() - began, 1)
    text = json.dumps(result, indent=2)
    atomic.write_text(args.out, text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
