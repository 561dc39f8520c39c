"""Tensor-core-friendly shapes: store weights with their dims rounded up to a multiple of 8,
the extra entries zero, and the arithmetic unchanged.

Legend: H heads, Dh the real head dim, D model dim, F inner (feed-forward) dim, E embedding
dim, V vocabulary, P learned relative positions ("shaw"); a trailing p (Dp, Fp, ...) is the
stored, padded size.

GPU matmul and fused-attention kernels want dims that are multiples of 8: wt103-base's
d_head 41, d_model 410, d_inner 2100 and its adaptive head of 20,003 logits make cuBLAS take
its slow "align2" kernels and SDPA its unfused math fallback. Two steps, both in place:

- ``pad_heads``: every head stored with Dhp dims. A zero query/key dim adds 0 to every
  score, a zero value dim gives a zero output dim, which meets a zero column of the output
  projection; the scale stays 1/sqrt(Dh).
- ``pad_widths``: the residual stream stored with Dp dims (every weight that reads it has
  zero columns there, every weight that writes it zero rows), the feed-forward's hidden
  layer with Fp units (ReLU(0) = 0 meets zero columns), the embedding dim of a div_val 1
  head with Ep, and the softmax's blocks with a multiple of 8 logits: the head's extra
  rows are added when it is joined (zero weights, -inf logits) and the last cluster's
  vocabulary rows are padded (its -inf logits set in ``adaptive._BlockNLL``). LayerNorm
  normalises the real D dims only and writes zeros after them
  (``attention.layer_norm``), so the padded dims of every hidden state stay exactly 0.

The gradients of the padded entries are exactly zero too (each is a product with a zero
factor, or a -inf logit's zero probability), so Adam (and weight decay) leaves them at zero:
the model trains as the unpadded one would (tests/test_model_align.py).

Checkpoints keep the real shapes: ``state_dict`` strips the padding and ``load_state_dict``
accepts either form; ``txlm.training.state`` does the same for Adam's moments (through
``padded_axes``), and the trainer for its memory, so a run can resume on a device that
pads differently. Pad after building or loading the model and before making the optimizer
(its state then has the padded shapes).

    model = align.pad(TransformerXL(config), multiple=8)   # both steps; returns the model

Where it pays: on CUDA, measured on an H200 (benchmarks/results/gpu_check.json, section
"attention"): wt103-base's bf16 training step 15% faster with padded heads and its
evaluation with 4x memory 1.56x, because SDPA then runs a fused kernel. On a CPU the extra
dims are only extra work. So ``wanted("auto", ...)`` pads on CUDA only, and ``txlm.load``
and the trainer ask it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txlm.devices import wanted  # pad? true, false or "auto" (on CUDA)

__all__ = [
    "pad", "pad_heads", "pad_keys", "pad_model", "pad_widths", "padded_axes", "strip", "wanted",
]  # fmt: skip


@dataclass(frozen=True)
class Pad:
    """One padded axis: ``groups`` runs of ``real`` entries, each stored as ``stored``."""

    axis: int
    groups: int
    real: int
    stored: int


def _up(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


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


def padded_axes(model: nn.Module) -> dict[str, tuple[Pad, ...]]:
    """Parameter name (as ``named_parameters`` gives it) -> its padded axes."""
    padding = getattr(model, "_txlm_padding", {})
    return {n: padding[n] for n, _ in model.named_parameters() if n in padding}


def _strip_hook(module, state_dict, prefix, local_metadata):
    done: dict[tuple, Tensor] = {}  # tied parameters stay one tensor
    for name, pads in module._txlm_padding.items():
        if prefix + name in state_dict:
            t = state_dict[prefix + name]
            key = (t.data_ptr(), t.shape, t.stride())  # each entry is its own detach()
            if key not in done:
                done[key] = strip(t, *pads)
            state_dict[prefix + name] = done[key]
    return state_dict


def _pad_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    for name, pads in module._txlm_padding.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = pad(state_dict[prefix + name], *pads)


@torch.no_grad()
def _apply(model: nn.Module, specs: dict[str, list[Pad]]) -> None:
    """Replace each named parameter by its padded copy (tied ones stay tied) and record the
    padding, on every name a parameter has, for the state-dict hooks."""
    named = list(model.named_parameters(remove_duplicate=False))
    new: dict[int, tuple[nn.Parameter, tuple[Pad, ...]]] = {}
    for name, p in named:
        if name in specs and specs[name] and id(p) not in new:
            new[id(p)] = (nn.Parameter(pad(p.detach(), *specs[name])), tuple(specs[name]))
    if not new:
        return
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and id(p) in new:
                module._parameters[key] = new[id(p)][0]
    padding = dict(getattr(model, "_txlm_padding", {}))
    for name, p in named:
        if id(p) in new:
            padding[name] = padding.get(name, ()) + new[id(p)][1]
    if not hasattr(model, "_txlm_padding"):
        model._register_state_dict_hook(_strip_hook)
        model._register_load_state_dict_pre_hook(_pad_hook, with_module=True)
    model._txlm_padding = padding
    for module in model.modules():  # keep the modules' own bookkeeping right
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
        elif isinstance(module, nn.Embedding):
            module.num_embeddings, module.embedding_dim = module.weight.shape


def pad_heads(model: nn.Module, multiple: int = 8) -> nn.Module:
    """Store every attention head with its dim rounded up to ``multiple`` (zeros added)."""
    c = model.config
    attns = [layer.attn for layer in model.layers]
    d_head, d_pad = c.d_head, _up(c.d_head, multiple)
    if attns[0].d_head != d_head:
        raise ValueError("the heads are padded already")
    if d_pad == d_head:
        return model
    h = c.n_head
    per_layer = {"qkv.weight": (0, 3 * h), "out.weight": (1, h), "r_net.weight": (0, h),
                 "u": (1, 1), "v": (1, 1), "r_emb": (2, 1)}  # fmt: skip
    specs = {
        f"layers.{i}.attn.{name}": [Pad(axis, groups, d_head, d_pad)]
        for i in range(len(attns))
        for name, (axis, groups) in per_layer.items()
    }
    specs |= {name: [Pad(1, 1, d_head, d_pad)] for name in ("u", "v")}
    _apply(model, specs)
    for attn in attns:
        attn.d_head = d_pad
    return model


def pad_keys(model: nn.Module, multiple: int = 8) -> nn.Module:
    """Attend over keys rounded up to ``multiple`` with masked slots (RelativeAttention)."""
    for layer in model.layers:
        layer.attn.key_multiple = multiple
    return model


def pad_widths(model: nn.Module, multiple: int = 8) -> nn.Module:
    """Store d_model, d_inner, a div_val 1 embedding dim and the softmax's blocks rounded up
    to ``multiple`` (zeros added; see the module's docstring)."""
    c = model.config
    if getattr(model.softmax, "multiple", 1) != 1:
        raise ValueError("the widths are padded already")
    if c.attn_type == "vaswani":  # its absolute sinusoid is added at the real width
        raise ValueError("pad_widths needs a relative or learned encoding, not vaswani")
    specs: dict[str, list[Pad]] = {}

    def add(name: str, axis: int, real: int) -> None:
        stored = _up(real, multiple)
        if stored != real:
            specs.setdefault(name, []).append(Pad(axis, 1, real, stored))

    d, f = c.d_model, c.d_inner
    for i in range(c.n_layer):
        a, ff = f"layers.{i}.attn.", f"layers.{i}.ff."
        add(a + "qkv.weight", 1, d)
        add(a + "out.weight", 0, d)
        add(a + "r_net.weight", 1, d)
        add(ff + "fc1.weight", 0, f)
        add(ff + "fc1.weight", 1, d)
        add(ff + "fc1.bias", 0, f)
        add(ff + "fc2.weight", 0, d)
        add(ff + "fc2.weight", 1, f)
        add(ff + "fc2.bias", 0, d)
        add(f"layers.{i}.pos_emb", 1, d)
    sm = model.softmax
    for part in ("embed", "softmax"):
        for j in range(len(getattr(model, part).projs)):
            add(f"{part}.projs.{j}", 0, d)  # [D, E_j]
    if c.div_val == 1:
        e = c.d_embed
        last = c.vocab_size - (c.cutoffs[-1] if c.cutoffs else 0)
        rows = c.vocab_size - last + _up(last, multiple)
        for part in ("embed", "softmax"):
            add(f"{part}.layers.0.weight", 1, e)
            for j in range(len(getattr(model, part).projs)):
                add(f"{part}.projs.{j}", 1, e)
            if rows != c.vocab_size:  # the last cluster's width
                specs.setdefault(f"{part}.layers.0.weight", []).append(
                    Pad(0, 1, c.vocab_size, rows)
                )
        if rows != c.vocab_size:
            specs.setdefault("softmax.layers.0.bias", []).append(Pad(0, 1, c.vocab_size, rows))
        if sm.n_clusters:
            add("softmax.cluster_weight", 1, e)
    else:
        for j, (lo, hi) in enumerate(sm.bounds):
            for name in (f"softmax.layers.{j}.weight", f"softmax.layers.{j}.bias"):
                add(name, 0, hi - lo)
            if c.tie_weight:  # the same tensor as the softmax's (rows never looked up)
                add(f"embed.layers.{j}.weight", 0, hi - lo)
    _apply(model, specs)
    sm.multiple = multiple
    return model


def pad_model(model: nn.Module, multiple: int = 8) -> nn.Module:
    """``pad_heads``, ``pad_keys`` and ``pad_widths`` (where the encoding allows it)."""
    pad_heads(model, multiple)
    pad_keys(model, multiple)
    if model.config.attn_type != "vaswani":
        pad_widths(model, multiple)
    return model
