"""Aligned keys: the attention over [memory; segment] with masked slots in front of it (the
key axis a multiple of 8, ``Stored.keys``, txlm.model.align) computes what the plain path computes.

float64, odd lengths (7 queries over 13 memory positions: 20 keys -> 24), two segments with
memory and a document reset per row, for each relative encoding and same_length: the same
log-probabilities through SDPA (no gradient) and the math path, the same losses and the
same gradients for every parameter (the bias path's backward: the widened per-distance
product, its relative shift and the padded mask).
"""

from __future__ import annotations

import pytest
import torch

from txlm.config import ModelConfig
from txlm.model import TransformerXL, align
from txlm.model.align import Stored

CASES = {
    "xl": {},
    "xl+same_length+clamp": dict(same_length=True, clamp_len=5),
    "xl+untie_r+pre_lnorm": dict(untie_r=True, pre_lnorm=True),
    "shaw": dict(attn_type="shaw", n_positions=40),
    "alrfou": dict(attn_type="alrfou", n_positions=40),
}


def pair(**overrides) -> tuple[TransformerXL, TransformerXL]:
    config = ModelConfig.from_preset(
        "debug", **{"tgt_len": 7, "mem_len": 13, "dropout": 0.0, "dropatt": 0.0, **overrides}
    )
    torch.manual_seed(0)
    plain = TransformerXL(config).double()
    with torch.no_grad():
        for p in plain.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.3)
    return plain, align.padded(plain, Stored.aligned(config, 8, heads=False, widths=False))


def segments(model: TransformerXL, ids: torch.Tensor, impl: str):
    for layer in model.layers:
        layer.attn.attn_impl = impl
    out, total = None, 0.0
    resets = [None, torch.tensor([False, True]), torch.tensor([[False] * 3 + [True] + [False] * 3,
                                                               [False] * 7])]  # fmt: skip
    for s, reset in enumerate(resets):
        seg = slice(7 * s, 7 * s + 7)
        labels = slice(7 * s + 1, 7 * s + 8)
        mems, mask = (None, None) if out is None else (out.mems, out.mem_mask)
        out = model(ids[:, seg], mems=mems, reset=reset, mem_mask=mask, labels=ids[:, labels])
        total = total + out.losses.sum()
    with torch.no_grad():
        logp = model(ids[:, 14:21], mems=out.mems, mem_mask=out.mem_mask).log_probs
    return total, logp


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_aligned_keys_equal_the_plain_path(overrides, impl) -> None:
    plain, padded = pair(**overrides)
    ids = torch.randint(0, 64, (2, 22), generator=torch.Generator().manual_seed(1))
    loss_plain, logp_plain = segments(plain, ids, "math")  # the reference
    loss_padded, logp_padded = segments(padded, ids, impl)
    torch.testing.assert_close(logp_padded, logp_plain, atol=1e-12, rtol=0)
    torch.testing.assert_close(loss_padded, loss_plain, atol=1e-12, rtol=0)
    loss_plain.backward()
    loss_padded.backward()
    for (name, a), b in zip(plain.named_parameters(), padded.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-12, rtol=0, msg=name)


def test_attention_probabilities_stay_over_the_real_keys() -> None:
    """Asking for the probabilities (attention maps) keeps the real key axis."""
    plain, padded = pair()
    ids = torch.randint(0, 64, (1, 7))
    mems = [torch.randn(1, 13, 32, dtype=torch.float64)] * 2
    outs = []
    for model in (plain, padded):
        extras: list[dict] = []
        model.transform(ids, mems, attn_kwargs={"return_probs": True}, extras=extras)
        outs.append(extras[0]["probs"])
    assert outs[1].shape == (1, 2, 7, 20)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-12, rtol=0)
