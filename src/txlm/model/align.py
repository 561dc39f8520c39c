"""Tensor-core-friendly head dims: pad each attention head with zero dimensions.

Legend: H heads, Dh the real head dim, Dp the padded one (a multiple of ``multiple``), D
model dim, P learned relative positions ("shaw").

GPU matmul and fused-attention kernels want dims that are multiples of 8: wt103-base's
d_head 41 makes cuBLAS take its slow "align2" kernels and SDPA its unfused math fallback.
``pad_heads`` stores every head with Dp dims instead, the extra ones zero in every weight
that makes or reads them. The arithmetic is the same: a zero query/key dim adds 0 to every
score, a zero value dim gives a zero output dim, which meets a zero column of the output
projection; the scale stays 1/sqrt(Dh). The gradients of the padded entries are exactly
zero too (each is a product with a zero factor), so Adam (and weight decay) leaves them at
zero: the model trains as the unpadded one would (tests/test_model_align.py).

Checkpoints keep the real shapes: ``state_dict`` strips the padding and ``load_state_dict``
accepts either form; ``txlm.training.state`` does the same for Adam's moments, so a run can
resume on a device that pads differently. Pad after building or loading the model and
before making the optimizer (its state then has the padded shapes).

    model = pad_heads(TransformerXL(config), multiple=8)   # in place; returns the model

Where it pays: on CUDA, measured on an H200 (benchmarks/results/gpu_check.json, section
"attention"): wt103-base's bf16 training step 15% faster and its evaluation with 4x memory
1.56x, because SDPA then runs a fused kernel. On a CPU the extra dims are only extra work.
So ``wanted("auto", ...)`` pads on CUDA only, and ``txlm.load`` and the trainer ask it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# parameter name -> the axis that holds (heads x head dims)
_ATTENTION_AXES = {"qkv.weight": 0, "out.weight": 1, "r_net.weight": 0, "u": 1, "v": 1, "r_emb": 2}
_MODEL_AXES = {"u": 1, "v": 1}  # the shared biases (untie_r false)


def _resize(t: Tensor, axis: int, d_from: int, d_to: int) -> Tensor:
    """View ``axis`` as (groups, d_from) and pad with zeros (or cut) to (groups, d_to)."""
    t = t.unflatten(axis, (t.size(axis) // d_from, d_from))
    if d_to > d_from:
        widths = [0, 0] * (t.dim() - axis - 2) + [0, d_to - d_from]
        t = F.pad(t, widths)
    else:
        t = t.narrow(axis + 1, 0, d_to)
    return t.flatten(axis, axis + 1)


def _hooks(module: nn.Module, axes: dict[str, int], d_head: int, d_pad: int) -> None:
    """state_dict without the padding; load_state_dict of either shape."""

    def strip_hook(mod, state_dict, prefix, local_metadata):
        for name, axis in axes.items():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = strip(state_dict[key], axis, d_head, d_pad)
        return state_dict

    def pad_hook(state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for name, axis in axes.items():
            key = prefix + name
            if key in state_dict and state_dict[key].shape != _param(module, name).shape:
                state_dict[key] = pad(state_dict[key], axis, d_head, d_pad)

    module._register_state_dict_hook(strip_hook)
    module._register_load_state_dict_pre_hook(pad_hook)


def _param(module: nn.Module, name: str) -> Tensor:
    for part in name.split("."):
        module = getattr(module, part)
    return module  # type: ignore[return-value]


def wanted(setting: bool | str, device: str | torch.device, d_head: int, multiple: int = 8) -> bool:
    """Pad? ``setting``: true, false or "auto" (on CUDA when d_head is not a multiple)."""
    if d_head % multiple == 0:
        return False
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return bool(setting)


def padded_axes(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Parameter name -> (axis, real head dim, stored head dim) of each padded parameter."""
    d_head = model.config.d_head
    d_pad = model.layers[0].attn.d_head
    if d_pad == d_head:
        return {}
    params = dict(model.named_parameters())
    axes = {
        f"layers.{i}.attn.{name}": axis
        for i in range(len(model.layers))
        for name, axis in _ATTENTION_AXES.items()
    } | _MODEL_AXES
    return {n: (axis, d_head, d_pad) for n, axis in axes.items() if n in params}


def strip(t: Tensor, axis: int, d_head: int, d_pad: int) -> Tensor:
    """A padded parameter-shaped tensor in its real shape (the padding dropped)."""
    return _resize(t, axis, d_pad, d_head).contiguous()


def pad(t: Tensor, axis: int, d_head: int, d_pad: int) -> Tensor:
    """A real-shaped tensor padded with zeros to the stored shape."""
    return _resize(t, axis, d_head, d_pad)


@torch.no_grad()
def pad_heads(model: nn.Module, multiple: int = 8) -> nn.Module:
    """Store every attention head with its dim rounded up to ``multiple`` (zeros added)."""
    d_head = model.config.d_head
    d_pad = math.ceil(d_head / multiple) * multiple
    attns = [layer.attn for layer in model.layers]
    if d_pad == attns[0].d_head:
        return model
    if attns[0].d_head != d_head:
        raise ValueError("the heads are padded already")
    for owner, axes in [(a, _ATTENTION_AXES) for a in attns] + [(model, _MODEL_AXES)]:
        present = {}
        for name, axis in axes.items():
            if "." not in name and name not in owner._parameters:
                continue
            if "." in name and not hasattr(owner, name.split(".")[0]):
                continue
            parent_name, _, leaf = name.rpartition(".")
            parent = _param(owner, parent_name) if parent_name else owner
            old = getattr(parent, leaf)
            setattr(parent, leaf, nn.Parameter(_resize(old, axis, d_head, d_pad)))
            present[name] = axis
        if present:
            _hooks(owner, present, d_head, d_pad)
    for attn in attns:
        attn.d_head = d_pad
        for linear, axis in ((attn.qkv, 0), (attn.out, 1), (getattr(attn, "r_net", None), 0)):
            if linear is not None:  # keep the modules' own bookkeeping right
                if axis == 0:
                    linear.out_features = linear.weight.size(0)
                else:
                    linear.in_features = linear.weight.size(1)
    return model
