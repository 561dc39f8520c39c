"""Tensor-core-friendly shapes: store weights with their dims rounded up to a multiple of 8,
the extra entries zero, and the arithmetic unchanged.

Legend: H heads, Dh the real head dim, D model dim, F inner (feed-forward) dim, E embedding
dim, V vocabulary, P learned relative positions ("shaw"); a trailing p (Dp, Fp, ...) is the
stored, padded size.

GPU matmul and fused-attention kernels want dims that are multiples of 8: wt103-base's
d_head 41, d_model 410, d_inner 2100 and its adaptive head of 20,003 logits make cuBLAS take
its slow "align2" kernels and SDPA its unfused math fallback. A ``Stored`` record says what
a model stores, and ``TransformerXL(config, stored)`` builds its modules with those shapes:

- heads: every head stored with Dhp dims. A zero query/key dim adds 0 to every score, a
  zero value dim gives a zero output dim, which meets a zero column of the output
  projection; the scale stays 1/sqrt(Dh).
- widths: the residual stream stored with Dp dims (every weight that reads it has zero
  columns there, every weight that writes it zero rows), the feed-forward's hidden layer
  with Fp units (ReLU(0) = 0 meets zero columns), the embedding dim of a div_val 1 head
  with Ep, and the softmax's blocks with a multiple of 8 logits: the head's extra rows are
  added when it is joined (zero weights, -inf logits) and each cluster's vocabulary rows
  are padded (their -inf logits set in ``adaptive._BlockNLL``; an embedding stores the
  rows its tied softmax does). LayerNorm normalises the real D dims only and writes zeros
  after them (``attention.layer_norm``), so the padded dims of every hidden state stay
  exactly 0. Not for "vaswani", whose absolute sinusoid is added at the real width.
- keys: the attention over [memory; segment] with masked slots in front, so that the key
  axis is a multiple of 8 (``attention._key_padding``).

The gradients of the padded entries are exactly zero too (each is a product with a zero
factor, or a -inf logit's zero probability), so Adam (and weight decay) leaves them at zero:
the model trains as the unpadded one would (tests/model/test_align.py).

Checkpoints keep the real shapes: ``state_dict`` strips the padding and ``load_state_dict``
accepts either form (hooks the model registers when built padded, from ``padding``);
``txlm.training.state`` does the same for Adam's moments (through ``padded_axes``), and the
trainer for its memory, so a run can resume on a device that pads differently.

    model = TransformerXL(config, Stored.aligned(config))   # heads, widths and keys of 8
    same = padded(TransformerXL(config), Stored.aligned(config))   # its weights, padded

Where it pays: on CUDA, measured on an H200 (benchmarks/results/gpu_check.json, section
"attention"): wt103-base's bf16 training step 15% faster with padded heads and its
evaluation with 4x memory 1.56x, because SDPA then runs a fused kernel. On a CPU the extra
dims are only extra work. So ``txlm.devices.wanted("auto", ...)`` pads on CUDA only, and
``txlm.load`` and the trainer ask it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from txlm.config import ModelConfig

__all__ = ["Pad", "Stored", "pad", "padded", "padded_axes", "padding", "real_shape", "strip"]


@dataclass(frozen=True)
class Stored:
    """What a model stores where its configuration leaves a choice: its weights' widths
    (the configuration's, or rounded up with zeros: ``aligned``), its attention's key
    layout and its hidden states' dtype. The arithmetic is the configuration's either way;
    ``TransformerXL(config, stored)`` builds every module with it, and nothing changes it
    afterwards."""

    d_model: int  # Dp: the residual stream (every hidden state; zeros past D)
    d_inner: int  # Fp: the feed-forward's hidden units
    d_head: int  # Dhp: each head's dims (the attention's scale stays 1/sqrt(Dh))
    d_embed: int  # Ep: a div_val 1 embedding's dim (div_val > 1: the configuration's)
    logits: int = 1  # each softmax block's logits (and its rows) a multiple of this
    keys: int = 1  # keys [memory; segment] a multiple of this, masked slots in front
    activations: torch.dtype | None = None  # hidden states' dtype (None: the embedding's)

    @classmethod
    def of(cls, config: ModelConfig) -> Stored:
        """As configured: nothing padded."""
        assert config.d_embed is not None
        return cls(config.d_model, config.d_inner, config.d_head, config.d_embed)

    @classmethod
    def aligned(
        cls,
        config: ModelConfig,
        multiple: int = 8,
        *,
        heads: bool = True,
        widths: bool = True,
        keys: bool = True,
    ) -> Stored:
        """Heads, widths (where the encoding allows: not "vaswani") and keys rounded up to
        ``multiple`` (see the module's docstring)."""
        real = cls.of(config)
        stored = dataclasses.replace(
            real,
            d_head=_up(real.d_head, multiple) if heads else real.d_head,
            keys=multiple if keys else 1,
        )
        if not widths or config.attn_type == "vaswani":
            return stored
        return dataclasses.replace(
            stored,
            d_model=_up(real.d_model, multiple),
            d_inner=_up(real.d_inner, multiple),
            d_embed=_up(real.d_embed, multiple) if config.div_val == 1 else real.d_embed,
            logits=multiple,
        )


@dataclass(frozen=True)
class Pad:
    """One padded axis: ``groups`` runs of ``real`` entries, each stored as ``stored``."""

    axis: int
    groups: int
    real: int
    stored: int


def _up(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


def stored_rows(bounds: list[tuple[int, int]], div_val: int, multiple: int) -> list[int]:
    """Rows of each adaptive layer's weight: every cluster's vocabulary rounded up to
    ``multiple`` (div_val 1: one table, whose last cluster's rows are rounded)."""
    if div_val == 1:
        lo, hi = bounds[-1]
        return [lo + _up(hi - lo, multiple)]
    return [_up(hi - lo, multiple) for lo, hi in bounds]


def _resize(t: Tensor, p: Pad, d_from: int, d_to: int) -> Tensor:
    """View ``p.axis`` as (groups, d_from) and pad with zeros (or cut) to (groups, d_to);
    a tensor already in the other form is returned as it is."""
    if t.size(p.axis) != p.groups * d_from:
        return t
    t = t.unflatten(p.axis, (p.groups, d_from))
    if d_to > d_from:
        t = F.pad(t, [0, 0] * (t.dim() - p.axis - 2) + [0, d_to - d_from])
    else:
        t = t.narrow(p.axis + 1, 0, d_to)
    return t.flatten(p.axis, p.axis + 1)


def strip(t: Tensor, *pads: Pad) -> Tensor:
    """A padded parameter-shaped tensor in its real shape (the padding dropped), in storage
    of its own (a view would make safetensors save the whole padded buffer)."""
    out = t
    for p in pads:
        out = _resize(out, p, p.stored, p.real)
    return out.contiguous() if out is t else out.clone(memory_format=torch.contiguous_format)


def pad(t: Tensor, *pads: Pad) -> Tensor:
    """A real-shaped tensor padded with zeros to the stored shape."""
    for p in pads:
        t = _resize(t, p, p.real, p.stored)
    return t


def real_shape(shape: torch.Size, pads: tuple[Pad, ...]) -> torch.Size:
    """The real shape of a parameter stored as ``shape`` with ``pads``."""
    dims = list(shape)
    for p in pads:
        dims[p.axis] = p.groups * p.real
    return torch.Size(dims)


def padded_axes(model: nn.Module) -> dict[str, tuple[Pad, ...]]:
    """Parameter name (as ``named_parameters`` gives it) -> its padded axes: those of the
    padded model or, in a model around it (a classifier's body), of its submodule."""
    axes: dict[str, tuple[Pad, ...]] = {}
    for prefix, module in model.named_modules():
        padding = getattr(module, "padding", None)
        if isinstance(padding, dict):
            axes |= {f"{prefix}.{n}" if prefix else n: pads for n, pads in padding.items()}
    return {n: axes[n] for n, _ in model.named_parameters() if n in axes}


def padding(config: ModelConfig, stored: Stored) -> dict[str, tuple[Pad, ...]]:
    """Parameter name (every name a tied parameter has) -> its padded axes: what a model of
    ``config`` built with ``stored`` holds beyond the real shapes."""
    c = config
    if c.attn_type == "vaswani" and stored.d_model != c.d_model:
        raise ValueError("padded widths need a relative or learned encoding, not vaswani")
    specs: dict[str, list[Pad]] = {}

    def add(name: str, axis: int, real: int, stored_size: int, groups: int = 1) -> None:
        if stored_size != real:
            specs.setdefault(name, []).append(Pad(axis, groups, real, stored_size))

    h, dh, dhp = c.n_head, c.d_head, stored.d_head
    d, dp, f, fp = c.d_model, stored.d_model, c.d_inner, stored.d_inner
    for i in range(c.n_layer):
        a, ff = f"layers.{i}.attn.", f"layers.{i}.ff."
        add(a + "qkv.weight", 0, dh, dhp, 3 * h)
        add(a + "qkv.weight", 1, d, dp)
        add(a + "out.weight", 1, dh, dhp, h)
        add(a + "out.weight", 0, d, dp)
        add(a + "r_net.weight", 0, dh, dhp, h)
        add(a + "r_net.weight", 1, d, dp)
        for name in ("u", "v"):
            add(a + name, 1, dh, dhp)
        add(a + "r_emb", 2, dh, dhp)
        add(ff + "fc1.weight", 0, f, fp)
        add(ff + "fc1.weight", 1, d, dp)
        add(ff + "fc1.bias", 0, f, fp)
        add(ff + "fc2.weight", 0, d, dp)
        add(ff + "fc2.weight", 1, f, fp)
        add(ff + "fc2.bias", 0, d, dp)
        add(f"layers.{i}.pos_emb", 1, d, dp)
    for name in ("u", "v"):
        add(name, 1, dh, dhp)
    assert c.d_embed is not None
    ends = [0, *c.cutoffs, c.vocab_size]
    bounds = list(itertools.pairwise(ends))
    rows = stored_rows(bounds, c.div_val, stored.logits)
    for part in ("embed", "softmax"):
        if c.div_val == 1:
            e, ep = c.d_embed, stored.d_embed
            projs = int(d != e) if part == "embed" else len(bounds) * int(d != e)
            add(f"{part}.layers.0.weight", 1, e, ep)
            add(f"{part}.layers.0.weight", 0, c.vocab_size, rows[0])
            for j in range(projs):
                add(f"{part}.projs.{j}", 0, d, dp)  # [D, E]
                add(f"{part}.projs.{j}", 1, e, ep)
        else:
            for j, (lo, hi) in enumerate(bounds):
                add(f"{part}.layers.{j}.weight", 0, hi - lo, rows[j])
                add(f"{part}.projs.{j}", 0, d, dp)  # [D, E_j]
    if c.div_val == 1:
        add("softmax.layers.0.bias", 0, c.vocab_size, rows[0])
        if c.cutoffs:
            add("softmax.cluster_weight", 1, c.d_embed, stored.d_embed)
    else:
        for j, (lo, hi) in enumerate(bounds):
            add(f"softmax.layers.{j}.bias", 0, hi - lo, rows[j])
    return {name: tuple(pads) for name, pads in specs.items()}


def strip_hook(module, state_dict, prefix, local_metadata):
    """A state-dict hook: the padded parameters in their real shapes (``module.padding``)."""
    done: dict[tuple, Tensor] = {}  # tied parameters stay one tensor
    for name, pads in module.padding.items():
        if prefix + name in state_dict:
            t = state_dict[prefix + name]
            # each entry is its own detach(); the pads too, for tensors without storage (meta)
            key = (t.data_ptr(), t.shape, t.stride(), pads)
            if key not in done:
                done[key] = strip(t, *pads)
            state_dict[prefix + name] = done[key]
    return state_dict


def pad_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """A load-state-dict pre-hook: real-shaped tensors padded with zeros (``module.padding``)."""
    for name, pads in module.padding.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = pad(state_dict[prefix + name], *pads)


def padded(model: nn.Module, stored: Stored | None) -> nn.Module:
    """``model`` stored with ``stored``: a new model of its class and configuration built so
    (on the meta device: no random draws), holding its weights zero-padded, on its device,
    in its dtype and its train or eval mode; ``model`` itself when ``stored`` is None or
    what it stores already. A model built unpadded and then padded so has, for the same
    seed, the unpadded one's initial weights."""
    if stored is None or stored == model.stored:
        return model
    p = next(model.parameters())
    with torch.device("meta"):
        new = type(model)(model.config, stored)
    new = new.to_empty(device=p.device).to(p.dtype)
    new.tie_weights()
    new.load_state_dict(model.state_dict())
    return new.train(model.training)
