"""txlm.training.averaging: the average equals one computed by hand (uniform, ema, from a
start step), swapping it in and out is exact, its state resumes mid-average bit for bit (in
real shapes for a padded model), and the configuration refuses what could never average."""

from __future__ import annotations

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.helpers.models import debug_model
from txlm.errors import ConfigError
from txlm.training.averaging import WeightAverage, averaged
from txlm.training.config import resolve


def _steps(model, n: int, average: WeightAverage | None = None, seed: int = 0, first: int = 1):
    """``n`` Adam steps of ``model`` on a language-model loss, numbered from ``first``; the
    weights after each."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    after = []
    for step in range(first, first + n):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if average is not None:
            average.update(step)
        after.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return after


def test_uniform_average_is_the_mean_of_the_weights_from_start_on():
    model = debug_model(0).train()
    average = WeightAverage(model, "uniform", start=3)
    after = _steps(model, 6, average)
    assert average.count == 4
    # swa_utils' own AveragedModel, fed the same weights: the same arithmetic
    source = debug_model(0)
    reference = AveragedModel(source)
    for weights in after[2:]:
        source.load_state_dict(weights, strict=False)
        reference.update_parameters(source)
    ref = dict(reference.module.named_parameters())
    for name, got in zip(average.names, average.averaged, strict=True):
        by_hand = torch.stack([w[name] for w in after[2:]]).mean(0)
        # a running mean against a sum divided once: float32 rounding apart
        torch.testing.assert_close(got, by_hand, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, ref[name], rtol=1e-6, atol=1e-7)
        assert not torch.equal(got, after[-1][name])  # the weights did move


def test_ema_average_from_its_start():
    model = debug_model(0).train()
    average = WeightAverage(model, "ema", start=2, decay=0.6)
    after = _steps(model, 5, average)
    for name, got in zip(average.names, average.averaged, strict=True):
        by_hand = after[1][name]
        for w in after[2:]:
            by_hand = 0.6 * by_hand + 0.4 * w[name]
        torch.testing.assert_close(got, by_hand, rtol=1e-5, atol=1e-6)
    # swa_utils' EMA update on the same lists: the same computation, the same bits
    ema = [after[1][n].clone() for n in average.names]
    fold = get_ema_multi_avg_fn(0.6)
    for w in after[2:]:
        fold(ema, [w[n] for n in average.names], 0)
    assert all(torch.equal(a, b) for a, b in zip(ema, average.averaged, strict=True))


def test_swapped_holds_the_average_and_puts_the_weights_back_bit_for_bit():
    model = debug_model(0).train()
    average = WeightAverage(model, "uniform", start=4)
    _steps(model, 3, average)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with averaged(average):  # before start: nothing to swap in
        assert all(torch.equal(v, own[k]) for k, v in model.state_dict().items())
    _steps(model, 3, average, seed=1, first=4)
    assert average.count == 3
    own = {k: v.clone() for k, v in model.named_parameters()}
    with average.swapped():
        inside = dict(model.named_parameters())
        for name, avg in zip(average.names, average.averaged, strict=True):
            assert torch.equal(inside[name], avg)
        assert not torch.equal(inside["layers.0.ff.fc1.weight"], own["layers.0.ff.fc1.weight"])
    assert all(torch.equal(p, own[n]) for n, p in model.named_parameters())
    with averaged(None):  # a run without averaging: the model as it is
        assert all(torch.equal(p, own[n]) for n, p in model.named_parameters())


def test_frozen_parameters_are_not_averaged():
    model = debug_model(0).train()
    for name, p in model.named_parameters():
        if name.startswith("embed"):
            p.requires_grad_(False)
    average = WeightAverage(model, "uniform")
    assert average.names and not any(n.startswith("embed") for n in average.names)


def test_resume_mid_average_is_bit_for_bit():
    """An average saved after step 4 of 7 (its state_dict: real shapes, for a model stored
    padded), loaded into a fresh model's average, continues as the one that never stopped."""
    from txlm.model import align
    from txlm.model.align import Stored

    def padded():
        model = debug_model(0, d_head=12, d_inner=60)  # widths the alignment rounds up
        return align.padded(model, Stored.aligned(model.config)).train()

    straight = padded()
    a = WeightAverage(straight, "uniform", start=2)
    weights = _steps(straight, 7, a)
    assert align.padded_axes(straight)  # some weights are stored padded

    first = padded()
    b = WeightAverage(first, "uniform", start=2)
    _steps(first, 4, b)
    state = b.state_dict()
    real = debug_model(0, d_head=12, d_inner=60).state_dict()
    assert int(state["count"]) == 3
    for name in b.names:
        assert state[f"averaged.{name}"].shape == real[name].shape  # real shapes

    second = padded()
    c = WeightAverage(second, "uniform", start=2)
    c.load_state_dict(state)
    for step, w in enumerate(weights[4:], start=5):  # the straight run's weights of 5..7
        second.load_state_dict(w, strict=False)
        c.update(step)
    assert c.count == a.count == 6
    assert all(torch.equal(x, y) for x, y in zip(a.averaged, c.averaged, strict=True))


def test_a_state_that_does_not_fit_is_refused():
    model = debug_model(0).train()
    average = WeightAverage(model, "uniform")
    _steps(model, 2, average)
    state = average.state_dict()
    other = WeightAverage(debug_model(0, n_layer=3), "uniform")
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict(state)
    fresh = WeightAverage(debug_model(0), "uniform")
    fresh.load_state_dict({"count": torch.tensor(0)})  # saved before its start: empty
    assert not fresh.active


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["optim.average=uniform", "optim.average_start=21"], "would never begin"),
        (["optim.average_start=0"], "average_start must be >= 1"),
        (["optim.average=ema", "optim.average_decay=1.0"], r"average_decay must be in \(0, 1\)"),
        (["optim.average=mean"], "optim.average must be one of none, uniform, ema"),
    ],
)
def test_configuration_refuses_an_average_that_cannot_be(sets, message):
    with pytest.raises(ConfigError, match=message):
        resolve("debug", None, sets)  # debug: 20 steps


def test_the_ptb_preset_turns_both_on(capsys):
    """``txlm train --preset ptb --print-config``: variational dropout and weight averaging."""
    import yaml

    from txlm.cli import main

    assert main(["train", "--preset", "ptb", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["variational_dropout"] is True
    assert printed["optim"]["average"] == "uniform"
    assert 1 <= printed["optim"]["average_start"] <= printed["optim"]["max_steps"]
    assert printed["model"]["dropout"] > 0
