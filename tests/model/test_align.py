"""Padded (tensor-core aligned) heads compute what the unpadded model computes.

``Stored.aligned(config, heads=True, ...)`` stores each head with its dim rounded up to a
multiple of 8, the extra dims zero (``align.padded``: a model's weights so stored). Checked
in float32 on a model with d_head 5 (padded to 8): the same log-probs (1e-6), the same
gradients for the real weights and exactly zero for the padding, zero padding after Adam
steps, unpadded checkpoints, and the cached decoder on the padded model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from txlm.config import ModelConfig
from txlm.inference.decode import Decoder
from txlm.model import TransformerXL, align
from txlm.model.align import Stored

CASES = {
    "xl": {},
    "untie_r+pre_lnorm": dict(untie_r=True, pre_lnorm=True),
    "same_length+math": dict(same_length=True, clamp_len=6, attn_impl="math"),
    "shaw": dict(attn_type="shaw", n_positions=40),
}


def pair(**overrides) -> tuple[TransformerXL, TransformerXL]:
    config = ModelConfig.from_preset(
        "debug", **{"n_head": 3, "d_head": 5, "dropout": 0.0, "dropatt": 0.0, **overrides}
    )
    torch.manual_seed(0)
    plain = TransformerXL(config)
    with torch.no_grad():  # non-zero u, v, biases: every term matters
        for p in plain.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.3)
    padded = align.padded(plain, heads_only(config))
    assert padded.layers[0].attn.qkv.weight.shape == (3 * 3 * 8, config.d_model)
    assert padded.stored.d_head == 8 and plain.stored.d_head == 5
    return plain, padded


def heads_only(config: ModelConfig) -> Stored:
    return Stored.aligned(config, 8, widths=False, keys=False)


def run(model: TransformerXL, ids: torch.Tensor):
    """Two segments with memory and a document reset; the summed losses."""
    first = model(ids[:, :8], labels=ids[:, 1:9])
    reset = torch.tensor([False, True])
    second = model(
        ids[:, 8:16], mems=first.mems, reset=reset, mem_mask=first.mem_mask, labels=ids[:, 9:17]
    )
    logp = model(ids[:, 8:16], mems=first.mems).log_probs
    return logp, first.losses.sum() + second.losses.sum()


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_padded_heads_same_log_probs_and_gradients(overrides) -> None:
    plain, padded = pair(**overrides)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    logp_plain, loss_plain = run(plain, ids)
    logp_padded, loss_padded = run(padded, ids)
    torch.testing.assert_close(logp_padded, logp_plain, atol=1e-6, rtol=0)
    loss_plain.backward()
    loss_padded.backward()
    # the padded model's gradients, put in checkpoint form, are the plain model's
    grads_padded = {n: p.grad for n, p in padded.named_parameters()}
    stripped = strip_like_state_dict(padded, grads_padded)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(stripped[name], p.grad, atol=1e-6, rtol=0)
    # and exactly zero on the padding
    for name, p in padded.named_parameters():
        grad_is_zero_on_padding(padded, name, p)


def strip_like_state_dict(model: TransformerXL, tensors: dict) -> dict:
    """Swap the parameters for ``tensors`` and read the (unpadded) state dict back."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[n])
        out = {k: v.clone() for k, v in model.state_dict().items()}
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return out


def grad_is_zero_on_padding(model: TransformerXL, name: str, p: torch.Tensor) -> None:
    """Where the weight is padding (zero in every checkpoint-visible sense), so is the grad:
    the padded entries are those that a fresh pad of the stripped weight leaves zero."""
    ones = {n: torch.ones_like(q) for n, q in model.named_parameters()}
    stripped = strip_like_state_dict(model, ones)
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(stripped)  # pads the all-ones back: padding entries are 0
    real = dict(fresh.named_parameters())[name] != 0
    assert torch.equal(p.grad[~real], torch.zeros_like(p.grad[~real])), name


def test_checkpoints_keep_the_real_shapes_and_load_either_way() -> None:
    plain, padded = pair()
    state = padded.state_dict()
    assert {k: v.shape for k, v in state.items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }
    for k, v in plain.state_dict().items():
        assert torch.equal(state[k], v), k
    other = TransformerXL(plain.config, heads_only(plain.config))
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(plain.state_dict())  # an unpadded checkpoint into a padded model
    for a, b in zip(other.parameters(), padded.parameters(), strict=True):
        assert torch.equal(a, b)


