"""The decoding step compiled ahead of time by AOTInductor, against the eager step.

What a compiled step costs a later process: ``torch.compile``'s caches still leave it
importing the compiler and dynamo's trace of the step (docs/performance-cpu.md). AOTInductor
(``torch.export`` then ``torch._inductor.aoti_compile_and_package``) writes the step as one
shared library in a ``.pt2`` package, which torch's C++ loader
(``torch._C._aoti.AOTIModelPackageLoader``) opens without the compiler or dynamo. This
script measures that way for the shape of ``decode_floor.py`` (d_model 256, 4 layers, a 10k
full softmax, memory 512, the prompt filling the memory), fp32, greedy, for each batch size:

    export_s, compile_s   torch.export of the step, then AOTInductor's compile and package
    load_s                a new process: torch's import, then opening the package and its
                          first call (both timed; the import apart)
    step_ms               rounds of ``--steps`` steps, interleaved with the eager decoder's
                          (``Decoder.step``), best round of each; the ratio the median of the
                          per-round ratios
    same_ids              the packaged step draws the eager step's greedy ids, every step

The step exported is the decoder's own one-token step (``Decoder._token``: the model's
forward over the static cache, the output layer, the draw) as a module whose inputs are
the ids and the cache's tensors the step writes (keys and values, slot positions, the next
position), written in place by the packaged code as by the eager one; the weights and the
cache's position tables are the package's constants, compiled with the packaged step's
settings (``txlm.inference.packaged.options``: the weights frozen and packed, one row through
inductor's C++ template).

    python benchmarks/decode_aoti.py [--threads 1] [--batches 1,16] [--steps 30] [--rounds 5]

Writes runs/bench/decode_aoti.json (--out) and prints each row.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_floor import GREEDY, SHAPE, machine, write_result
from txlm.config import ModelConfig
from txlm.inference.decode import Decoder
from txlm.inference.packaged import options
from txlm.model import TransformerXL

RESULTS = Path("runs") / "bench" / "decode_aoti.json"
STATE = ("kv", "pos", "next_pos")  # the cache's tensors a step writes


class Step(nn.Module):
    """The decoder's greedy one-token step as a module: (ids [B], kv, pos, next_pos) -> the
    next ids [B], the cache's tensors written in place. The decoder's cache object is
    pointed at the given tensors for the call."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.net, self.head = decoder.net, decoder.head  # (their weights: the constants)
        self.decoder = [decoder]  # (a list: not a submodule)

    def forward(self, ids: Tensor, kv: Tensor, pos: Tensor, next_pos: Tensor) -> Tensor:
        decoder = self.decoder[0]
        cache = decoder.cache
        held = [getattr(cache, name) for name in STATE]
        cache.kv, cache.pos, cache.next_pos = kv, pos, next_pos
        try:
            return decoder._token(ids, None, GREEDY)
        finally:
            cache.kv, cache.pos, cache.next_pos = held


def prefilled(net: TransformerXL, batch: int) -> tuple[Decoder, Tensor]:
    decoder = Decoder(net, compile="eager")  # (the static cache a compiled step runs over)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, net.config.vocab_size, (batch, net.config.mem_len), generator=g)
    ids = decoder.prefill(prompts.tolist(), sampling=GREEDY)
    decoder._narrow()  # (the one-token steps' cache of mem_len + 1 slots)
    return decoder, ids


def package(net: TransformerXL, batch: int, path: Path) -> dict:
    """Export the step of a prefilled decoder and package it at ``path``."""
    decoder, ids = prefilled(net, batch)
    cache = decoder.cache
    assert cache is not None
    state = [getattr(cache, name).clone() for name in STATE]  # (ordinary tensors)
    t = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(Step(decoder), (ids.clone(), *state), strict=False)
    exported = time.perf_counter() - t
    t = time.perf_counter()
    configs = options(batch, "fp32")  # (the packaged step's, txlm.inference.packaged)
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(path), inductor_configs=configs
    )
    return {"export_s": round(exported, 2), "compile_s": round(time.perf_counter() - t, 2)}


LOAD = """
import sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
loader = torch._C._aoti.AOTIModelPackageLoader(sys.argv[1], "model", False, 1, -1)
shapes = [int(x) for x in sys.argv[2:]]
kv = torch.zeros(shapes[:6]); pos = torch.zeros(shapes[6], dtype=torch.long)
loader.run([torch.zeros(shapes[7], dtype=torch.long), kv, pos, torch.zeros((), dtype=torch.long)])
t2 = time.perf_counter()
print(round(t1 - t0, 3), round(t2 - t1, 3))
"""


def load_in_a_new_process(path: Path, decoder: Decoder, batch: int) -> dict:
    cache = decoder.cache
    assert cache is not None
    shapes = [*cache.kv.shape, cache.pos.numel(), batch]
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(path), *map(str, shapes)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    import_s, load_s = map(float, out.stdout.split())
    return {"torch_import_s": import_s, "load_s": load_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            rows = [run(int(b), args, Path(scratch)) for b in args.batches.split(",")]
    finally:
        torch.set_num_threads(saved)
    result = {**machine(args.threads), "shape": SHAPE, "rows": rows}
    write_result(args.out, result)
    return 0


def run(batch: int, args: argparse.Namespace, scratch: Path) -> dict:
    torch.manual_seed(0)
    net = TransformerXL(ModelConfig.from_preset("debug", **SHAPE)).eval()
    path = scratch / f"step_b{batch}.pt2"
    row: dict = {"batch": batch, **package(net, batch, path)}
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    packaged, ids_p = prefilled(net, batch)
    eager = Decoder(net)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, net.config.vocab_size, (batch, net.config.mem_len), generator=g)
    ids_e = eager.prefill(prompts.tolist(), sampling=GREEDY)
    cache = packaged.cache
    assert cache is not None
    state = [getattr(cache, name) for name in STATE]
    same = torch.equal(ids_p, ids_e)
    times: dict[str, list[float]] = {"eager": [], "aoti": []}
    for _ in range(args.rounds):
        drawn = []
        t = time.perf_counter()
        for _ in range(args.steps):
            (ids_p,) = loader.run([ids_p, *state])
            drawn.append(ids_p)
        times["aoti"].append((time.perf_counter() - t) / args.steps)
        t = time.perf_counter()
        for k in range(args.steps):
            ids_e = eager.step(ids_e, GREEDY)
            drawn[k] = torch.equal(drawn[k], ids_e)  # (compared after its round's timing)
        times["eager"].append((time.perf_counter() - t) / args.steps)
        same = same and all(drawn)
    row["same_ids"] = same
    row["eager_step_ms"] = round(min(times["eager"]) * 1e3, 3)
    row["aoti_step_ms"] = round(min(times["aoti"]) * 1e3, 3)
    ratios = [e / a for e, a in zip(times["eager"], times["aoti"], strict=True)]
    row["aoti_vs_eager"] = round(statistics.median(ratios), 2)
    row.update(load_in_a_new_process(path, packaged, batch))
    print(row, flush=True)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
