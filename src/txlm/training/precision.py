"""Mixed precision without casting the big weights at every use.

Under ``torch.autocast`` every matmul casts its fp32 weight to bf16 again in every forward
(and every gradient-accumulation chunk). Here, for ``run.precision=bf16``, forward and
backward run on a copy of the model whose decoder-layer linear weights and biases (the
attention and feed-forward matrices: nearly all the matmul work) are held in bf16:

  master (fp32, ``Trainer.model``)  --refresh after each Adam step-->  bf16 copies
  the copies' bf16 gradients        --once per step-->                 master ``.grad``

so a step casts those weights once, in one fused ``_foreach_copy_`` after the optimizer,
and their matmuls find the operands already in bf16. The u/v biases get bf16 copies too (a
float32 u would promote ``q + u`` to float32). Every other parameter (embeddings and the
tied output layer, layer norms) is shared with the master, fp32: the output layer's loss
casts only the blocks it uses (``adaptive._BlockNLL``), layer norms read bf16 inputs with
float32 weights and statistics. Autocast stays on around the forward for its per-op policy.

Activations (``activations=True``, the trainer's): the residual stream, and so the memory,
is bf16 from the embedding on (the copy is built with ``Stored.activations`` bf16);
LayerNorm returns bf16 (``attention.layer_norm``), so a layer reads and writes half the
bytes and no matmul input is cast. Only the loss is reduced in float32. The
master weights and Adam's state stay fp32; checkpoints hold the master. Gradients of
several accumulation chunks add up in bf16 before they reach the master (with
``optim.grad_accum`` = 1 there is nothing to add).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from txlm.model import TransformerXL


class ComputeCopy:
    """``model``: ``master`` with its decoder-layer linear parameters and u/v in ``dtype``,
    and with its activations in ``dtype`` when ``activations``."""

    def __init__(self, master: TransformerXL, dtype: torch.dtype, activations: bool = True) -> None:
        low = {
            id(p)
            for layer in master.layers
            for module in layer.modules()
            if isinstance(module, nn.Linear)
            for p in module.parameters()
        }
        low |= {
            id(p) for name, p in master.named_parameters() if name.rsplit(".", 1)[-1] in ("u", "v")
        }
        # deepcopy with every other parameter pre-placed in its memo: those stay the very
        # same Parameter objects (shared, fp32, their gradients land on the master); and,
        # with activations, the copy's record of what it stores in their place (each
        # TransformerXL's, a classifier's body too): its hidden states in ``dtype``
        memo: dict[int, object] = {id(p): p for p in master.parameters() if id(p) not in low}
        if activations:
            for module in master.modules():
                if isinstance(module, TransformerXL):
                    stored = module.stored
                    memo[id(stored)] = dataclasses.replace(stored, activations=dtype)
        self.model = copy.deepcopy(master, memo)
        self.master_params: list[nn.Parameter] = []
        self.params: list[nn.Parameter] = []
        for (name, p), (_, m) in zip(
            self.model.named_parameters(), master.named_parameters(), strict=True
        ):
            if p is m:
                continue
            assert id(m) in low, name
            p.data = p.data.to(dtype)
            self.params.append(p)
            self.master_params.append(m)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the master weights in (after each optimizer step)."""
        torch._foreach_copy_(self.params, self.master_params)

    @torch.no_grad()
    def gradients_to_master(self) -> None:
        """Move this step's gradients of the copies to the master's ``.grad`` (fp32)."""
        for p, m in zip(self.params, self.master_params, strict=True):
            m.grad = None if p.grad is None else p.grad.to(m.dtype)
            p.grad = None


@contextlib.contextmanager
def denormals_flushed(device: torch.device) -> Iterator[None]:
    """On a CPU, denormal floats (below 1.2e-38 in float32) read and written as zero inside
    the block, and not after it (torch's default; the switch is process-wide).

    Adam's second moments of the parameters whose gradients are rare or tiny (embedding rows
    of rare symbols) decay into that range, where x86 arithmetic on them runs at a fraction
    of its speed: without this the default run's steps took 2.6 times as long by step 400,
    and every later step with them. A number that small is zero to every loss and update."""
    if device.type != "cpu":
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