def adam_steps(plain, padded, ids, opts):
    """Three AdamW steps of each model on ``ids``; then a copy of ``padded`` whose real
    entries are ones and padding zeros (its checkpoint shape, loaded back): padding = 0."""
    for _ in range(3):
        for model, opt in zip((plain, padded), opts, strict=True):
            opt.zero_grad()
            run(model, ids)[1].backward()
            opt.step()
    ones = {n: torch.ones_like(q) for n, q in padded.named_parameters()}
    fresh = copy.deepcopy(padded)
    fresh.load_state_dict(strip_like_state_dict(padded, ones))
    return fresh


def test_padding_stays_zero_through_adam_and_training_matches() -> None:
    plain, padded = pair()
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, padded)]
    zero_before = {n: p == 0 for n, p in padded.named_parameters()}
    fresh = adam_steps(plain, padded, ids, opts)
    for name, p in fresh.named_parameters():
        pad = p == 0
        assert zero_before[name][pad].all()
        assert torch.equal(dict(padded.named_parameters())[name][pad], torch.zeros(int(pad.sum())))
    # Adam divides by the gradient's own scale, so rounding-level gradient differences on
    # near-zero gradients become ~lr-sized steps for a few entries: close, not 1e-6
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(padded.state_dict()[k], v, atol=1e-3, rtol=0)


def test_cached_decoding_on_padded_heads() -> None:
    plain, padded = pair()
    plain.eval(), padded.eval()
    prompt, cont = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]], torch.arange(30) % 64
    a, b = Decoder(plain), Decoder(padded)
    torch.testing.assert_close(b.prefill(prompt), a.prefill(prompt), atol=1e-6, rtol=0)
    for t in cont:
        torch.testing.assert_close(b.step(t.view(1)), a.step(t.view(1)), atol=1e-6, rtol=0)


# -- the trainer and checkpoints with padded heads (run.align_heads; auto pads on CUDA) ------
def _train(tmp_path, out, *sets, resume=None):
    from tests.helpers.train import tiny_text
    from txlm.training import Trainer
    from txlm.training.config import resolve

    text = tiny_text(tmp_path, n_chars=6000)
    config = resolve("debug", None, [
        f"data.dataset=text:{text}", f"data.data_dir={tmp_path / 'data'}", "model.d_head=6",
        "model.dropout=0.0", "optim.max_steps=4", "eval.eval_interval=0",
        "eval.final_eval=false", "run.tensorboard=false", "run.progress=false",
        "run.threads=1", *sets,
    ])  # fmt: skip
    trainer = Trainer(config, tmp_path / out, resume=resume, echo=False)
    trainer.fit()
    return trainer


def test_trainer_with_padded_heads_trains_the_same_and_saves_real_shapes(tmp_path):
    """run.align_heads=true: the heads are stored padded (6 -> 8 dims) while training, the
    run follows the unpadded one's weights, and every file of ``last`` (weights and Adam's
    moments) holds the real shapes. A run resumed without padding from a padded run's
    ``last`` continues where it stopped, and ``txlm.load`` pads on request."""
    from safetensors.torch import load_file

    from txlm.checkpoints import checkpoint

    plain = _train(tmp_path, "plain", "run.align_heads=false")
    padded = _train(tmp_path, "padded", "run.align_heads=true")
    assert padded.model.stored.d_head == 8 and plain.model.stored.d_head == 6
    assert align.padded_axes(padded.model) and not align.padded_axes(plain.model)
    want = plain.model.state_dict()
    for name, value in padded.model.state_dict().items():  # real shapes (hooks strip)
        torch.testing.assert_close(value, want[name], rtol=0, atol=2e-5, msg=name)
    assert padded.model.layers[0].attn.qkv.weight.shape == (3 * 2 * 8, 32)

    saved = load_file(str(tmp_path / "padded" / "last" / "optimizer.safetensors"))
    reference = load_file(str(tmp_path / "plain" / "last" / "optimizer.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in reference.items()}
    for name, value in saved.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)

    # padded for 2 steps, then resumed unpadded (as on a CPU after a GPU): the same run
    _train(tmp_path, "paused", "run.align_heads=true", "run.stop_at=2")
    resumed = _train(tmp_path, "resumed", "run.align_heads=false",
                     resume=tmp_path / "paused" / "last")  # fmt: skip
    assert resumed.model.stored.d_head == 6
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=2e-5, msg=name)
    # and the other way: unpadded to padded, exact moments padded with zeros
    _train(tmp_path, "paused2", "run.align_heads=false", "run.stop_at=2")
    again = _train(tmp_path, "again", "run.align_heads=true", resume=tmp_path / "paused2" / "last")
    for name, value in again.model.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=2e-5, msg=name)
    state = again.optimizer.state[again.model.layers[0].attn.qkv.weight]
    assert state["exp_avg"].shape == (48, 32)
    assert not state["exp_avg"].view(3, 2, 8, 32)[:, :, 6:].any()  # padding stays zero

    loaded = checkpoint.load(tmp_path / "plain" / "last", align_heads=True)
    assert loaded.stored.d_head == 8 and loaded.layers[0].attn.d_head == 8
    assert checkpoint.load(tmp_path / "plain" / "last").stored.d_head == 6  # auto: CPU


