"""TensorBoard for real: a short run writes event files that tensorboard itself reads back
with the scalars of metrics.jsonl (no mock: the tensorboard package is a test dependency)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.train import tiny_config


def test_a_short_run_writes_scalars_tensorboard_reads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from txlm.training import Trainer

    config = tiny_config(
        tmp_path,
        "optim.max_steps=4",
        "eval.eval_interval=2",
        "eval.max_eval_steps=1",
        "eval.final_eval=false",
        "run.log_interval=1",
        "run.progress=false",
        "run.tensorboard=true",
    )
    out = tmp_path / "run"
    Trainer(config, out, echo=False).fit()

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/bpc", "train/lr", "train/tokens_per_s", "train/grad_norm",
                "valid/loss", "valid/bpc"):  # fmt: skip
        assert tag in tags, sorted(tags)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for split, key in (("train", "loss"), ("train", "lr"), ("valid", "bpc")):
        want = [(r["step"], r[key]) for r in records if r["split"] == split]
        got = [(e.step, e.value) for e in events.Scalars(f"{split}/{key}")]
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
    assert [e.step for e in events.Scalars("valid/loss")] == [2, 4]
