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


# -- in the trainer --------------------------------------------------------------------------
BOTH = ["model.dropout=0.2", "model.variational_dropout=true", "optim.average=uniform"]


@pytest.mark.slow
def test_best_holds_the_average_and_results_report_both(tmp_path):
    """Validated at the end only: `best` holds the average that `last` carries beside the
    weights as trained; results.json has the final valid of both, the averaged one being
    what the final evaluation measured on `best`."""
    import json

    from safetensors.torch import load_file

    from tests.helpers.train import FAST, tiny_text, txlm, weights

    text = tiny_text(tmp_path)
    out = tmp_path / "run"
    r = txlm(
        ["train", "--preset", "debug", "--out", str(out), "--set", *FAST, *BOTH,
         f"data.dataset=text:{text}", "optim.max_steps=8", "optim.average_start=5",
         "eval.eval_interval=0", "eval.sample_tokens=0"],
        tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    average = load_file(str(out / "last" / "average.safetensors"))
    assert int(average["count"]) == 4  # steps 5..8
    best, trained = weights(out / "best"), weights(out / "last")
    names = [k.removeprefix("averaged.") for k in average if k != "count"]
    assert names
    for name in names:
        assert torch.equal(best[name], average[f"averaged.{name}"]), name
    assert any(not torch.equal(trained[n], best[n]) for n in names)
    results = json.loads((out / "results.json").read_text())
    record = results["average"]
    assert (record["mode"], record["start"], record["count"]) == ("uniform", 5, 4)
    assert record["valid"]["loss"] == results["valid"]["loss"]  # `best`: the same weights
    assert record["valid_unaveraged"]["loss"] != record["valid"]["loss"]
    assert record["valid"]["tokens"] == record["valid_unaveraged"]["tokens"]


@pytest.mark.slow
def test_two_processes_keep_one_average(tmp_path):
    """Under DDP (2 processes, gloo) both ranks hold the same average, bit for bit, which
    `last` saves; it is the one process's average of the same global batches (a tolerance:
    another split of the batch sums the gradients in another order)."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.helpers.env import REPO, subprocess_env
    from tests.helpers.train import FAST, tiny_text, txlm

    text = tiny_text(tmp_path)
    # no dropout: each rank draws its own masks, so one process would take other steps (the
    # ranks' rows differ all the same: only DDP's reduction keeps their weights equal)
    sets = [*FAST, "optim.average=uniform", "model.dropout=0.0",
            f"data.dataset=text:{text}", f"data.data_dir={tmp_path / 'data'}",
            "data.batch_size=4", "optim.max_steps=6", "optim.average_start=3",
            "eval.eval_interval=0", "eval.final_eval=false"]  # fmt: skip
    script = str(REPO / "tests" / "helpers" / "ddp_average.py")
    two = tmp_path / "w2"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         script, str(two), *sets],
        cwd=REPO, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    # the one process: a plain `txlm train` (its `last` holds the average it kept)
    alone = tmp_path / "w1"
    r = txlm(["train", "--preset", "debug", "--out", str(alone), "--set", *sets], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rank0 = load_file(str(two / "average.rank0.safetensors"))
    rank1 = load_file(str(two / "average.rank1.safetensors"))
    saved = load_file(str(two / "last" / "average.safetensors"))
    one = load_file(str(alone / "last" / "average.safetensors"))
    assert int(rank0["count"]) == 4
    assert rank0.keys() == rank1.keys() == saved.keys() == one.keys()
    for k in rank0:
        assert torch.equal(rank0[k], rank1[k]), k
        assert torch.equal(rank0[k], saved[k]), k
        torch.testing.assert_close(rank0[k], one[k], atol=1e-5, rtol=1e-4)