def test_bf16_training_with_padded_heads_follows_the_unpadded_run(tmp_path):
    """The configuration a GPU run gets (bf16 compute copies of padded heads): the same
    weights as without padding, and the compute copy holds the padded bf16 shapes."""
    plain = _train(tmp_path, "plain", "run.precision=bf16", "run.align_heads=false")
    padded = _train(tmp_path, "padded", "run.precision=bf16", "run.align_heads=true")
    assert padded.compute.model.layers[0].attn.qkv.weight.shape == (48, 32)
    assert padded.compute.model.layers[0].attn.qkv.weight.dtype == torch.bfloat16
    want = plain.model.state_dict()
    for name, value in padded.model.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)


# -- padded widths: d_model, d_inner, the embedding dim and the softmax's blocks -------------
WIDTH_CASES = {
    "div1": dict(div_val=1),
    "div4": dict(div_val=4, d_embed=64),
    "div1+pre_lnorm+untie_r": dict(div_val=1, pre_lnorm=True, untie_r=True),
    "div4+same_length": dict(div_val=4, d_embed=64, same_length=True, clamp_len=6),
    # a shortlist of 20 (stored as 24 rows): the head's cluster logits follow the real rows
    "div4+unaligned_shortlist": dict(div_val=4, d_embed=64, cutoffs=[20, 40]),
    "full_softmax": dict(cutoffs=[], vocab_size=60),
}


def width_pair(**overrides) -> tuple[TransformerXL, TransformerXL]:
    """float64: d_model 30 -> 32, d_inner 50 -> 56, heads 5 -> 8, the head's 16 + 2 logits
    -> 24, the last cluster's 60 rows -> 64 (the middle one has 24 already)."""
    settings = dict(vocab_size=100, cutoffs=[16, 40], d_model=30, d_inner=50, n_head=3,
                    d_head=5, dropout=0.0, dropatt=0.0)  # fmt: skip
    config = ModelConfig.from_preset("debug", **{**settings, **overrides})
    torch.manual_seed(0)
    plain = TransformerXL(config).double()
    with torch.no_grad():  # non-zero biases and projections: every term matters
        for p in plain.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.3)
    padded = align.padded(plain, Stored.aligned(config, 8))
    assert padded.layers[0].ff.fc1.weight.shape == (56, 32)
    assert padded.stored == Stored(32, 56, 8, 32 if config.div_val == 1 else config.d_embed,
                                   logits=8, keys=8)  # fmt: skip
    return plain, padded


@pytest.mark.parametrize("overrides", WIDTH_CASES.values(), ids=WIDTH_CASES.keys())
def test_padded_widths_same_log_probs_and_gradients(overrides) -> None:
    plain, padded = width_pair(**overrides)
    vocab = plain.config.vocab_size
    ids = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(1))
    ids[0, 1:6] = torch.tensor([17, 41, 99, 59, 20]) % vocab  # every cluster has labels
    logp_plain, loss_plain = run(plain, ids)
    logp_padded, loss_padded = run(padded, ids)
    assert logp_padded.shape == logp_plain.shape
    torch.testing.assert_close(logp_padded, logp_plain, atol=1e-12, rtol=0)
    torch.testing.assert_close(loss_padded, loss_plain, atol=1e-12, rtol=0)
    loss_plain.backward()
    loss_padded.backward()
    grads_padded = {n: p.grad for n, p in padded.named_parameters()}
    stripped = strip_like_state_dict(padded, grads_padded)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(stripped[name], p.grad, atol=1e-12, rtol=0, msg=name)
    for name, p in padded.named_parameters():
        grad_is_zero_on_padding(padded, name, p)


