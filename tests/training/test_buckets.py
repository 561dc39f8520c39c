"""The adaptive softmax's tail buckets sized on the host (``txlm.training.step.TailBuckets``),
the way a compiled or CUDA training step sizes them (contract C37: nothing read back).

- The sizes always hold their call's tokens of every cluster (any labels, ignored ones too),
  only grow, come in whole quanta, start from the corpus's cluster frequencies and stay
  within a quarter (plus a quantum) of the largest count seen: far from "all"'s every token.
- The loss with those sizes is the loss with the counts, and so are the hidden states' and
  the parameters' gradients, to float64 rounding: the buckets' shapes differ, and which
  kernel sums a product (so in which order) depends on the shape, the thread count and the
  buffers' alignment. A wrong number of sizes is refused.
- The trainer sizes on the host where it compiles and keeps the softmax's counts on the
  CPU's eager path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.train import tiny_config
from tests.model.test_adaptive_loss import build, zipf_labels
from txlm.training.step import TailBuckets

CUTOFFS = [10, 30, 60]


def counts(labels: np.ndarray) -> list[int]:
    cluster = np.searchsorted(CUTOFFS, labels.ravel(), side="right")
    return np.bincount(cluster, minlength=len(CUTOFFS) + 1)[1:].tolist()


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.integers(-1, 99), min_size=1, max_size=300), min_size=1, max_size=6
    ),
    quantum=st.sampled_from([1, 8, 64]),
)
def test_sizes_hold_every_call_only_grow_and_stay_close(batches, quantum):
    buckets = TailBuckets(CUTOFFS, [0.2, 0.1, 0.05], tokens=200, quantum=quantum)
    start = list(buckets.sizes)
    assert all(s % quantum == 0 and s >= quantum for s in start)
    previous, largest = start, [0] * len(CUTOFFS)
    for raw in batches:
        labels = np.where(np.asarray(raw) < 0, -100, np.asarray(raw)).reshape(1, -1)
        sizes = buckets(labels)
        need = counts(labels)
        largest = [max(a, b) for a, b in zip(largest, need, strict=True)]
        assert all(s >= n for s, n in zip(sizes, need, strict=True))  # exact: all fit
        assert all(s >= p for s, p in zip(sizes, previous, strict=True))  # only grow
        assert all(s % quantum == 0 for s in sizes)
        for s, s0, n in zip(sizes, start, largest, strict=True):  # no more than needed
            assert s == s0 or s <= 1.25 * n + quantum
        previous = list(sizes)


def test_starting_sizes_come_from_the_corpus():
    rng = np.random.default_rng(0)
    # 70% shortlist, then 16%, 10%, 4% of the tokens in the three tail clusters
    ids = rng.choice([0, 15, 40, 80], size=100_000, p=[0.7, 0.16, 0.1, 0.04])
    buckets = TailBuckets.for_corpus(ids, CUTOFFS, tokens=4000)
    expected = [1.25 * 4000 * p for p in (0.16, 0.10, 0.04)]
    for size, want in zip(buckets.sizes, expected, strict=True):
        assert want - 20 <= size < want + 64 + 20  # rounded up to the quantum; sampling noise
    assert max(buckets.sizes) < 4000 / 4  # a quarter of "all"'s work at the most


@pytest.mark.parametrize("case", ["div1", "div4"])
def test_the_loss_with_host_sizes_is_the_loss_with_the_counts(case):
    overrides = {"div1": dict(cutoffs=CUTOFFS, div_val=1),
                 "div4": dict(cutoffs=CUTOFFS, div_val=4, d_embed=64)}[case]  # fmt: skip
    model = build(overrides)
    sm = model.softmax
    labels = zipf_labels(96, 100, 3, CUTOFFS)
    hidden = torch.randn(96, 32, dtype=torch.float64, requires_grad=True)

    def run(**kwargs):
        model.zero_grad()
        hidden.grad = None
        nll = sm.nll(hidden, labels, **kwargs)
        (nll * torch.linspace(0.5, 1.5, 96, dtype=torch.float64)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return nll.detach(), hidden.grad.clone(), grads

    reference = run()  # sized by the clusters' counts
    sizes = TailBuckets(CUTOFFS, [0.0, 0.0, 0.0], tokens=96, quantum=8)(labels.numpy())
    assert sum(sizes) < 3 * 96  # smaller than "all"
    sized = run(sizes=sizes)
    # other bucket shapes: the same sums in another order, float64 rounding apart
    torch.testing.assert_close(sized[0], reference[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sized[1], reference[1], rtol=1e-12, atol=1e-12)
    assert sized[2].keys() == reference[2].keys()
    for name, grad in reference[2].items():
        torch.testing.assert_close(sized[2][name], grad, rtol=1e-12, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="3 tail clusters"):
        sm.nll(hidden, labels, sizes=sizes[:2])


def test_the_trainer_sizes_on_the_host_only_where_it_compiles(tmp_path):
    from txlm.training import Trainer

    quiet = ("eval.eval_interval=0", "eval.final_eval=false", "run.tensorboard=false",
             "run.progress=false", "model.cutoffs=[20,40]")  # fmt: skip
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    eager = Trainer(tiny_config(tmp_path / "a", *quiet), tmp_path / "a" / "run", echo=False)
    assert eager.task.buckets is None  # the softmax counts its clusters' tokens
    compiled = Trainer(
        tiny_config(tmp_path / "b", *quiet, "run.compile=true"), tmp_path / "b" / "run",
        echo=False,
    )  # fmt: skip
    assert compiled.task.buckets is not None
    tokens = compiled.config.data.batch_size * compiled.model.config.tgt_len
    assert all(0 < s < tokens for s in compiled.task.buckets.sizes)  # less than every token
