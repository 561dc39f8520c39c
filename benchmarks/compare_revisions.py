"""Two revisions of txlm side by side in one process: is the new code slower than the old?

    git worktree add /tmp/old <rev>
    python benchmarks/compare_revisions.py --old /tmp/old/src [--threads 2 --rounds 5]

The old checkout's package is copied to a temporary directory as ``txlm_old`` (its imports
rewritten), so both import at once; the new one is the ``txlm`` on the path. Both models get
the same weights; each round times the old and the new code back to back on the same
workload, so load on a shared machine hits both alike, and reports old time / new time
(> 1: the new code is faster). Workloads at compare.py's "cpu" shape (4 layers, d_model 256,
batch 8 x 128, vocabulary 204, fp32): a training step (Adam), evaluation with 128 and 512
memory, plain and with the K/V cache, ``trainer``: ``Trainer.train_step`` as ``txlm train``
takes it (batching, the objective, clipping, fused Adam, the memory hand-over and reading the
step's numbers) on a generated character corpus at the same shape, and greedy decoding
(batch 1, mem 512, 32 tokens after a 512-token context, steps only: ``generate``).
``generate_call``: whole ``txlm.generate`` calls (decoder set-up, a 256-token prompt, 64 new
tokens drawn from the top 40: what a user times) on a model of bench_hf_baseline.py's shape
(d_model 256, a 10,000-word softmax without cutoffs); ``generate_call_hf``: the same calls on
bench_hf_baseline.py's model itself, a random transformers TransfoXL (adaptive softmax with no
cutoffs, shared position biases) converted by each revision's ``txlm.checkpoints.convert``;
``generate_call_samples``: the call with 4 samples of the prompt (``num_samples``). Either
side may be a revision with lengths held in the model (``set_lengths``) or passed per call
(``Lengths``). Writes runs/bench/compare_revisions.json (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import bench_hf_baseline  # (benchmarks/ is the script's directory)

# scratch by default (under the current directory, as txlm train's runs/); --out
# benchmarks/results/compare_revisions.json updates the committed one
RESULTS = Path("runs") / "bench" / "compare_revisions.json"
# wall clock by default; ``--clock cpu``: this process's CPU time, which other processes on a
# shared machine disturb far less than the wall clock (with --threads 1 it has no idle spin)
clock = time.perf_counter
SHAPE = dict(vocab_size=204, n_layer=4, d_model=256, n_head=8, d_head=32, d_inner=1024,
             tgt_len=128, mem_len=128, dropout=0.1, dropatt=0.0, cutoffs=[], div_val=1)  # fmt: skip


def import_old(src: Path, into: Path):
    """Copy ``src/txlm`` to ``into/txlm_old`` with its imports renamed; import it."""
    shutil.copytree(src / "txlm", into / "txlm_old")
    for f in (into / "txlm_old").rglob("*.py"):
        text = f.read_text()
        text = re.sub(r"\btxlm\.", "txlm_old.", text)
        text = re.sub(r"\bfrom txlm import\b", "from txlm_old import", text)
        f.write_text(text)
    sys.path.insert(0, str(into))
    return modules("txlm_old")


# each module the workloads use, where the package layout has it (newest first)
MODULES = {
    "config": ("config",),
    "model": ("model",),
    "generate": ("inference.generate", "generate"),
    "model.kv_eval": ("inference.kv_eval", "model.kv_eval"),
    "convert": ("checkpoints.convert", "convert"),
}


def modules(package: str) -> dict:
    """MODULES of ``package`` (txlm or txlm_old), whichever layout it has."""
    found = {}
    for name, places in MODULES.items():
        for place in places:
            try:
                found[name] = importlib.import_module(f"{package}.{place}")
                break
            except ModuleNotFoundError:
                continue
        else:
            raise ImportError(f"{package} has no {name} module")
    return found


# the HF-converted anchor of bench_hf_baseline.py: a full 10k softmax, no cutoffs
CALL_SHAPE = {**SHAPE, "vocab_size": 10000}


def hf_state() -> tuple[dict, dict]:
    """A random HF TransfoXL's config (a dict) and weights, seeded."""
    import warnings

    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = TransfoXLLMHeadModel(TransfoXLConfig(**bench_hf_baseline.SHAPE))
    return hf.config.to_dict(), hf.state_dict()


