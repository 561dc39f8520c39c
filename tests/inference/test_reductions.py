"""txlm.inference.reductions: inside ``products_as_reductions`` each product it rewrites
computes what the library's product computes (float32, within its rounding: the same sums in
another order), for each way a weight is read; products it leaves alone run untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from txlm.inference.reductions import products_as_reductions
from txlm.model.cache import slot_scores

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(1, 24, generator=g),  # one row of a decoding step
        "w": torch.randn(40, 24, generator=g),  # a weight [out, in]
        "w_t": torch.randn(24, 40, generator=g),  # a weight held [in, out]
        "bias": torch.randn(40, generator=g),
        "q": torch.randn(6, 1, 8, generator=g),  # heads' queries [H, 1, Dh]
        "k_t": torch.randn(6, 8, 30, generator=g),  # their keys [H, Dh, S]
        "scores": torch.randn(6, 1, 30, generator=g),
        # slot_scores: queries [B, H, L, Dh], position keys of 30 distances [H, T, Dh], the
        # distance of each (query, slot) pair [L, S]
        "q4": torch.randn(2, 6, 3, 8, generator=g),
        "table": torch.randn(6, 30, 8, generator=g),
        "index": torch.randint(0, 30, (3, 20), generator=g),
    }


PRODUCTS = {
    "linear": lambda t: F.linear(t["x"], t["w"], t["bias"]),
    "linear_no_bias": lambda t: F.linear(t["x"], t["w"]),
    "mm": lambda t: torch.mm(t["x"], t["w_t"]),
    "addmm": lambda t: torch.addmm(t["bias"], t["x"], t["w_t"]),
    "bmm": lambda t: torch.bmm(t["q"], t["k_t"]),
    "baddbmm": lambda t: torch.baddbmm(t["scores"], t["q"], t["k_t"], alpha=0.5),
    "baddbmm_": lambda t: t["scores"].clone().baddbmm_(t["q"], t["k_t"], alpha=0.5),
    "slot_scores": lambda t: slot_scores(t["q4"], t["table"], t["index"]),
    "slot_scores_in_order": lambda t: slot_scores(t["q4"], t["table"], None),
}


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("name", list(PRODUCTS))
def test_a_product_as_a_reduction_equals_the_library_product(name: str, frozen: bool):
    tensors = _tensors()
    want = PRODUCTS[name](tensors)
    with products_as_reductions(frozen=frozen):
        got = PRODUCTS[name](tensors)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL)


def _ops(name: str, **kw) -> set[str]:
    """The aten operations the product ``name`` runs inside the mode."""

    names = list(_tensors())

    def traced(*args):
        with products_as_reductions(**kw):
            return PRODUCTS[name](dict(zip(names, args, strict=True)))

    graph = make_fx(traced)(*_tensors().values()).graph
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


def test_slot_scores_gathers_the_keys_then_sums_once_per_pair():
    """Eagerly the position scores are one product over every distance, gathered per pair
    afterwards; inside the mode the keys are gathered by distance first and each pair is one
    sum over them (what a compiled step fuses into its loads): no product over the distances
    the pairs do not use."""
    eager = {str(n.target) for n in make_fx(PRODUCTS["slot_scores"])(_tensors()).graph.nodes}
    assert {"aten.bmm.default", "aten.gather.default"} <= eager
    ops = _ops("slot_scores")
    assert "aten.index.Tensor" in ops and "aten.sum.dim_IntList" in ops
    assert not ops & {"aten.bmm.default", "aten.gather.default"}