@pytest.mark.parametrize("name", ["div1", "div4"])
def test_padded_widths_stay_zero_through_adam(name) -> None:
    plain, padded = width_pair(**WIDTH_CASES[name])
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(3))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, padded)]
    fresh = adam_steps(plain, padded, ids, opts)
    params = dict(padded.named_parameters())
    for name, p in fresh.named_parameters():
        pad = p == 0
        assert not params[name][pad].any(), name  # exactly zero, weights and moments
        state = opts[1].state[params[name]]
        assert not state["exp_avg"][pad].any() and not state["exp_avg_sq"][pad].any(), name
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(padded.state_dict()[k], v, atol=1e-9, rtol=0, msg=k)


def test_trainer_with_padded_widths_resumes_across_paddings(tmp_path):
    """d_model 30 and d_inner 50 (stored as 32 and 56 when padded): a padded run's ``last``
    (weights, Adam's moments and the memory, all in the real shapes) resumes unpadded, and
    an unpadded one padded, each continuing the same run as one that never stopped."""
    from safetensors.torch import load_file

    widths = ("model.d_model=30", "model.d_inner=50")
    plain = _train(tmp_path, "plain", "run.align_heads=false", *widths)
    want = plain.model.state_dict()
    _train(tmp_path, "paused", "run.align_heads=true", "run.stop_at=2", *widths)
    memory = load_file(str(tmp_path / "paused" / "last" / "memory.safetensors"))
    assert memory["mems.0"].shape[-1] == 30
    resumed = _train(tmp_path, "resumed", "run.align_heads=false", *widths,
                     resume=tmp_path / "paused" / "last")  # fmt: skip
    _train(tmp_path, "paused2", "run.align_heads=false", "run.stop_at=2", *widths)
    again = _train(tmp_path, "again", "run.align_heads=true", *widths,
                   resume=tmp_path / "paused2" / "last")  # fmt: skip
    assert again.model.layers[0].ff.fc1.weight.shape == (56, 32)
    assert again.memory.mems[0].shape[-1] == 32
    for trainer in (resumed, again):
        for name, value in trainer.model.state_dict().items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=2e-5, msg=name)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_a_classifier_on_a_padded_body_classifies_as_on_the_unpadded_one(pooling) -> None:
    """The body's hidden states stored with 32 dims (d_model 30): the classifier pools the
    real ones, so the same log-probabilities; its optimizer state finds the body's padding."""
    from txlm.classify.classifier import Classifier, ClassifierConfig

    plain_body, padded_body = width_pair()
    config = ClassifierConfig(("a", "b", "c"), pooling=pooling)
    plain = Classifier(plain_body, config).double()
    padded = Classifier(padded_body, config).double()
    padded.head.load_state_dict(plain.head.state_dict())
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(2))
    start = torch.tensor([0, 7])  # the second row's document starts inside its first segment
    # the same arithmetic on zero-padded operands: float64 rounding apart
    torch.testing.assert_close(
        padded(ids, start).log_probs, plain(ids, start).log_probs, atol=1e-12, rtol=0
    )
    axes = align.padded_axes(padded)
    assert axes and axes == {
        f"body.{n}": pads for n, pads in align.padded_axes(padded_body).items()
    }


@pytest.mark.parametrize("name", ["div1", "div4"])
def test_a_model_built_padded_holds_zeros_past_its_real_weights(name) -> None:
    """``TransformerXL(config, stored)`` draws its weights in the real shapes: they are its
    checkpoint, and the padding is exactly zero (its unpadded twin, padded, is the very same
    tensors) with the same log-probabilities in float64."""
    settings = dict(vocab_size=100, cutoffs=[16, 40], d_model=30, d_inner=50, n_head=3,
                    d_head=5, dropout=0.0, dropatt=0.0)  # fmt: skip
    config = ModelConfig.from_preset("debug", **{**settings, **WIDTH_CASES[name]})
    torch.manual_seed(0)
    built = TransformerXL(config, Stored.aligned(config)).double()
    plain = TransformerXL(config).double()
    plain.load_state_dict(built.state_dict())
    again = align.padded(plain, built.stored)
    for (n, a), (_, b) in zip(built.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(built(ids).log_probs, plain(ids).log_probs, atol=1e-12, rtol=0)
