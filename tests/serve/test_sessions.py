"""Sessions: a text sent in pieces scores as the whole, a continuation equals one request over
the concatenation, listing, deleting, eviction (404), one request at a time (409)."""

from __future__ import annotations

import itertools

import pytest
import torch

from txlm.inference.generate import generate
from txlm.inference.score import score

TEXT = (
    "ROMEO: but soft, what light through yonder window breaks. it is the east, and juliet "
    "is the sun. arise fair sun and kill the envious moon"
)


def new_session(http) -> str:
    r = http.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_a_text_sent_in_pieces_scores_as_the_whole(client, http, offline):
    model, vocab, lengths = offline
    sid = new_session(http)
    ids = vocab.encode(TEXT)  # 140 tokens: many segments of 16 with a memory of 16
    cuts = [0, 3, 4, 21, 40, 41, 57, 80, 96, 119, len(ids)]  # ten pieces, off the segment grid
    got = []
    for a, b in itertools.pairwise(cuts):
        r = client.completions.create(model="lm", prompt=ids[a:b], max_tokens=0, echo=True,
                                      logprobs=0, extra_body={"session": sid})  # fmt: skip
        got += r.choices[0].logprobs.token_logprobs
    assert got[0] is None and None not in got[1:]  # only the session's very first token
    want = score(model, ids, tgt_len=lengths.tgt_len, mem_len=lengths.mem_len)
    torch.testing.assert_close(torch.tensor(got[1:]), want, atol=1e-4, rtol=0)
    listed = {s["id"]: s for s in http.get("/v1/sessions").json()["data"]}
    assert listed[sid]["tokens"] == len(ids) and listed[sid]["bytes"] > 0
    assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    assert http.get(f"/v1/sessions/{sid}").status_code == 404


def test_a_continuation_equals_one_request_over_the_concatenation(client, http, offline):
    model, vocab, lengths = offline
    sid = new_session(http)
    first = client.completions.create(model="lm", prompt="ROMEO:", max_tokens=4, seed=1,
                                      extra_body={"session": sid}).choices[0].text  # fmt: skip
    second = client.completions.create(model="lm", prompt=" so", max_tokens=5, seed=2,
                                       extra_body={"session": sid}).choices[0].text  # fmt: skip
    # the session's text: what it read and what it wrote (within the memory: same context)
    whole = vocab.encode("ROMEO:" + first + " so")
    want = generate(model, whole, max_new_tokens=5, seed=2, lengths=lengths, vocab=vocab)[0]
    assert second == vocab.decode(want)
    assert http.get(f"/v1/sessions/{sid}").json()["tokens"] == len(whole) + 5


def test_unknown_and_evicted_sessions_are_refused_not_started_afresh(client, http, server):
    r = http.post("/v1/completions", json={"prompt": "a", "session": "nope"})
    assert r.status_code == 404 and "no session 'nope'" in r.json()["error"]["message"]
    ids = [new_session(http) for _ in range(server.service.config.max_sessions + 1)]
    r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "session": ids[0]})
    assert r.status_code == 404 and "evicted" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "session"
    ok = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "session": ids[-1]})
    assert ok.status_code == 200
    for sid in ids[1:]:
        http.delete(f"/v1/sessions/{sid}")


def test_a_session_in_use_is_refused_to_a_second_request(http, server):
    sid = new_session(http)
    held = server.service.sessions.acquire(sid)  # as a request in flight holds it
    try:
        r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "session": sid})
        assert r.status_code == 409 and "in use" in r.json()["error"]["message"]
    finally:
        server.service.sessions.release(held)
    r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "session": sid})
    assert r.status_code == 200
    http.delete(f"/v1/sessions/{sid}")


def test_eviction_by_bytes_keeps_the_newest(tmp_path):
    from txlm.serve.sessions import SessionStore

    store = SessionStore(max_sessions=10, max_bytes=100)
    a, b = store.create("a"), store.create("b")
    a.tail, b.tail = [0] * 8, [0] * 8  # 64 bytes each
    store.release(store.acquire("b"))  # b used last, and over the cap: a goes
    assert [s.id for s in store.list()] == ["b"]
    with pytest.raises(Exception, match="evicted"):
        store.acquire("a")
