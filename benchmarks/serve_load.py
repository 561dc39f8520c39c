"""txlm serve under load, side by side with offline generation in one run.

For 1, 4 and 16 concurrent streaming clients (each one request of --tokens tokens, its own
seed): the server's tokens/s, time to first token p50 / p95, against offline
``txlm.generate`` at the same batch size (the anchor) and against serving the same requests
one at a time. Then a session that continues with a --piece-token piece after --history
tokens against resending the whole text. Ratios are what to read; the JSON holds every figure.

    python benchmarks/serve_load.py --preset shakespeare-char --threads 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

CHARS = "abcdefghijklmnopqrstuvwxyz ,.:\nROMEO"


def checkpoint(directory: Path, preset: str) -> Path:
    from tests.helpers.models import spread_weights

    import txlm
    from txlm.config import ModelConfig
    from txlm.data.vocab import Vocab
    from txlm.model import TransformerXL

    vocab = Vocab.build_char(Counter(CHARS))
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig.from_preset(preset, vocab_size=len(vocab), dropout=0.0))
    return txlm.save(spread_weights(model, 0.05), directory, vocab_json=vocab.to_json())


@contextlib.contextmanager
def server(path: Path, max_batch: int, threads: int):
    """``txlm serve`` in its own process (the clients here do not share its interpreter)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, "-m", "txlm", "serve", str(path), "--port", "0", "--device", "cpu",
            "--threads", str(threads), "--max-batch", str(max_batch),
            "--max-prompt-tokens", str(10**6)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        if " at http" not in line:
            raise SystemExit(f"txlm serve did not start: {line!r}")
        yield line.split(" at ")[1].strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def stream_one(http, prompt: str, tokens: int, seed: int) -> tuple[float, float, int]:
    """(time to first token, total seconds, tokens) of one streaming request."""
    began = time.perf_counter()
    first, count = None, 0
    body = {"prompt": prompt, "max_tokens": tokens, "seed": seed, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                count += 1
                first = first or time.perf_counter() - began
    return first or 0.0, time.perf_counter() - began, count


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="shakespeare-char")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--history", type=int, default=10000)
    ap.add_argument("--piece", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import httpx

    from txlm.checkpoints.checkpoint import Checkpoint
    from txlm.inference.generate import generate

    prompt = "ROMEO: but soft, what light through yonder window breaks"
    result: dict = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "preset": args.preset, "tokens": args.tokens,
        "clients": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp) / "m", args.preset)
        ckpt = Checkpoint.open(path)
        model, vocab, lengths = ckpt.load_model("cpu"), ckpt.vocab(), ckpt.lengths()
        ids = vocab.encode(prompt)
        clients = [int(c) for c in args.clients.split(",")]
        with (
            server(path, max(clients), torch.get_num_threads()) as url,
            httpx.Client(
                base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)
            ) as http,
        ):
            stream_one(http, prompt, 4, 0)  # warm up
            for k in clients:
                began = time.perf_counter()
                generate(model, [ids] * k, max_new_tokens=args.tokens, seed=0, lengths=lengths)
                offline = k * args.tokens / (time.perf_counter() - began)
                began = time.perf_counter()
                with ThreadPoolExecutor(k) as pool:
                    runs = list(pool.map(lambda i: stream_one(http, prompt, args.tokens, i),
                                         range(k)))  # fmt: skip
                served = sum(r[2] for r in runs) / (time.perf_counter() - began)
                began = time.perf_counter()
                alone = [stream_one(http, prompt, args.tokens, i) for i in range(k)]
                serial = sum(r[2] for r in alone) / (time.perf_counter() - began)
                ttft = [r[0] for r in runs]
                result["clients"][k] = {
                    "offline_tokens_per_s": round(offline, 1),
                    "served_tokens_per_s": round(served, 1),
                    "one_at_a_time_tokens_per_s": round(serial, 1),
                    "served_over_offline": round(served / offline, 3),
                    "served_over_one_at_a_time": round(served / serial, 2),
                    "ttft_p50_s": round(statistics.median(ttft), 4),
                    "ttft_p95_s": round(percentile(ttft, 0.95), 4),
                }
                print(k, result["clients"][k], flush=True)
            # a session: history once, then a piece; against resending history + piece
            text = (prompt + " ") * (args.history // (len(prompt) + 1) + 2)
            history, piece = text[: args.history], text[args.history : args.history + args.piece]
            sid = http.post("/v1/sessions", json={}).json()["id"]
            body = {"max_tokens": 1, "seed": 0, "session": sid}
            http.post("/v1/completions", json={**body, "prompt": history}).raise_for_status()
            began = time.perf_counter()
            http.post("/v1/completions", json={**body, "prompt": piece}).raise_for_status()
            session_s = time.perf_counter() - began
            began = time.perf_counter()
            whole = {"prompt": history + piece, "max_tokens": 1, "seed": 0}
            http.post("/v1/completions", json=whole).raise_for_status()
            resend_s = time.perf_counter() - began
            result["session"] = {
                "history": args.history, "piece": args.piece,
                "session_s": round(session_s, 4), "resend_s": round(resend_s, 4),
                "speedup": round(resend_s / session_s, 1),
            }  # fmt: skip
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
