"""Continuous batching: concurrent requests share the decoder's batch, join as rows free up
and leave when done, and every row's ids equal the request run alone; a client that goes away
frees its row."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.serve import TIMEOUT, serving
from txlm.inference.compiled import StepCompile, bucket
from txlm.inference.generate import generate
from txlm.serve.config import ServeConfig

REQUESTS = [  # prompt, max_tokens, settings, n
    ("ROMEO:", 12, {}, 1),
    ("a longer prompt of more than one segment of sixteen tokens, and more", 14, {}, 2),
    ("to be", 5, {"temperature": 0}, 1),
    ("or not to be, that is", 17, {"temperature": 0.8, "top_p": 0.9}, 3),
    ("x", 9, {"top_k": 3}, 1),
    ("the question whether tis nobler in the mind", 20, {"top_k": 10}, 2),
    ("", 8, {}, 1),
    ("suffer the slings", 14, {"temperature": 1.3}, 1),
    ("and arrows", 11, {}, 2),
    ("of outrageous fortune", 6, {"temperature": 0}, 1),
]


def _offline(offline, prompt, max_tokens, settings, n, seed):
    model, vocab, lengths = offline
    from txlm.inference.prompts import start_token

    temperature = settings.get("temperature", 1.0)
    return [
        vocab.decode(generate(
            model, vocab.encode(prompt), max_new_tokens=max_tokens, seed=seed + j,
            lengths=lengths, top_k=settings.get("top_k", 40), top_p=settings.get("top_p"),
            temperature=temperature or 1.0, greedy=temperature == 0,
            start_id=start_token(vocab), vocab=vocab,  # (<unk> banned, as the server bans it)
        )[0])
        for j in range(n)  # row j: the prompt alone with seed + j
    ]  # fmt: skip


@pytest.mark.parametrize("compile", ["off", "compiled"])
def test_concurrent_rows_equal_each_request_alone(lm_path, offline, compile, request):
    """8 rows at a time: the later requests wait and join as earlier ones leave. Compiled
    (``--compile on``; here dynamo's graph run as traced, what inductor would be given), the
    batch runs its bucket, the padding rows' outputs dropped: the same texts, and rows that
    join or leave within a bucket trace nothing: one graph per bucket."""
    step, graphs = False, []
    if compile == "compiled":
        request.getfixturevalue("fresh_dynamo")

        def backend(gm, example_inputs):  # the traced step run as it is (eagerly), counted
            graphs.append(gm)
            return gm.forward

        step = StepCompile(backend=backend)
    with (
        serving(lm_path, ServeConfig(max_batch=8), compile=step) as s,
        httpx.Client(base_url=s.url, timeout=TIMEOUT) as http,
    ):
        engine = s.engine
        sizes = []
        engine.step_hook = lambda e: sizes.append(sum(j.rows for j in e.active))
        sid = http.post("/v1/sessions", json={}).json()["id"]
        engine.admitting.clear()  # every request queued before the first is admitted

        def ask(i):
            prompt, max_tokens, settings, n = REQUESTS[i]
            body = {"prompt": prompt, "max_tokens": max_tokens, "n": n, "seed": 100 + i,
                    **settings}  # fmt: skip
            if i == 0:
                body["session"] = sid
            return http.post("/v1/completions", json=body)

        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            futures = [pool.submit(ask, i) for i in range(len(REQUESTS))]
            with engine.cond:
                assert engine.cond.wait_for(lambda: len(engine.pending) == len(REQUESTS),
                                            TIMEOUT)  # fmt: skip
            engine.admitting.set()
            answers = [f.result(TIMEOUT) for f in futures]
    for i, r in enumerate(answers):
        prompt, max_tokens, settings, n = REQUESTS[i]
        assert r.status_code == 200, r.text
        got = [c["text"] for c in r.json()["choices"]]
        assert got == _offline(offline, prompt, max_tokens, settings, n, 100 + i), i
    assert max(sizes) == 8  # the batch was full
    assert len(set(sizes)) > 2  # rows joined and left between steps
    if step:  # every step ran its batch's bucket, padded: a graph per bucket
        assert any(n != bucket(n) for n in sizes)
        assert len(graphs) == len({bucket(n) for n in sizes}) > 1


def test_a_client_that_goes_away_frees_its_row(server, http, monkeypatch):
    engine = server.engine
    long = 4000  # (no other request asks for as many tokens: its job among the others)

    def ours(e):
        return [j for j in e.active if j.max_tokens == long]

    def hold(e):  # once its text went out, no step until its client is gone: it cannot finish
        if any(text.emitted for job in ours(e) for text in job.texts):
            with e.cond:
                assert e.cond.wait_for(lambda: all(j.cancelled for j in ours(e)), TIMEOUT)

    monkeypatch.setattr(engine, "step_hook", hold)
    body = {"prompt": "ROMEO:", "max_tokens": long, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # (kept: a dropped line iterator closes the connection)
        first = next(lines)
        assert first.startswith("data: ")
        with engine.cond:  # (its first token may arrive before its row joins the batch)
            assert engine.cond.wait_for(lambda: ours(engine), TIMEOUT)
    # the stream closed mid-way: its row leaves at the next step
    with engine.cond:
        assert engine.cond.wait_for(lambda: not ours(engine), TIMEOUT)
    ok = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_request_that_fails_inside_the_engine_leaves_the_others_alone(
    lm_path, offline, monkeypatch
):
    from txlm.serve import engine as engine_module

    def broken(*args, **kwargs):
        raise RuntimeError("a fault in reading one request")

    monkeypatch.setattr(engine_module, "read_piece", broken)  # what echo reads prompts with
    with (
        serving(lm_path) as s,
        httpx.Client(base_url=s.url, timeout=TIMEOUT) as http,
        ThreadPoolExecutor(3) as pool,
    ):
        engine = s.engine
        engine.admitting.clear()  # the three are admitted together, into one batch
        bodies = [
            {"prompt": "ROMEO:", "max_tokens": 6, "seed": 1},
            {"prompt": "ROMEO:", "max_tokens": 6, "echo": True, "logprobs": 0, "seed": 1},
            {"prompt": "to be", "max_tokens": 9, "seed": 2},
        ]
        futures = [pool.submit(http.post, "/v1/completions", json=b) for b in bodies]
        with engine.cond:
            assert engine.cond.wait_for(lambda: len(engine.pending) == 3, TIMEOUT)
        engine.admitting.set()
        first, failed, third = (f.result(TIMEOUT) for f in futures)
    assert failed.status_code == 500
    assert failed.json()["error"]["message"] == "internal error: RuntimeError"
    assert first.json()["choices"][0]["text"] == _offline(offline, "ROMEO:", 6, {}, 1, 1)[0]
    assert third.json()["choices"][0]["text"] == _offline(offline, "to be", 9, {}, 1, 2)[0]
