"""The compiled step's batch buckets (txlm.inference.compiled): a batch of B rows runs the
bucket K >= B over a cache padded with K - B rows, whose outputs are dropped.

Padding rows change no real row's result (a padded step equals the unpadded eager one within
float32 rounding: another batch shape, so not bits), and rows that leave or join a batch
within its bucket compile nothing (counted by the backend, not timed). The graph is traced
with aot_eager: the padding is the decoder's, not the compiler's; that inductor's step draws
eager's ids is ``test_token_step.py``'s.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from tests.helpers.models import debug_model
from txlm.inference.compiled import BUCKETS, StepCompile, bucket
from txlm.inference.decode import Decoder

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ATOL = 1e-5  # float32: the padded batch is another shape, its sums another order


def _model():
    return debug_model(std=0.1, n_layer=2, tgt_len=8, mem_len=12)


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths]


def test_a_batch_runs_the_smallest_bucket_that_holds_it() -> None:
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 16, 16, 32, 32]
    assert bucket(33) == 64 and BUCKETS == (1, 2, 4, 8, 16, 32)


def test_padded_rows_leave_the_real_rows_as_unpadded_and_compile_once() -> None:
    """Three rows (bucket 4, one padding row) over 16 steps, the ring of 13 slots wrapping;
    then a row leaves (two: bucket 2) and joins again (three: bucket 4, spliced, its
    memory at the batch's position): each step equals the eager decoder's over the same
    rows, and the whole run compiles one graph per bucket."""
    model = _model()
    counter = CompileCounter()
    eager = Decoder(model)
    compiled = Decoder(model, compile=StepCompile(backend=counter))
    prompts = _prompts(11, 4, 20)  # different lengths: left padding, per-row masks
    want, got = eager.prefill(prompts), compiled.prefill(prompts)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    ids = want.argmax(-1)

    def steps(n: int) -> torch.Tensor:
        nonlocal ids
        for _ in range(n):
            want, got = eager.step(ids), compiled.step(ids)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
            ids = want.argmax(-1)
        return ids

    with torch._dynamo.config.patch(error_on_recompile=True):
        steps(16)
    assert compiled.cache.batch == 4 and compiled.cache.rows == 3
    assert counter.frame_count == 1

    # row 1 leaves: two rows, bucket 2 (one new graph, the batch's shape changed)
    keep = torch.tensor([0, 2])
    with torch.inference_mode():
        eager.cache.keep_rows(keep)
        compiled.cache.keep_rows(keep)
    ids = ids[keep]
    steps(3)
    assert counter.frame_count == 2

    # a prompt read apart joins: three rows again, bucket 4's graph reused
    late = _prompts(6)
    for d in (eager, compiled):
        joined = d.cache
        first = d.prefill(late).argmax(-1)
        fresh = d.cache.resized(1)
        with torch.inference_mode():
            joined.splice(fresh)
        d.cache = joined
    ids = torch.cat([ids, first])
    with torch._dynamo.config.patch(error_on_recompile=True):
        steps(4)
    assert compiled.cache.rows == 3 and counter.frame_count == 2


def test_a_step_refuses_ids_for_other_rows_than_its_cache() -> None:
    decoder = Decoder(_model(), compile="aot_eager")
    ids = decoder.prefill(_prompts(5, 5)).argmax(-1)
    with pytest.raises(ValueError, match="3 ids for a cache of 2 rows"):
        decoder.step(torch.cat([ids, ids[:1]]))
