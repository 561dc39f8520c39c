"""Products written as reductions: how a compiled one-row decoding step fuses its layers.

A decoding step of one row multiplies one vector by each weight: the product only streams
its operand, so a broadcast multiply and a sum over the shared axis reads the same bytes as a
library matrix-vector product, and, traced by torch.compile, it is a loop the compiler fuses
with what surrounds it (the cache write, the mask, softmax, the residual and LayerNorm), where
a library product is a kernel of its own with another for what follows it (ARCHITECTURE.md,
C35). The model's forward is written once with ordinary products; the decoder's compiled step
for one row traces it inside ``products_as_reductions()``, which rewrites them as it is
traced. Eagerly, and for several rows (where a library product reuses each weight across
rows), the products stay the library's.

The attention's position scores (txlm.model.cache.slot_scores: each query against the
position key of each slot's distance) are one product over every distance, gathered per slot
afterwards, eagerly; inside the mode the keys are gathered first and each pair is one sum,
the gather folded into that sum's loads (no product over distances, no gather pass).

``products_as_reductions(weights=False)`` rewrites the attention's products only (``bmm``,
``baddbmm``, ``slot_scores``: each row's query against its own cached keys and values,
nothing shared across rows) and leaves the weights' (``F.linear``, ``mm``, ``addmm``) to
the compiler's kernels over packed weights: what the packaged step traces for one row in
float32 and int8 (txlm.inference.packaged).

``frozen=True`` is for a trace whose weights are constants the compiler folds (a package's):
a weight held [in, out] (``mm``, ``addmm``) is then read as its transpose made contiguous,
[out, in], which folding makes once, so each output's sum runs along one contiguous row of
the weight. Down the columns of [in, out] the loop reads a few bytes from each row in turn;
from an L3-resident weight that costs little, but streamed from memory (wt103-base's layers)
it read slower than the library's product (docs/performance-cpu.md, "The packaged step's
settings"). Unfrozen, that transpose would be a copy a step, so the weight is read as held.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from txlm.model.cache import slot_scores


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for a [..., N, K], b [..., K, M] as a broadcast multiply and a sum over K."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def _linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` for x [..., in], weight [out, in]: each output a sum along a row."""
    return (x.unsqueeze(-2) * weight).sum(-1)


def _by_rows(x: Tensor, weight_t: Tensor) -> Tensor:
    """``x @ weight_t`` for weight_t [in, out], summed along the rows of its transpose made
    contiguous (a constant a frozen trace folds)."""
    return _linear(x, weight_t.t().contiguous())


class products_as_reductions(TorchFunctionMode):
    """Inside it, ``bmm``, ``baddbmm`` (in place or not) and ``slot_scores`` run as
    reductions, and with ``weights`` ``F.linear``, ``mm`` and ``addmm`` too (``frozen``: a
    weight [in, out] read along the rows of its transpose, see the module docstring)."""

    def __init__(self, weights: bool = True, frozen: bool = False) -> None:
        super().__init__()
        self.weights = weights
        self.weight_product = _by_rows if frozen else _matmul

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.weights and func in (F.linear, torch.mm, torch.addmm):
            return func(*args, **kwargs)
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            out = _linear(x, weight)
            return out if bias is None else out + bias
        if func is torch.mm:
            return self.weight_product(*args)
        if func is torch.addmm:
            bias, a, b = args
            return bias + self.weight_product(a, b)
        if func is slot_scores:  # the keys gathered by distance, then one sum per pair
            q, keys, index = args
            picked = keys.unsqueeze(1) if index is None else keys[:, index]  # [H, L, S, Dh]
            return (q.unsqueeze(-2) * picked).sum(-1)
        if func in (torch.bmm, Tensor.bmm):
            return _matmul(*args)
        if func in (torch.baddbmm, Tensor.baddbmm, Tensor.baddbmm_):
            bias, a, b = args
            scores = _matmul(a, b) * kwargs.get("alpha", 1)
            return bias.add_(scores) if func is Tensor.baddbmm_ else bias + scores
        return func(*args, **kwargs)
