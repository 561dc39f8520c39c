"""Table 6 ablation: a handful of steps of the whole group on the real default corpus."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.train import metrics, weights
from tests.helpers.train import txlm as run_txlm
from txlm.analysis import ablation
from txlm.config import ModelConfig
from txlm.data import prepare_dataset
from txlm.errors import ConfigError


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return prepare_dataset("shakespeare", tmp_path_factory.mktemp("data"), progress=False)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits on a shared machine
    yield
    torch.set_num_threads(threads)


def test_variant_config_is_the_papers_optimiser_and_objective():
    s = ablation.AblationSettings(preset="debug", steps=40).resolved()
    xl, half, norec = (
        ablation.variant_config(s, v, dataset="shakespeare", data_dir=None, level=None, seed=3)
        for v in (
            ablation.Variant("xl", True, "xl", False),
            ablation.Variant("xl-half", True, "xl", True),
            ablation.Variant("xl-norec", False, "xl", False),
        )
    )
    assert (xl.optim.schedule, xl.optim.warmup_steps, xl.optim.min_lr) == ("cosine", 2, 0.0)
    assert (xl.optim.clip, xl.optim.max_steps, xl.run.seed) == (0.25, 40, 3)
    assert (xl.optim.loss, half.optim.loss) == ("full", "half")
    assert xl.model["mem_len"] == 16 and norec.model["mem_len"] == 0
    assert xl.model.keys() == set(ModelConfig.from_preset("debug").to_dict()) - {"vocab_size"}


@pytest.mark.slow
def test_an_ablation_variant_is_txlm_train_step_for_step(corpus_dir, one_thread, tmp_path):
    """The ablation's training is the trainer: the xl variant's run equals `txlm train`
    with the variant's configuration, loss for loss and weight for weight."""
    s = ablation.AblationSettings(preset="debug", steps=5).resolved()
    variant = ablation.variants()[0]
    config = ablation.variant_config(
        s, variant, dataset="shakespeare", data_dir=str(corpus_dir.parent), level=None, seed=0
    )
    config.run.threads = 1
    model, train_loss = ablation.train_variant(config, tmp_path / "ablate", device="cpu")
    (tmp_path / "variant.yaml").write_text(config.to_yaml())
    out = tmp_path / "train"
    r = run_txlm(["train", "--config", str(tmp_path / "variant.yaml"), "--out", str(out)],
                 corpus_dir.parent)  # fmt: skip
    assert r.returncode == 0, r.stderr
    ours, theirs = metrics(tmp_path / "ablate"), metrics(tmp_path / "train")
    assert [m["step"] for m in ours] == [1, 2, 3, 4, 5]
    assert [(m["loss"], m["lr"], m["grad_norm"]) for m in ours] == [
        (m["loss"], m["lr"], m["grad_norm"]) for m in theirs
    ]
    assert train_loss == ours[-1]["loss"]  # the last 10% of 5 steps: the last step
    state = model.state_dict()
    for name, value in weights(out / "last").items():
        assert torch.equal(state[name], value), name


def test_half_loss_counts_the_last_half_of_each_segment():
    from txlm.training.objective import OBJECTIVES

    labels = torch.arange(12).view(2, 6)
    half = OBJECTIVES["half"](labels)
    assert half.tolist() == [[-100, -100, -100, 3, 4, 5], [-100, -100, -100, 9, 10, 11]]
    assert labels[0, 0] == 0  # the batch's own labels are untouched
    assert OBJECTIVES["full"](labels) is labels


def test_settings_resolve_and_refuse_bad_values():
    s = ablation.AblationSettings(preset="debug", steps=3, eval_lengths=[16, 48]).resolved()
    assert s["steps"] == 3 and s["eval_lengths"] == [16, 48] and s["tgt_len"] == 16
    small = ablation.AblationSettings().resolved()
    assert small["steps"] == 1200 and small["model"]["d_model"] == 128
    with pytest.raises(ConfigError):
        ablation.AblationSettings(preset="nope").resolved()
    with pytest.raises(ConfigError):
        ablation.AblationSettings(preset="debug", steps=0).resolved()


@pytest.mark.slow
def test_ablation_smoke_table6_shape(corpus_dir, one_thread, tmp_path):
    settings = ablation.AblationSettings(
        preset="debug", steps=4, eval_tokens=512, eval_lengths=[16, 32], half_loss=True
    )
    res = ablation.run_ablation(settings, data=str(corpus_dir))
    assert [r.name for r in res.rows] == [
        "xl", "xl-half", "shaw", "xl-norec", "vanilla", "vanilla-half"
    ]  # fmt: skip
    assert res.metric == "bpc"
    by_name = {r.name: r for r in res.rows}
    assert by_name["xl"].recurrence and not by_name["xl-norec"].recurrence
    assert by_name["xl-half"].loss == "half" and by_name["vanilla"].encoding.startswith("Al-Rfou")
    # same shape: the xl variants have identical parameter counts
    assert by_name["xl"].params == by_name["xl-norec"].params == by_name["xl-half"].params
    for r in res.rows:
        assert set(r.by_attn_len) == {"16", "32"}
        assert r.best <= r.init + 1e-9 and r.best == min(r.init, *r.by_attn_len.values())
        assert r.best_attn_len in ("train", 16, 32)
        # 4 steps from a uniform start: near log2(85) bits, not trained, but finite
        assert 5.0 < r.init < 8.0 and math.isfinite(r.train_loss)
    table = ablation.format_table(res)
    assert "bpc init" in table and "Al-Rfou" in table
    ablation.plot_ablation(res, tmp_path / "t6.png")
    assert (tmp_path / "t6.png").read_bytes()[:4] == b"\x89PNG"
