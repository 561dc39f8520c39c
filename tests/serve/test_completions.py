"""/v1/completions through the ``openai`` client against a real server: the same ids as
``txlm generate`` for the same seed and settings, echoed log-probs equal to ``txlm.score``,
streaming, ``n``, ``stop``."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.serve import TIMEOUT, serving
from txlm.inference.generate import generate
from txlm.inference.score import score
from txlm.serve.config import ServeConfig

PROMPT = "ROMEO: the quick brown fox jumps over the lazy dog, and then"  # > tgt_len + mem_len


def offline_text(offline, prompt, *, max_tokens, seed, n=1, **settings):
    """``txlm generate``'s samples: row r of a request draws as its prompt alone with
    seed + r (here one prompt: sample j is row j); with the vocabulary, so ``<unk>`` is
    banned as the server bans it."""
    model, vocab, lengths = offline
    ids = vocab.encode(prompt)
    return [
        vocab.decode(generate(model, ids, max_new_tokens=max_tokens, seed=seed + j,
                              lengths=lengths, vocab=vocab, **settings)[0])
        for j in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "settings, offline_settings",
    [
        ({}, {}),  # temperature 1, top_k 40: txlm generate's defaults
        ({"temperature": 0}, {"greedy": True}),
        ({"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.7, "top_p": 0.9}),
        ({"extra_body": {"top_k": 5}}, {"top_k": 5}),
        # vLLM's extension fields, and logit_bias -100 as a ban
        (
            {"extra_body": {"min_p": 0.05, "repetition_penalty": 1.3}},
            {"min_p": 0.05, "repetition_penalty": 1.3},
        ),
        (
            {"temperature": 0, "extra_body": {"repetition_penalty": 2.0}},
            {"greedy": True, "repetition_penalty": 2.0},
        ),
        ({"logit_bias": {"4": -100, "9": -100}}, {"ban": [4, 9, "<unk>"]}),
    ],
)
def test_same_ids_as_generate(client, offline, settings, offline_settings):
    got = client.completions.create(model="lm", prompt=PROMPT, max_tokens=24, seed=7, n=2,
                                    **settings)  # fmt: skip
    want = offline_text(offline, PROMPT, max_tokens=24, seed=7, n=2, **offline_settings)
    assert [c.text for c in got.choices] == want
    assert [c.finish_reason for c in got.choices] == ["length", "length"]
    assert got.usage.prompt_tokens == len(PROMPT)
    assert got.usage.completion_tokens == 48


def test_prompt_lists_and_token_ids_read_as_each_prompt_alone(client, offline):
    vocab = offline[1]
    prompts = ["ROMEO:", "a much longer prompt that spans two segments of the debug model"]
    got = client.completions.create(model="lm", prompt=prompts, max_tokens=10, seed=3, n=2)
    # rows prompt-major, as txlm generate's: row r draws with seed + r
    want = [t for i, p in enumerate(prompts)
            for t in offline_text(offline, p, max_tokens=10, seed=3 + 2 * i, n=2)]  # fmt: skip
    assert [c.text for c in got.choices] == want
    ids = vocab.encode(prompts[1])
    by_ids = client.completions.create(model="lm", prompt=[ids, ids[:5]], max_tokens=10, seed=5)
    assert by_ids.choices[0].text == want[2]
    assert by_ids.choices[1].text == offline_text(offline, prompts[1][:5], max_tokens=10,
                                                  seed=6)[0]  # fmt: skip


def test_echoed_log_probs_equal_score(client, offline):
    model, vocab, lengths = offline
    got = client.completions.create(model="lm", prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=3)  # fmt: skip
    lp = got.choices[0].logprobs
    assert got.choices[0].text == PROMPT
    assert lp.tokens == list(PROMPT)
    assert lp.token_logprobs[0] is None  # the first token has no context
    want = score(model, vocab.encode(PROMPT), tgt_len=lengths.tgt_len, mem_len=lengths.mem_len)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-5, rtol=0)
    for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) == 3 and max(top.values()) >= chosen - 1e-6
    assert got.usage.completion_tokens == 0


def test_generated_log_probs_are_the_models(client, offline):
    got = client.completions.create(model="lm", prompt="ROMEO:", max_tokens=6, seed=1,
                                    logprobs=2, echo=True)  # fmt: skip
    model, vocab, lengths = offline
    text = got.choices[0].text
    assert text.startswith("ROMEO:")
    lp = got.choices[0].logprobs
    want = score(model, vocab.encode(text), tgt_len=lengths.tgt_len, mem_len=lengths.mem_len)
    # (the prompt read as txlm.score reads it, each new token from a decoding step)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-4, rtol=0)
    assert lp.text_offset == list(range(len(text)))


def test_stream_gives_the_same_text_and_ends_with_done(client, http, offline):
    chunks = list(client.completions.create(model="lm", prompt=PROMPT, max_tokens=20, seed=5,
                                            n=2, stream=True))  # fmt: skip
    texts = ["", ""]
    finish = [None, None]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == offline_text(offline, PROMPT, max_tokens=20, seed=5, n=2)
    assert finish == ["length", "length"]
    raw = http.post(
        "/v1/completions",
        json={
            "prompt": "ab",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert '"usage": {"prompt_tokens": 2, "completion_tokens": 3' in events[-2]


def test_stop_strings_end_the_text_before_them(client, offline):
    full = offline_text(offline, PROMPT, max_tokens=40, seed=11)[0]
    stop = next(ch for ch in full[5:] if ch.strip())  # a symbol that occurs after a while
    cut = full[: full.index(stop)]
    got = client.completions.create(model="lm", prompt=PROMPT, max_tokens=40, seed=11,
                                    stop=[stop, "never"])  # fmt: skip
    assert got.choices[0].text == cut
    assert got.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="lm", prompt=PROMPT, max_tokens=40, seed=11, stop=[stop], stream=True
        )
        if c.choices
    )
    assert streamed == cut


def test_int8_server_draws_what_an_int8_generate_draws(lm_path, offline):
    """``--precision int8``: the server's decoder holds int8 layers and head, so a request
    draws the ids ``txlm generate --precision int8`` draws, and its echoed log-probs are read
    through the same int8 model: near the float32 ones, not equal to them."""
    openai = pytest.importorskip("openai")
    model, vocab, lengths = offline
    with serving(lm_path, ServeConfig(max_batch=4), precision="int8") as running:
        assert running.service.engine.decoder.precision == "int8"
        with openai.OpenAI(base_url=running.url + "/v1", api_key="none", timeout=TIMEOUT,
                           max_retries=0) as client:  # fmt: skip
            got = client.completions.create(model="lm", prompt=PROMPT, max_tokens=16, seed=4,
                                            n=2, echo=True, logprobs=0)  # fmt: skip
    ids = vocab.encode(PROMPT)
    want = [vocab.decode(generate(model, ids, max_new_tokens=16, seed=4 + j, lengths=lengths,
                                  vocab=vocab, int8=True)[0]) for j in range(2)]  # fmt: skip
    assert [c.text[len(PROMPT) :] for c in got.choices] == want
    echoed = torch.tensor(got.choices[0].logprobs.token_logprobs[1 : len(PROMPT)])
    fp32 = score(model, ids, tgt_len=lengths.tgt_len, mem_len=lengths.mem_len)
    assert (echoed - fp32).abs().max() > 1e-5  # (int8 weights: not the float32 numbers)
    torch.testing.assert_close(echoed, fp32, atol=0.05, rtol=0)