def converted(mods: dict, hf: tuple[dict, dict]):
    """The HF model as ``mods``' revision converts it."""
    convert = mods["convert"]
    return convert.load_hf_state_dict(hf[1], convert.hf_config_to_model_config(hf[0]))


def _trainer(package: str, work: Path):
    """A Trainer of ``package`` (txlm or txlm_old) at SHAPE on a generated character corpus:
    the same text, settings and seed on both sides."""
    training = importlib.import_module(f"{package}.training")
    try:
        config_module = importlib.import_module(f"{package}.training.config")
    except ImportError:  # older layout
        config_module = importlib.import_module(f"{package}.train_config")
    text = work / "corpus.txt"
    if not text.exists():
        g = torch.Generator().manual_seed(2)
        symbols = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?\n"
        ids = torch.randint(0, len(symbols), (200_000,), generator=g).tolist()
        text.write_text("".join(symbols[i] for i in ids))
    s = SHAPE
    sets = [f"data.dataset=text:{text}", f"data.data_dir={work / (package + '-data')}",
            "data.batch_size=8",
            f"model.n_layer={s['n_layer']}", f"model.d_model={s['d_model']}",
            f"model.n_head={s['n_head']}", f"model.d_head={s['d_head']}",
            f"model.d_inner={s['d_inner']}", f"model.tgt_len={s['tgt_len']}",
            f"model.mem_len={s['mem_len']}", f"model.dropout={s['dropout']}",
            "model.dropatt=0.0", "optim.max_steps=100000", "run.compile=false",
            "run.tensorboard=false", "run.progress=false"]  # fmt: skip
    config = config_module.resolve("debug", None, sets)
    return training.Trainer(config, work / f"{package}-run", echo=False)


def with_mem(model, mem: int) -> dict:
    """Keyword arguments for a forward with memory ``mem`` on either API: per call
    (``lengths=``), or set on the model (older revisions; then none)."""
    if hasattr(model, "set_lengths") or not hasattr(model, "lengths"):
        model.config = model.config.replace(mem_len=mem)
        return {}
    return {"lengths": model.lengths.replace(mem_len=mem)}


def decoder_class(mods: dict):
    """The cached decoder of either revision: ``Decoder`` (txlm.inference.decode), or
    ``CachedDecoder``
    in txlm.inference.decode or, older, txlm.generate; both take ``prefill(prompts)`` and
    ``step(ids)``."""
    modules = [mods["generate"]]
    with contextlib.suppress(ModuleNotFoundError):  # (a revision before txlm.inference.decode)
        modules.insert(
            0, importlib.import_module(modules[0].__name__.replace("generate", "decode"))
        )
    for module in modules:
        for name in ("Decoder", "CachedDecoder"):
            if hasattr(module, name):
                return getattr(module, name)
    raise ImportError("no decoder class in this revision")


