"""Contract 36: a prompt with N samples is read once, its cache rows then repeated.

``generate(prompts, num_samples=N)`` must give exactly the tokens of generating from the
prompts written out N times each (the draw of row r from the same generator stream as
before), with an eager and a static (compiled) cache, prompts of different lengths (left
padding: per-row document masks), a plain and an adaptive softmax; and the decoder reads
each distinct prompt once: every context segment has one row per prompt.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import spread_weights
from txlm.config import ModelConfig
from txlm.inference.decode import Decoder
from txlm.inference.generate import generate
from txlm.inference.sampling import SamplingConfig
from txlm.model import TransformerXL

PROMPTS = [[5, 9, 2, 7, 1, 3, 3, 8, 4, 6, 2], [11, 4], [7, 7, 1, 2, 9]]  # 11 > tgt_len 8


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _model(**overrides) -> TransformerXL:
    config = ModelConfig.from_preset("debug", **{"tgt_len": 8, "mem_len": 12, **overrides})
    torch.manual_seed(2)
    model = TransformerXL(config).eval()
    spread_weights(model, 0.25)
    return model


MODELS = {"full": {}, "adaptive": dict(vocab_size=64, cutoffs=[8, 24, 40], div_val=2)}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_repeated_rows_give_the_tokens_of_the_prompts_written_out(kind, compile, monkeypatch):
    torch._dynamo.reset()
    model = _model(**MODELS[kind])
    widths = []
    segment = Decoder._segment

    def counted(self, ids, reset):
        widths.append(ids.size(0))
        return segment(self, ids, reset)

    monkeypatch.setattr(Decoder, "_segment", counted)
    # compiled: one setting (each is a graph per bucket; every setting's compiled draw equals
    # the eager one's: inference/test_token_step.py)
    settings = [SamplingConfig(top_k=5), SamplingConfig(top_k=None)][: 1 if compile else 2]
    for n in (1, 3):
        expanded = [p for p in PROMPTS for _ in range(n)]
        for sampling in settings:
            kw = dict(max_new_tokens=24, sampling=sampling, seed=11, compile=compile)
            widths.clear()
            got = generate(model, PROMPTS, num_samples=n, **kw)
            assert set(widths) == {len(PROMPTS)}  # every segment: one row per prompt
            want = generate(model, expanded, **kw)
            assert got == want
            if n > 1:  # the samples of a prompt are independent draws
                assert len({tuple(r) for r in got[:n]}) > 1


def test_repeated_cache_equals_the_cache_of_the_prompts_read_again() -> None:
    """The rows (to float32 rounding), document ids (left padding) and write position after
    ``repeat_rows`` equal those of reading every copy."""
    model = _model()
    once, again = Decoder(model), Decoder(model)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    sampling = SamplingConfig(greedy=True)
    first = once.prefill(PROMPTS, sampling=sampling, generator=g1, repeats=3)
    assert torch.equal(
        first,
        again.prefill([p for p in PROMPTS for _ in range(3)], sampling=sampling, generator=g2),
    )
    again._narrow()
    a, b = once.cache, again.cache
    assert a is not None and b is not None and a.batch == b.batch == 9
    # 3 rows projected and repeated against 9 projected: other product shapes, so other
    # kernels and summation orders, float32 rounding apart
    torch.testing.assert_close(a.kv, b.kv, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.doc, b.doc) and torch.equal(a.open_doc, b.open_doc)
    assert torch.equal(a.pos, b.pos) and int(a.next_pos) == int(b.next_pos)
    assert torch.equal(a.memory_valid(), b.memory_valid())
