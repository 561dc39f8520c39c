"""Evaluation speed (Table 9): structure and the vanilla side's one forward per position."""

from __future__ import annotations

import pytest
import torch

from txlm import ModelConfig, TransformerXL
from txlm.analysis import speed
from txlm.errors import ConfigError


def test_eval_speed_structure_and_one_forward_per_position(tmp_path):
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig.from_preset("debug"))  # training mode, as built
    vanilla = speed.vanilla_model_for(model, 24)
    assert vanilla.config.attn_type == "alrfou" and vanilla.config.mem_len == 0
    windows: list[tuple[int, ...]] = []  # the input shape of every vanilla forward
    vanilla.layers[0].register_forward_pre_hook(lambda mod, args: windows.append(args[0].shape))
    res = speed.measure_eval_speed(
        model, [12, 24], tgt_len=8, xl_tokens=16, vanilla_positions=3, repeats=2,
        vanilla_model=vanilla,
    )  # fmt: skip
    assert [r.attn_len for r in res.rows] == [12, 24]
    for r in res.rows:
        assert r.vanilla_positions == 3 and r.vanilla_forwards == 3 * 2
        assert r.xl_tokens == 16
        assert r.xl_ms_per_token > 0 and r.vanilla_ms_per_token > 0
        assert r.slowdown == pytest.approx(r.vanilla_ms_per_token / r.xl_ms_per_token)
    # per length and round: one untimed warm-up forward, then one [1, A] window per position
    per_len = 2 * (1 + 3)
    assert len(windows) == 2 * per_len
    assert set(windows[:per_len]) == {(1, 12, 32)} and set(windows[per_len:]) == {(1, 24, 32)}
    assert model.config.mem_len == 16 and not model.config.same_length  # restored
    assert model.training and not vanilla.training  # timed in eval mode, handed back as they came
    assert res.vanilla_sampled and "sample of 3 positions" in res.note
    assert "paper" in speed.format_table(res)
    speed.plot_speed(res, tmp_path / "t9.png")
    assert (tmp_path / "t9.png").read_bytes()[:4] == b"\x89PNG"


def test_paper_lengths_carry_the_paper_figures():
    assert speed.PAPER_TABLE9[800] == 363.0 and speed.PAPER_TABLE9[3800] == 1874.0


def test_bad_lengths():
    model = TransformerXL(ModelConfig.from_preset("debug"))
    with pytest.raises(ConfigError):
        speed.measure_eval_speed(model, [])
    with pytest.raises(ConfigError):
        speed.measure_eval_speed(model, [8], vanilla="bogus")
