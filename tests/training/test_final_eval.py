"""The final evaluation: its cost bounded by eval.final_max_tokens, and progress lines on a
stderr that is not a terminal (a log file), so a long evaluation shows that it moves."""

from __future__ import annotations

import json
import re

from tests.helpers.train import tiny_config


def test_final_evaluation_is_bounded_and_reports_progress_into_a_file(
    tmp_path, capsys, monkeypatch
):
    import itertools

    from txlm.data import load_prepared, progress
    from txlm.training import Trainer

    # every reading of the progress clock 2 s later: each evaluation lasts past its first
    # second, so a log shows its tenths (a step hook, not the wall clock)
    monkeypatch.setattr(progress, "_now", itertools.count(0.0, 2.0).__next__)

    config = tiny_config(
        tmp_path,
        "optim.max_steps=2",
        "eval.eval_interval=0",
        "eval.sample_tokens=0",
        "eval.batch_size=2",
        "eval.final_max_tokens=100",
        "run.tensorboard=false",
        "run.progress=true",
    )
    out = tmp_path / "run"
    Trainer(config, out).fit()
    err = capsys.readouterr().err  # captured: not a terminal, as a redirected log
    results = json.loads((out / "results.json").read_text())
    tgt_len = results["valid"]["tgt_len"]
    # 100 tokens in segments of 2 rows x tgt_len: floor(100 / (2 * tgt_len)) segments
    segments = 100 // (2 * tgt_len)
    for split in ("valid", "test"):
        r = results[split]
        assert r["segments"] == segments and r["tokens"] == segments * 2 * tgt_len
        corpus_tokens = len(load_prepared(next((tmp_path / "data").iterdir())).split(split))
        assert r["split_tokens"] == corpus_tokens > 100
        # a line at every tenth of the segments, the last one at the end
        lines = re.findall(rf"^final {split}: (\d+)/(\d+) segments, \d+s$", err, re.M)
        assert lines and lines[-1] == (str(segments), str(segments)), err
        done = [int(d) for d, _ in lines]
        assert done == sorted(set(done))
    # the run's own (capped) validations stay quiet: a line per tenth only for whole splits
    assert not re.search(r"^valid: \d+/\d+ segments", err, re.M), err


def test_a_final_evaluation_within_a_second_prints_only_its_result(tmp_path, capsys, monkeypatch):
    from txlm.data import progress
    from txlm.training import Trainer

    monkeypatch.setattr(progress, "_now", lambda: 0.0)  # no time passes
    config = tiny_config(
        tmp_path, "optim.max_steps=2", "eval.eval_interval=0", "eval.sample_tokens=0",
        "run.tensorboard=false", "run.progress=true",
    )  # fmt: skip
    Trainer(config, tmp_path / "run").fit()
    captured = capsys.readouterr()
    assert not re.search(r"segments, \d+s$", captured.err, re.M), captured.err
    assert re.search(r"^valid: loss \d", captured.out, re.M), captured.out
    assert re.search(r"^test: loss \d", captured.out, re.M), captured.out
