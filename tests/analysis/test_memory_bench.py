"""txlm bench memory: the variant group, its per-copy scoring, and the command."""

from __future__ import annotations

import itertools
import json
import math
import os

import numpy as np
import pytest
import torch

import txlm
from tests.helpers.train import txlm as forked_txlm
from txlm.analysis.ablation import variants
from txlm.analysis.memory import (
    bench_variants,
    chance,
    copy_profile,
    distance_bins,
    memory_reach_bins,
    variant_config,
)
from txlm.training.config import preset_config

TASK = (
    "recall:alphabet=64,span=6,min_dist=6,max_dist=60,train_max_dist=30,"
    "train=4000,valid=2000,test=2000"
)


def test_variants_are_table6s_plus_absolute_positions_with_memory():
    group = bench_variants()
    names = [v.name for v in group]
    assert names == ["xl", "shaw", "xl-norec", "vanilla", "vanilla-mem"]
    assert [v for v in group if v.name != "vanilla-mem"] == variants()
    base = preset_config("recall")
    configs = {v.name: variant_config(base, v).model for v in group}
    assert configs["xl"]["mem_len"] == configs["shaw"]["mem_len"] == base.model["mem_len"] > 0
    assert configs["xl-norec"]["mem_len"] == configs["vanilla"]["mem_len"] == 0
    assert configs["vanilla-mem"]["attn_type"] == "alrfou"
    assert configs["vanilla-mem"]["mem_len"] == base.model["mem_len"]
    assert configs["shaw"]["n_positions"] == base.model["tgt_len"] + base.model["mem_len"]


def test_distance_bins_cover_the_range_in_half_octaves():
    bins = distance_bins(16, 256)
    assert bins[0] == 16 and bins[-1] == 257
    assert all(b > a for a, b in itertools.pairwise(bins))
    assert all(b / a < 1.5 for a, b in itertools.pairwise(bins))


def test_reach_bins_split_at_one_two_four_memories_and_chance_follows_the_form():
    assert memory_reach_bins(2, 32, 256) == [2, 33, 65, 129, 257]
    assert memory_reach_bins(40, 32, 100) == [40, 65, 101]  # empty buckets left out
    assert chance({"keys": 32, "values": 8, "alphabet": 302}) == 1 / 8
    assert chance({"keys": 0, "values": 8, "alphabet": 256}) == 1 / 256


def test_copy_profile_scores_each_copy_once_at_its_stream_position():
    """A model that always predicts one symbol is right exactly on the copies of it."""
    torch.manual_seed(0)
    model = txlm.TransformerXL(txlm.ModelConfig.from_preset("debug", tgt_len=8)).eval()
    with torch.no_grad():  # the softmax bias decides: argmax is always symbol 5
        model.softmax.layers[0].weight.zero_()
        model.softmax.layers[0].bias.zero_()
        model.softmax.layers[0].bias[5] = 1.0
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, size=403)
    distances = np.where(rng.random(403) < 0.5, rng.integers(1, 40, size=403), 0)
    distances[0] = 0
    bins = [1, 10, 40]
    p = copy_profile(model, tokens, distances, bins, mem_len=8, rows=4, reach_bins=[1, 9, 40])
    # a shorter evaluation segment reads the same stream: the same copies, the same answers
    short = copy_profile(model, tokens, distances, bins, mem_len=8, rows=4, tgt_len=3)
    assert short.eval_tgt_len == 3 and p.eval_tgt_len == 8
    assert short.count == p.count and short.accuracy == pytest.approx(p.accuracy)
    assert sum(p.reach_count) == sum(p.count)
    row_len = math.ceil(402 / 4)
    position = np.arange(403)
    row_start = ((position - 1) // row_len) * row_len
    for (lo, hi), acc, count in zip(itertools.pairwise(bins), p.accuracy, p.count, strict=True):
        sel = (distances >= lo) & (distances < hi) & (position - distances >= row_start)
        sel[0] = False
        assert count == sel.sum()
        assert acc == pytest.approx((tokens[sel] == 5).mean())
    # the coarse buckets score the same copies
    for (lo, hi), acc, count in zip(
        itertools.pairwise([1, 9, 40]), p.reach_accuracy, p.reach_count, strict=True
    ):
        sel = (distances >= lo) & (distances < hi) & (position - distances >= row_start)
        sel[0] = False
        assert count == sel.sum() and acc == pytest.approx((tokens[sel] == 5).mean())


def test_bench_memory_command(tmp_path):
    data = tmp_path / "data"
    out = tmp_path / "out"
    r = forked_txlm(
        ["bench", "memory", "--dataset", TASK,
         "--variants", "xl,vanilla", "--steps", "4", "--batch-size", "4", "--tgt-len", "8",
         "--mem-len", "8", "--set", "model.d_model=32", "model.n_head=2", "model.d_head=16",
         "model.d_inner=64", "--eval-multiples", "1,2", "--eval-tgt-len", "4", "--threads", "1",
         "--runs-dir", str(tmp_path / "runs"), "--json", "--out-dir", str(out)],
        data, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    payload = json.loads(r.stdout)
    # relative-sinusoid models with memory also with distances clamped to the training reach
    # M + L = 16; models with memory read segments of --eval-tgt-len, the others their own
    assert [
        (p["variant"], p["eval_mem"], p["clamp_len"], p["eval_tgt_len"])
        for p in payload["profiles"]
    ] == [
        ("xl", 8, -1, 4),
        ("xl", 8, 16, 4),
        ("xl", 16, -1, 4),
        ("xl", 16, 16, 4),
        ("vanilla", 0, -1, 8),
    ]
    assert payload["reach_bins"] == [6, 9, 17, 33, 61]
    assert all(sum(p["reach_count"]) == sum(p["count"]) for p in payload["profiles"])
    assert [v["train_mem"] for v in payload["variants"]] == [8, 0]
    # each copy of the scored stream is in exactly one bucket, the same for every row
    counts = {tuple(p["count"]) for p in payload["profiles"]}
    assert len(counts) == 1 and sum(counts.pop()) > 300
    for p in payload["profiles"]:
        assert all(0.0 <= a <= 1.0 for a in p["accuracy"] if a is not None)
        assert [a is None for a in p["accuracy"]] == [c == 0 for c in p["count"]]
    assert os.path.isfile(payload["figures"][0])
    assert json.loads((out / "result.json").read_text())["profiles"] == payload["profiles"]
    ckpt = payload["variants"][0]["checkpoint"]
    assert txlm.load(ckpt).config.mem_len == 8
    assert payload["settings"]["train"]["optim"]["max_steps"] == 4

    bad = forked_txlm(["bench", "memory", "--dataset", TASK, "--variants", "lstm"], data,
                      timeout=120)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("txlm: error: unknown variant")
