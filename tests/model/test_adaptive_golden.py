"""The adaptive softmax's cluster arithmetic on hand-set weights, against log-probabilities
written out from the formula (Grave et al.): the head scores the shortlist and one column
per tail cluster, cluster i's column standing for all of its tokens,

    log p(t) = z_t - logsumexp(z)                                   t in the shortlist
    log p(t) = (z_{s+i-1} - logsumexp(z)) + (w_t - logsumexp(w_i))  t in tail cluster i

with z the head's logits (shortlist s of them, then the clusters' in order) and w_i cluster
i's logits over its own tokens, computed here in plain Python floats. The model's
``log_prob`` (also with the head's weight joined as a decoder holds it) and its fused
per-token ``nll`` hold it.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from txlm.model.adaptive import AdaptiveLogSoftmax

CUTOFFS = [2, 4]  # shortlist {0, 1}; cluster 1: {2, 3}; cluster 2: {4, 5}
VOCAB = 6
HIDDEN = [[1.0, -0.5, 0.25, 2.0], [-1.5, 0.5, 1.0, -0.75], [0.3, 0.2, -2.0, 0.4]]
# per token: its weight row over the hidden units (a projection of the identity picks the
# first d_i of them for cluster i when div_val 2) and its bias
WEIGHTS = [[0.5, -1.0, 0.3, 0.1], [1.2, 0.4, -0.6, 0.2],  # shortlist
           [0.7, -0.2, 0.0, 0.0], [-0.9, 1.1, 0.0, 0.0],  # cluster 1 (d_1 = 2 at div_val 2)
           [1.5, 0.0, 0.0, 0.0], [-0.4, 0.0, 0.0, 0.0]]  # cluster 2 (d_2 = 1)  # fmt: skip
BIASES = [0.1, -0.3, 0.25, 0.0, -0.5, 0.35]
CLUSTER_WEIGHTS = [[0.2, 0.9, -0.4, 0.3], [-1.1, 0.1, 0.5, -0.2]]
CLUSTER_BIASES = [-0.2, 0.6]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _lse(xs: list[float]) -> float:
    top = max(xs)
    return top + math.log(sum(math.exp(x - top) for x in xs))


def expected_log_probs(h: list[float]) -> list[float]:
    z = [_dot(WEIGHTS[t], h) + BIASES[t] for t in range(2)]
    z += [_dot(w, h) + b for w, b in zip(CLUSTER_WEIGHTS, CLUSTER_BIASES, strict=True)]
    head = [v - _lse(z) for v in z]
    out = head[:2]
    for i, tokens in ((1, [2, 3]), (2, [4, 5])):
        w = [_dot(WEIGHTS[t], h) + BIASES[t] for t in tokens]
        out += [head[2 + i - 1] + v - _lse(w) for v in w]
    return out


def _f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)  # the very values the formula uses


def hand_set(div_val: int) -> AdaptiveLogSoftmax:
    sm = AdaptiveLogSoftmax(VOCAB, 4, 4, CUTOFFS, div_val).double()
    with torch.no_grad():
        sm.cluster_weight.copy_(_f64(CLUSTER_WEIGHTS))
        sm.cluster_bias.copy_(_f64(CLUSTER_BIASES))
        if div_val == 1:  # one layer over the vocabulary, no projection (d_proj = d_embed)
            assert len(sm.projs) == 0
            sm.layers[0].weight.copy_(_f64(WEIGHTS))
            sm.layers[0].bias.copy_(_f64(BIASES))
        else:  # a layer per block on d_embed / 2**i units, projected from d_proj
            for i, (lo, hi) in enumerate(sm.bounds):
                d_i = 4 // div_val**i
                sm.projs[i].copy_(
                    torch.eye(4, dtype=torch.float64)[:, :d_i]
                )  # the first d_i hidden units
                sm.layers[i].weight.copy_(_f64(WEIGHTS[lo:hi])[:, :d_i])
                sm.layers[i].bias.copy_(_f64(BIASES[lo:hi]))
    return sm


@pytest.mark.parametrize("div_val", [1, 2])
def test_log_probs_of_a_hand_set_adaptive_softmax(div_val: int) -> None:
    sm = hand_set(div_val)
    hidden = torch.tensor(HIDDEN, dtype=torch.float64)
    want = torch.tensor([expected_log_probs(h) for h in HIDDEN], dtype=torch.float64)
    # float64 against Python's floats: the same formula, summed in another order
    torch.testing.assert_close(sm.log_prob(hidden), want, rtol=1e-12, atol=1e-12)
    # as a decoder computes it: the head's weight joined with the cluster rows, one product
    w, b, _ = sm._weights(0)
    weight, bias = torch.cat([w, sm.cluster_weight]), torch.cat([b, sm.cluster_bias])
    joined = functools.partial(torch.nn.functional.linear, weight=weight, bias=bias)
    torch.testing.assert_close(sm.log_prob(hidden, head=joined), want, rtol=1e-12, atol=1e-12)
    targets = torch.tensor([[0, 3, 5], [1, 2, 4], [4, -100, 3]])
    for row in targets:
        rows = hidden[: len(row)]
        nll = sm.nll(rows, row)
        picked = [0.0 if t < 0 else -want[n, t].item() for n, t in enumerate(row.tolist())]
        torch.testing.assert_close(nll, torch.tensor(picked, dtype=torch.float64),
                                   rtol=1e-12, atol=1e-12)  # fmt: skip