def workloads(mods: dict, model, call_model, hf_model, ids: torch.Tensor, work: Path) -> dict:
    def train():
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        st = {"mems": None, "i": 0}

        def f():
            model.train()
            i = st["i"] % 5
            st["i"] += 1
            x, y = ids[:, i * 128 : (i + 1) * 128], ids[:, i * 128 + 1 : (i + 1) * 128 + 1]
            out = model(x, mems=st["mems"], labels=y)
            loss = out.loss if out.loss.dim() == 0 else out.loss.mean()  # either API
            opt.zero_grad()
            loss.backward()
            opt.step()
            st["mems"] = out.mems

        return f

    def evaluate(mem: int, kv: bool):
        def setup():
            model.eval()
            kw = with_mem(model, mem)
            runner = mods["model.kv_eval"].CachedEvaluator(model, **kw) if kv else None
            st = {"mems": None, "i": 0}

            def f():
                i = st["i"] % 5
                st["i"] += 1
                x = ids[:, i * 128 : (i + 1) * 128]
                with torch.no_grad():
                    if runner is not None:
                        runner(x, labels=x)
                    else:
                        st["mems"] = model(x, mems=st["mems"], labels=x, **kw).mems

            for _ in range(mem // 128):  # memory full before timing
                f()
            return f

        return setup

    def decode():
        model.eval()
        kw = with_mem(model, 512)
        ctx = torch.randint(0, 204, (1, 512), generator=torch.Generator().manual_seed(3))
        decoder = decoder_class(mods)

        def f():
            with torch.no_grad():
                dec = decoder(model, **kw)
                logp = dec.prefill(ctx.tolist())
                t = clock()
                for _ in range(32):
                    logp = dec.step(logp.argmax(-1))
                return clock() - t  # steps only

        return f

    def trainer():
        t = _trainer(mods["config"].__name__.split(".")[0], work)
        # the new step leaves its numbers on the device; the loop reads them (account)
        account = getattr(t, "account", None)
        return lambda: account(t.train_step()) if account else t.train_step()

    def generate_call(m, samples: int = 1):
        def setup():
            m.eval()
            prompt = torch.randint(0, 10000, (256,), generator=torch.Generator().manual_seed(4))
            state = {"seed": 0}

            def f():
                state["seed"] += 1
                mods["generate"].generate(
                    m, prompt.tolist(), max_new_tokens=64, top_k=40, seed=state["seed"],
                    num_samples=samples,
                )  # fmt: skip

            return f

        return setup

    return {
        "train": (train, 2),
        "trainer": (trainer, 2),
        "eval_m128": (evaluate(128, False), 3),
        "eval_m128_kv": (evaluate(128, True), 3),
        "eval_m512": (evaluate(512, False), 3),
        "eval_m512_kv": (evaluate(512, True), 3),
        "generate": (decode, 1),
        "generate_call": (generate_call(call_model), 1),
        "generate_call_hf": (generate_call(hf_model), 1),
        "generate_call_samples": (generate_call(call_model, 4), 1),
    }


def seconds(f, reps: int) -> float:
    t = clock()
    for _ in range(reps):
        r = f()
    return r if isinstance(r, float) else (clock() - t) / reps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the old checkout's src directory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default=None, help="comma-separated workloads")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    new_mods = modules("txlm")
    with tempfile.TemporaryDirectory() as tmp:
        old_mods = import_old(args.old, Path(tmp))
        torch.manual_seed(0)
        new = new_mods["model"].TransformerXL(new_mods["config"].ModelConfig(**SHAPE))
        old = old_mods["model"].TransformerXL(old_mods["config"].ModelConfig(**SHAPE))
        old.load_state_dict(new.state_dict())
        new_call = new_mods["model"].TransformerXL(new_mods["config"].ModelConfig(**CALL_SHAPE))
        old_call = old_mods["model"].TransformerXL(old_mods["config"].ModelConfig(**CALL_SHAPE))
        old_call.load_state_dict(new_call.state_dict())
        hf = hf_state()
        new_hf, old_hf = converted(new_mods, hf), converted(old_mods, hf)
        ids = torch.randint(0, 204, (8, 129 * 6), generator=torch.Generator().manual_seed(1))
        work = Path(tmp)
        runs = {
            "old": workloads(old_mods, old, old_call, old_hf, ids, work),
            "new": workloads(new_mods, new, new_call, new_hf, ids, work),
        }
        names = args.only.split(",") if args.only else list(runs["new"])
        result: dict = {
            "threads": args.threads, "rounds": args.rounds, "clock": args.clock, "workloads": {}
        }  # fmt: skip
        for name in names:
            fns = {}
            for side in ("old", "new"):
                make, reps = runs[side][name]
                fns[side] = (make(), reps)
                seconds(*fns[side])  # warm
            ratios = []
            for _ in range(args.rounds):
                t = {side: seconds(*fns[side]) for side in ("old", "new")}
                ratios.append(round(t["old"] / t["new"], 3))
            row = {"new_speed_vs_old": statistics.median(ratios), "rounds": ratios}
            result["workloads"][name] = row
            print(name, row, flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
