"""``txlm serve`` as a process: it prints its URL, and SIGTERM ends an open stream with a
final event and exits 0. A classifier checkpoint serves /v1/classify as ``txlm classify``
reads it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.helpers.classify import save_classifier, tiny_lm
from tests.helpers.serve import TIMEOUT, serving

ROOT = Path(__file__).resolve().parents[2]


def _line(stream) -> str:
    """One line of ``stream``, read in a thread so that a silent process fails the test
    after TIMEOUT instead of hanging it."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(TIMEOUT)
    assert out, "the server printed nothing"
    return out[0]


def test_sigterm_ends_open_streams_and_exits_0(lm_path):
    # (SIGINT takes the same handler: txlm.commands.serve._server)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "txlm", "serve", str(lm_path), "--port", "0", "--device", "cpu",
         "--max-tokens", "1000000", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = _line(proc.stdout)
        assert line.startswith("txlm: serving lm at http://127.0.0.1:")
        url = line.split(" at ")[1].strip()
        assert _line(proc.stdout) == "txlm: lm loaded, ready for requests\n"  # (503 before)
        body = {"prompt": "ROMEO:", "max_tokens": 1000000, "stream": True}
        with (
            httpx.Client(base_url=url, timeout=TIMEOUT) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            events = [e for e in lines if e]
        assert events[-1] == "data: [DONE]"
        final = json.loads(events[-2].removeprefix("data: "))
        assert final["error"]["message"] == "the server is shutting down"
        assert proc.wait(TIMEOUT) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)


def test_a_classifier_serves_classify_as_txlm_classify(tmp_path):
    from txlm.checkpoints.checkpoint import load_classifier
    from txlm.classify.predict import predict

    lm = tiny_lm(tmp_path / "lm")
    path = save_classifier(tmp_path / "clf", lm)
    docs = ["abcXdefgh", "hgfedcbaYabc", "aaaa"]
    model = load_classifier(path)
    want = predict(model, [model.vocab.encode(d) for d in docs]).tolist()
    with serving(path) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        r = http.post("/v1/classify", json={"input": docs})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        for row, probs in zip(data, want, strict=True):
            assert list(row["probs"].values()) == pytest.approx(probs, abs=1e-6)
            assert row["label"] == max(row["probs"], key=row["probs"].get)
        one = http.post("/v1/classify", json={"input": docs[0]}).json()["data"]
        assert one[0]["label"] == data[0]["label"]
        refused = http.post("/v1/completions", json={"prompt": "a"})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"].startswith("this server holds a classifier")
        assert http.get("/v1/models").json()["data"][0]["task"] == "classify"
