"""RECL (Appendix C): a golden case worked by hand, and the per-token loss contract."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from txlm import ModelConfig, TransformerXL
from txlm.analysis import recl
from txlm.errors import ConfigError

# Two models, contexts 10/20/30, four target tokens: losses[i, k, t] = l_i(c_k, t).
A = [[2.0, 1.0, 3.0, 0.5], [1.0, 1.0, 2.0, 0.5], [1.0, 1.0, 2.0, 0.5]]
B = [[1.5, 2.0, 4.0, 0.4], [1.5, 2.0, 4.0, 0.4], [1.4, 2.0, 4.0, 0.4]]
LOSSES = np.array([A, B])
CONTEXTS = [10, 20, 30]


def test_baseline_and_hard_positions_by_hand():
    # b(10, t) = min over models = [1.5, 1.0, 3.0, 0.4]
    assert recl.baseline(LOSSES, 0).tolist() == [1.5, 1.0, 3.0, 0.4]
    assert recl.hard_positions(recl.baseline(LOSSES, 0), 0.5).tolist() == [0, 2]
    assert recl.hard_positions(recl.baseline(LOSSES, 0), 0.1).tolist() == [2]  # ceil(0.4) = 1
    assert recl.hard_positions(recl.baseline(LOSSES, 0), 1.0).tolist() == [0, 1, 2, 3]
    # ties (b(20) = [1, 1, 2, .4]) break by position: the top two are 2.0 (t=2) and t=0
    assert recl.hard_positions(recl.baseline(LOSSES, 1), 0.5).tolist() == [0, 2]


def test_relative_loss_and_gain_golden():
    # r = 1: f(10,10) = mean b = 5.9 / 4; f_A(10,20) = mean(min(b, l_A(20))) = 4.4 / 4
    assert recl.relative_loss(LOSSES, 0, 0, 0, 1.0) == pytest.approx(1.475)
    assert recl.relative_loss(LOSSES, 1, 0, 0, 1.0) == pytest.approx(1.475)  # same baseline
    assert recl.relative_loss(LOSSES, 0, 0, 1, 1.0) == pytest.approx(1.1)
    assert recl.relative_gain(LOSSES, 0, 0, 1, 1.0) == pytest.approx(1 - math.exp(-0.375))
    assert recl.relative_gain(LOSSES, 1, 0, 1, 1.0) == pytest.approx(0.0)
    # r = 0.5: T = {0, 2}; f(10,10) = 2.25, f_A(10,20) = (1 + 2) / 2
    assert recl.relative_gain(LOSSES, 0, 0, 1, 0.5) == pytest.approx(1 - math.exp(-0.75))
    # r = 0.1: T = {2}; f(10,10) = 3, f_A(10,20) = 2
    assert recl.relative_gain(LOSSES, 0, 0, 1, 0.1) == pytest.approx(1 - math.exp(-1.0))
    assert recl.unnormalised_gain(LOSSES, 0, 0, 1, 0.1) == pytest.approx(math.exp(3) - math.exp(2))


def test_recl_thresholding_golden():
    # A gains from 10 to 20, then nothing from 20 to 30: RECL 20; B never gains: RECL 10.
    res = recl.compute_recl(LOSSES, CONTEXTS, ["A", "B"])
    for r in ("0.1", "0.5", "1.0"):
        assert res.recl[r] == {"A": 20, "B": 10}
        assert res.reached_end[r] == {"A": False, "B": False}
    assert res.gains["1.0"]["A"] == pytest.approx([1 - math.exp(-0.375), 0.0])
    assert res.perplexity["B"][0] == pytest.approx(math.exp(np.mean(B[0])))


def test_recl_lower_bound_and_threshold():
    one = np.array([[[3.0], [2.0], [1.0]]])  # gains all the way: RECL is the grid's end
    assert recl.recl_of(one, 0, CONTEXTS, 1.0) == (30, True)
    # a gain of 1 - e^-0.005 ~ 0.005 is below the 0.01 threshold: stop at the first c
    small = np.array([[[1.0], [0.995], [0.99]]])
    assert recl.recl_of(small, 0, CONTEXTS, 1.0) == (10, False)
    assert recl.recl_of(small, 0, CONTEXTS, 1.0, threshold=0.001) == (30, True)


def test_bad_inputs_are_config_errors():
    with pytest.raises(ConfigError):
        recl.compute_recl(LOSSES, [10, 20], ["A", "B"])
    with pytest.raises(ConfigError):
        recl.compute_recl(LOSSES, CONTEXTS, ["A"])
    with pytest.raises(ConfigError):
        recl.hard_positions(np.ones(3), 0.0)
    with pytest.raises(ConfigError):
        recl.target_positions(10, 10, 5)


def test_token_losses_use_exactly_c_tokens_of_context():
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig.from_preset("debug")).eval()
    for p in model.parameters():
        p.data.normal_(0.0, 0.2)  # an untrained model would barely use its context
    stream = torch.randint(0, 64, (80,))
    contexts = [4, 8, 12]
    targets = recl.target_positions(len(stream), max(contexts), 10)
    assert targets.min() >= 12 and targets.max() == 79 and len(targets) == 10
    losses = recl.token_losses(model, stream, contexts, targets, batch_size=3)
    assert losses.shape == (3, 10)
    # the same as one direct forward of the c tokens before t
    t, c = int(targets[4]), 8
    with torch.no_grad():
        out = model(stream[t - c : t][None], labels=stream[t - c + 1 : t + 1][None])
    assert losses[1, 4] == pytest.approx(float(out.losses[0, -1]), abs=1e-5)
    # tokens before t - c do not matter; tokens inside the window do
    changed = stream.clone()
    changed[: t - c] = (changed[: t - c] + 1) % 64
    again = recl.token_losses(model, changed, [c], targets[4:5])
    assert again[0, 0] == pytest.approx(losses[1, 4], abs=1e-6)
    changed[t - 2] = (changed[t - 2] + 1) % 64
    moved = recl.token_losses(model, changed, [c], targets[4:5])
    assert abs(moved[0, 0] - losses[1, 4]) > 1e-4
    assert model.config.mem_len == 16  # lengths restored
    model.train()  # a training model is scored without dropout and handed back training
    assert recl.token_losses(model, stream, [c], targets[4:5])[0, 0] == pytest.approx(
        losses[1, 4], abs=1e-6
    )
    assert model.training


def test_group_names_and_contexts_are_checked_in_the_library():
    assert recl.group_names(["runs/xl/best", "runs/shaw/last", "ckpt"]) == ["xl", "shaw", "ckpt"]
    assert recl.group_names(["a", "b"], ["x", "y"]) == ["x", "y"]
    with pytest.raises(ConfigError, match="1 --names for 2 checkpoints"):
        recl.group_names(["a", "b"], ["x"])
    with pytest.raises(ConfigError, match="must differ"):
        recl.group_names(["runs/a/best", "other/a/best"])
    recl.check_contexts([4, 8, 12])
    with pytest.raises(ConfigError, match="at least two"):
        recl.check_contexts([4])
    with pytest.raises(ConfigError, match="evenly spaced"):
        recl.check_contexts([4, 8, 16])
