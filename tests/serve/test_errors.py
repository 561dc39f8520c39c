"""What a client library will not send, through httpx: each bad request gets one OpenAI-style
JSON error with the right status naming the field, and the server stays up. The API key, the
caps, the full queue, /metrics, /health."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.helpers.serve import TIMEOUT, serving
from txlm.serve.config import ServeConfig

BAD = [
    # (body or raw bytes, status, words the message holds, the field)
    (b"{not json", 400, "not valid JSON", None),
    (b"[" * 100000, 400, "not valid JSON", None),
    (b"\xff\xfe", 400, "not valid JSON", None),
    ([1, 2], 400, "JSON object", None),
    ({}, 400, "'prompt' is required", "prompt"),
    ({"prompt": 3}, 400, "'prompt' must be", "prompt"),
    ({"prompt": "a", "max_tokens": "5"}, 400, "'max_tokens' must be an integer", "max_tokens"),
    ({"prompt": "a", "max_tokens": 5000}, 400, "--max-tokens", "max_tokens"),
    ({"prompt": "a", "n": 17}, 400, "--max-n", "n"),
    ({"prompt": "a", "n": 0}, 400, "'n' must be >= 1", "n"),
    ({"prompt": "a", "temperature": -1}, 400, "'temperature'", "temperature"),
    ({"prompt": "a", "top_p": 1.5}, 400, "'top_p'", "top_p"),
    ({"prompt": "a", "stream": "yes"}, 400, "'stream' must be true or false", "stream"),
    ({"prompt": "a", "frobnicate": 1}, 400, "unknown field 'frobnicate'", "frobnicate"),
    ({"prompt": "a", "best_of": 2}, 400, "'best_of' is not supported", "best_of"),
    ({"prompt": "a", "logit_bias": {"1": 5}}, 400, "takes only -100", "logit_bias"),
    ({"prompt": "a", "logit_bias": {"x": -100}}, 400, "keys are token ids", "logit_bias"),
    ({"prompt": "a", "logit_bias": {"99999": -100}}, 400, "outside the vocabulary", "logit_bias"),
    ({"prompt": "a", "min_p": 1.5}, 400, "'min_p'", "min_p"),
    ({"prompt": "a", "repetition_penalty": 0}, 400, "'repetition_penalty'", "repetition_penalty"),
    ({"prompt": "a", "suffix": "b"}, 400, "'suffix' is not supported", "suffix"),
    ({"prompt": "a", "max_tokens": 0}, 400, "without 'echo'", "max_tokens"),
    ({"prompt": [99999]}, 400, "outside the vocabulary", "prompt"),
    ({"prompt": "a", "stop": [""]}, 400, "'stop'", "stop"),
    ({"prompt": "a", "session": 5}, 400, "'session'", "session"),
    ({"prompt": ["a", "b"], "session": "s"}, 400, "one prompt and n = 1", "session"),
    ({"prompt": "a", "logprobs": 50}, 400, "--max-logprobs", "logprobs"),
    ({"prompt": "a" * 40000}, 413, "--max-prompt-tokens", "prompt"),
]


@pytest.mark.parametrize("body, status, words, param", BAD)
def test_bad_request(http, body, status, words, param):
    if isinstance(body, bytes):
        r = http.post("/v1/completions", content=body,
                      headers={"content-type": "application/json"})  # fmt: skip
    else:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param
    assert "Traceback" not in r.text
    assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_body_over_the_cap_is_413(http):
    r = http.post("/v1/completions", content=b" " * (4 * 2**20 + 1))
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]


def test_chat_and_unknown_routes_answer_in_json(http):
    r = http.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "use POST /v1/completions" in r.json()["error"]["message"]
    assert http.get("/v1/nothing").json()["error"]["code"] == 404
    assert (
        http.post("/v1/classify", json={"input": "a"})
        .json()["error"]["message"]
        .startswith("this server holds a language model")
    )


def test_health_models_and_metrics(http):
    assert http.get("/health").json() == {"status": "ok"}
    model = http.get("/v1/models").json()["data"][0]
    assert model["task"] == "lm" and model["vocab_size"] == 36
    assert model["lengths"]["mem_len"] == 16
    http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
    text = http.get("/metrics").text
    for name in (
        "txlm_requests_total",
        "txlm_generated_tokens_total",
        "txlm_queue_depth",
        "txlm_batch_size",
        "txlm_sessions",
        "txlm_session_bytes",
        "txlm_time_to_first_token_seconds_bucket",
        "txlm_token_latency_seconds_bucket",
    ):
        assert name in text  # fmt: skip
    assert 'route="/v1/completions",status="200"' in text


def test_the_api_key_is_required_on_v1_and_metrics(lm_path):
    with (
        serving(lm_path, ServeConfig(api_key="s3cret")) as s,
        httpx.Client(base_url=s.url, timeout=TIMEOUT) as http,
    ):
        body = {"prompt": "a", "max_tokens": 1}
        assert http.post("/v1/completions", json=body).status_code == 401
        wrong = {"Authorization": "Bearer s3creT"}
        assert http.post("/v1/completions", json=body, headers=wrong).status_code == 401
        assert http.get("/metrics", headers=wrong).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert http.post("/v1/completions", json=body, headers=good).status_code == 200
        assert http.get("/metrics", headers=good).status_code == 200
        assert http.get("/health").status_code == 200  # for load balancers, unguarded


def test_a_full_queue_answers_429_with_retry_after(lm_path):
    with (
        serving(lm_path, ServeConfig(max_queue=1)) as s,
        httpx.Client(base_url=s.url, timeout=TIMEOUT) as http,
    ):
        engine = s.engine
        engine.admitting.clear()  # nothing is admitted: the first request waits in the queue
        results = []
        waiting = threading.Thread(target=lambda: results.append(
            http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})))  # fmt: skip
        waiting.start()
        with engine.cond:
            assert engine.cond.wait_for(lambda: len(engine.pending) == 1, TIMEOUT)
        r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "--max-queue" in r.json()["error"]["message"]
        engine.admitting.set()
        waiting.join(TIMEOUT)
        assert results[0].status_code == 200


def test_health_and_routes_answer_503_while_the_model_loads(lm_path):
    from fastapi.testclient import TestClient

    from txlm.serve.application import create_app
    from txlm.serve.service import Service

    service = Service(lm_path, device="cpu")
    http = TestClient(create_app(service))  # outside a `with`: no lifespan, nothing loads
    assert http.get("/health").status_code == 503
    r = http.post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]


def test_a_request_over_its_time_cap_is_504_and_leaves(lm_path):
    with (
        serving(lm_path, ServeConfig(request_timeout=0.5)) as s,
        httpx.Client(base_url=s.url, timeout=TIMEOUT) as http,
    ):
        engine = s.engine
        engine.admitting.clear()  # nothing can be answered: the cap is what ends the request
        r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
        engine.admitting.set()
        assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).is_success


def test_bad_command_lines_are_one_line_and_exit_2(tmp_path, capsys):
    from txlm.cli import main

    assert main(["serve", str(tmp_path / "nothing")]) == 2
    assert main(["serve", str(tmp_path / "nothing"), "--max-batch", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("txlm: error: ") for line in err)
    assert "--max-batch" in err[1]
