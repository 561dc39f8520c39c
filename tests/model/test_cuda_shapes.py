"""What a training step asks of a GPU, checked on the CPU: a narrow wt103-shaped model built
as the trainer builds it for CUDA (every width padded to a multiple of 8, bf16 compute
copy with bf16 activations, under autocast), with static tail buckets.

A dispatch mode records every operation of one training forward and backward (a second
segment, with memory): no operation that reads a device value back to the host
(``_local_scalar_dense``, ``nonzero``, ...), and every matrix product's operands have
model-side widths that are multiples of 8 (tensor-core kernels; the batch axis of a
batched product and matrix-vector products aside). Unpadded, the same step has widths of
82 (d_model), 210 (d_inner), 41 (d_head), 203 (head logits), 677 (the last cluster) and
65 (distances).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from txlm.config import ModelConfig
from txlm.model import TransformerXL
from txlm.model.align import Stored
from txlm.training.precision import ComputeCopy

SYNCS = {"_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal", "_assert_async"}
PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "dot", "mv"}


class Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.products: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCS:
            self.syncs.append(name)
        if name in PRODUCTS:
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            self.products.append((name, shapes))
        return func(*args, **(kwargs or {}))


def misaligned(products) -> list:
    """Products with an operand whose matrix dims (the last two) are not multiples of 8;
    a dim of 1 (a vector) does not count."""
    return [
        (name, shapes)
        for name, shapes in products
        if any(d % 8 and d != 1 for shape in shapes for d in shape[-2:])
    ]


def step(padded: bool) -> Recorder:
    # wt103-base's shape, narrowed: d_model 410 -> 82, d_inner 2100 -> 210, the vocabulary
    # and its cutoffs / 100 (267,735 -> 2677: clusters of 200, 200, 1600 and 677 rows)
    config = ModelConfig.from_preset(
        "debug", vocab_size=2677, cutoffs=[200, 400, 2000], div_val=1, d_model=82, n_head=2,
        d_head=41, d_inner=210, n_layer=2, tgt_len=32, mem_len=32, dropout=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    master = TransformerXL(config, Stored.aligned(config) if padded else None)
    model = ComputeCopy(master, torch.bfloat16).model.train()
    ids = torch.randint(0, 2677, (2, 65), generator=torch.Generator().manual_seed(1))
    ids[:, 40:44] = torch.tensor([300, 1000, 2500, 2676])  # every cluster has labels
    every = [64, 64, 64]  # static tail buckets: each holds all 2 x 32 tokens of a call
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mems = model(ids[:, :32], labels=ids[:, 1:33], bucket_sizes=every).mems
    recorder = Recorder()
    with recorder:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids[:, 32:64], mems=mems, labels=ids[:, 33:65], bucket_sizes=every)
            loss = out.losses.float().sum()
        loss.backward()
    assert out.mems[0].dtype == torch.bfloat16  # the memory (and residual stream) in bf16
    return recorder


def test_cuda_built_training_step_has_no_host_sync_and_aligned_products() -> None:
    padded = step(padded=True)
    assert padded.syncs == []
    assert len(padded.products) > 40
    assert misaligned(padded.products) == []
    plain = step(padded=False)  # the same step unpadded: the check sees the widths
    assert plain.syncs == []
    widths = {d for _, shapes in misaligned(plain.products) for s in shapes for d in s[-2:]}
    assert {82, 210, 41, 203, 677, 65} <= widths
