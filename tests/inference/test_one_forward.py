"""One plain forward for every query length, and decoding tests that can see the norms.

- Training, evaluation (plain and through the K/V cache) and decoding (a prompt's segments,
  eager and static one-token steps) all call the layers, their attention and their
  feed-forward as modules, with hidden states [B, L, D]: a forward hook on any of them fires
  in each (the analysis tools' hooks see decoding too).
- The decoding models are non-trivial in every parameter: a step that applied a layer's
  feed-forward LayerNorm where its attention's belongs (a planted swap) is caught by the
  comparison with recomputation, which it would pass on a fresh model's ones and zeros.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import debug_model
from txlm.config import ModelConfig
from txlm.inference.decode import Decoder
from txlm.inference.kv_eval import CachedEvaluator
from txlm.model import TransformerXL

from .test_cache import cached_log_probs, reference_log_probs


def _hooked(model: TransformerXL) -> tuple[dict[str, list[tuple[int, ...]]], list]:
    """Forward hooks on every layer's attention and feed-forward: the input shapes they see."""
    seen: dict[str, list[tuple[int, ...]]] = {"attn": [], "ff": []}
    handles = []
    for layer in model.layers:
        for name in seen:

            def hook(module, args, out, name=name):
                seen[name].append(tuple(args[0].shape))

            handles.append(getattr(layer, name).register_forward_hook(hook))
    return seen, handles


@pytest.mark.parametrize("static", [False, True], ids=["eager-cache", "static-cache"])
def test_forward_hooks_fire_in_training_evaluation_and_decoding(static: bool) -> None:
    model = debug_model(std=0.1, tgt_len=8, mem_len=12)
    n = model.config.n_layer
    seen, handles = _hooked(model)
    try:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        model.train()
        model(ids, labels=ids).loss.backward()  # training
        model.eval()
        with torch.no_grad():
            model(ids)  # evaluation
            CachedEvaluator(model)(ids, labels=ids)  # evaluation over the K/V cache
        d = model.stored.d_model
        assert seen["attn"] == seen["ff"] == [(2, 8, d)] * 3 * n
        seen["attn"].clear(), seen["ff"].clear()
        dec = Decoder(model)
        dec.static = static
        dec.prefill([list(range(1, 14))])  # segments of 5 and 8
        for t in range(5):
            dec.step(torch.tensor([t]))
        want = [(1, 5, d)] * n + [(1, 8, d)] * n + [(1, 1, d)] * 5 * n
        assert seen["attn"] == seen["ff"] == want
    finally:
        for h in handles:
            h.remove()


def test_decoding_models_have_no_trivial_parameter() -> None:
    """Every parameter of a decoding test's model holds spread values (no all-ones norm, no
    zero bias or u/v), with either helper."""
    for model in (debug_model(std=0.1), debug_model(cutoffs=[20, 40], div_val=2)):
        for name, p in model.named_parameters():
            assert p.std() > 0.005, name  # (proj_init_std 0.01 at the smallest)


def _swap_norms(model: TransformerXL) -> None:
    for layer in model.layers:
        layer.attn.norm, layer.ff.norm = layer.ff.norm, layer.attn.norm


@pytest.mark.parametrize("pre_lnorm", [False, True], ids=["post-LN", "pre-LN"])
def test_a_planted_swap_of_a_layers_norms_in_the_step_is_caught(monkeypatch, pre_lnorm) -> None:
    """The steps (not the prompt) run with each layer's two LayerNorms swapped: the decoded
    distributions leave the recomputed ones far beyond the tolerance of
    test_cache.test_cached_decoding_matches_recompute_across_trimming; on a fresh model,
    whose norms are all ones and zeros, the same swap changes nothing."""
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 64, (13,), generator=g).tolist()
    cont = torch.randint(0, 64, (40,), generator=g).tolist()
    real_step = Decoder.step

    def swapped_step(self, *args, **kwargs):
        _swap_norms(self.net)
        try:
            return real_step(self, *args, **kwargs)
        finally:
            _swap_norms(self.net)

    drawn = debug_model(std=0.1, tgt_len=8, mem_len=24, pre_lnorm=pre_lnorm)
    config = ModelConfig.from_preset("debug", tgt_len=8, mem_len=24, pre_lnorm=pre_lnorm)
    torch.manual_seed(0)
    fresh = TransformerXL(config).eval()
    refs = {m: reference_log_probs(m, prompt, cont) for m in (drawn, fresh)}
    torch.testing.assert_close(cached_log_probs(drawn, prompt, cont), refs[drawn], atol=1e-5,
                               rtol=0)  # fmt: skip
    monkeypatch.setattr(Decoder, "step", swapped_step)
    assert (cached_log_probs(drawn, prompt, cont) - refs[drawn]).abs().max() > 1e-2
    torch.testing.assert_close(cached_log_probs(fresh, prompt, cont), refs[fresh], atol=1e-5,
                               rtol=0)  # fmt: skip
