"""A bounded load: 32 clients x 4 requests at once, every response complete and equal to
offline generation; resident memory after 500 requests within 10% of after the first 50."""

from __future__ import annotations

import resource
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.helpers.serve import TIMEOUT, serving
from txlm.inference.generate import generate
from txlm.serve.config import ServeConfig

PROMPTS = ["ROMEO:", "to be or not", "a", "the quick brown fox jumps"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_32_clients_get_complete_answers_equal_to_offline(lm_path, offline):
    model, vocab, lengths = offline
    jobs = [(c, k) for c in range(32) for k in range(4)]

    def body(c, k):
        # 16 different requests, each sent by 8 clients at once
        p = (c + k) % 4
        return {"prompt": PROMPTS[p], "max_tokens": 3 + 2 * p, "seed": k}

    want = {}
    for c, k in jobs:
        b = body(c, k)
        key = b["prompt"], b["seed"]
        if key not in want:
            ids = generate(model, vocab.encode(b["prompt"]), max_new_tokens=b["max_tokens"],
                           seed=b["seed"], lengths=lengths, vocab=vocab)[0]  # fmt: skip
            want[key] = vocab.decode(ids)
    with (
        serving(lm_path, ServeConfig(max_batch=16)) as s,
        httpx.Client(
            base_url=s.url, timeout=TIMEOUT, limits=httpx.Limits(max_connections=32)
        ) as http,
    ):

        def client(c):
            return [http.post("/v1/completions", json=body(c, k)).json() for k in range(4)]

        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(client, range(32)))
        for c, got in enumerate(answers):
            for k, r in enumerate(got):
                b = body(c, k)
                assert r["choices"][0]["text"] == want[b["prompt"], b["seed"]], (c, k)
                assert r["choices"][0]["finish_reason"] == "length"
        # resident memory does not grow with the requests served
        small = {"prompt": "ab", "max_tokens": 2, "seed": 1}
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: http.post("/v1/completions", json=small), range(50)))
            after_50 = _rss()
            list(pool.map(lambda _: http.post("/v1/completions", json=small), range(450)))
            after_500 = _rss()
    assert after_500 <= 1.1 * after_50, (after_50, after_500)
