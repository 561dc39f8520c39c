"""Table 6 ablation: a handful of steps of the whole group on the real default corpus."""

from __future__ import annotations

import math

import pytest
import torch

from txlm.analysis import ablation
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


def test_lr_schedule():
    assert ablation.lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert ablation.lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert ablation.lr_at(55, 100, 1.0, 10) == pytest.approx(0.5)
    assert ablation.lr_at(100, 100, 1.0, 10) == pytest.approx(0.0)


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
