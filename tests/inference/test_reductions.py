"""txlm.inference.reductions: inside ``products_as_reductions`` each product it rewrites
computes what the library's product computes (float32, within its rounding: the same sums in
another order), for each way a weight is read; products it leaves alone run untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from txlm.inference.reductions import products_as_reductions

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 24, generator=g)  # one row of a decoding step
    w = torch.randn(40, 24, generator=g)  # a weight [out, in]
    w_t = torch.randn(24, 40, generator=g)  # a weight held [in, out]
    bias = torch.randn(40, generator=g)
    q = torch.randn(6, 1, 8, generator=g)  # heads' queries [H, 1, Dh]
    k_t = torch.randn(6, 8, 30, generator=g)  # their keys [H, Dh, S]
    scores = torch.randn(6, 1, 30, generator=g)
    return x, w, w_t, bias, q, k_t, scores


PRODUCTS = {
    "linear": lambda x, w, w_t, bias, q, k_t, s: F.linear(x, w, bias),
    "linear_no_bias": lambda x, w, w_t, bias, q, k_t, s: F.linear(x, w),
    "mm": lambda x, w, w_t, bias, q, k_t, s: torch.mm(x, w_t),
    "addmm": lambda x, w, w_t, bias, q, k_t, s: torch.addmm(bias, x, w_t),
    "bmm": lambda x, w, w_t, bias, q, k_t, s: torch.bmm(q, k_t),
    "baddbmm": lambda x, w, w_t, bias, q, k_t, s: torch.baddbmm(s, q, k_t, alpha=0.5),
    "baddbmm_": lambda x, w, w_t, bias, q, k_t, s: s.clone().baddbmm_(q, k_t, alpha=0.5),
}


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("name", list(PRODUCTS))
def test_a_product_as_a_reduction_equals_the_library_product(name: str, frozen: bool):
    args = _tensors()
    want = PRODUCTS[name](*args)
    with products_as_reductions(frozen=frozen):
        got = PRODUCTS[name](*args)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL)


def _ops(name: str, **kw) -> set[str]:
    """The aten operations the product ``name`` runs inside the mode."""

    def traced(*args):
        with products_as_reductions(**kw):
            return PRODUCTS[name](*args)

    graph = make_fx(traced)(*_tensors()).graph
    return {str(n.target) for n in graph.nodes if n.op == "call_function"}


def test_weights_false_leaves_the_weight_products_to_the_library():
    """With ``weights=False`` a weight's product is the library's own; the attention's are
    rewritten either way; ``frozen`` reads a weight [in, out] through a contiguous copy of
    its transpose (a constant, where the weights are)."""
    assert "aten.addmm.default" in _ops("addmm", weights=False)
    assert "aten.addmm.default" not in _ops("addmm")
    assert "aten.bmm.default" not in _ops("bmm", weights=False)
    assert "aten.clone.default" in _ops("mm", frozen=True)
    assert "aten.clone.default" not in _ops("mm")
