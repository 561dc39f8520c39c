"""The analysis commands as a user runs them: real subprocesses, --json, figures, bad input."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

import txlm
from tests.helpers.train import txlm as forked_txlm
from txlm.data import Vocab, prepare_dataset


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis_cli")
    prepare_dataset("shakespeare", root / "data", progress=False)
    vocab = Vocab.load(root / "data" / "shakespeare" / "vocab.json")
    torch.manual_seed(0)
    for name, overrides in [("xl", {}), ("norec", {"mem_len": 0})]:
        config = txlm.ModelConfig.from_preset("debug", vocab_size=len(vocab), **overrides)
        model = txlm.TransformerXL(config)
        for p in model.parameters():
            p.data.normal_(0.0, 0.2)
        txlm.save(model, root / name, vocab_json=vocab.to_json())
    return root


def _txlm(env, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return forked_txlm(list(args), env / "data", timeout=timeout)  # `python -m txlm`


def test_bench_eval_speed_json(env):
    r = _txlm(
        env, "bench", "eval-speed", "--preset", "debug", "--lengths", "8,16", "--tgt-len", "4",
        "--xl-tokens", "8", "--vanilla-positions", "2", "--repeats", "1", "--threads", "1",
        "--json", "--out-dir", str(env / "speed"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [row["attn_len"] for row in out["rows"]] == [8, 16]
    assert all(row["vanilla_forwards"] == 2 for row in out["rows"])
    assert out["vanilla_sampled"] is True
    assert os.path.isfile(out["figures"][0])
    assert json.loads((env / "speed" / "result.json").read_text())["rows"] == out["rows"]


def test_attention_json_and_figures(env):
    r = _txlm(
        env, "attention", str(env / "xl"), "--tokens", "200", "--mem-len", "32",
        "--head", "1:1", "--position", "150", "--threads", "1", "--json",
        "--out-dir", str(env / "att"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    fig6 = out["figure6"]
    assert {k: fig6[k] for k in ("layer", "head", "segment_start", "query", "position")} == {
        "layer": 1, "head": 1, "segment_start": 144, "query": 6, "position": 150,
    }  # fmt: skip
    # that head at that position: its 5 most attended distances, heaviest first, each one
    # it can see (memory 32 + 6 earlier queries of its segment + itself)
    weights = [t["weight"] for t in fig6["top_distances"]]
    assert len(weights) == 5 and weights == sorted(weights, reverse=True) and sum(weights) <= 1
    assert all(0 <= t["distance"] <= 32 + 6 for t in fig6["top_distances"])
    assert out["mem_len"] == 32 and out["queries"] == 200 - 32
    assert len(out["mean_distance_per_head"]) == 2 and len(out["widest_heads"]) == 4
    names = sorted(os.path.basename(f) for f in out["figures"])
    assert names == ["fig5_heads_by_distance.png", "fig6_head_segment.png", "fig7_terms_abd.png"]
    for f in out["figures"]:
        with open(f, "rb") as fh:
            assert fh.read(4) == b"\x89PNG"


def test_recl_json_table(env):
    r = _txlm(
        env, "recl", str(env / "xl"), str(env / "norec"), "--names", "xl,norec",
        "--contexts", "4:16:4", "--targets", "40", "--threads", "1", "--json",
        "--out-dir", str(env / "recl"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["contexts"] == [4, 8, 12, 16] and out["n_tokens"] == 40
    assert set(out["recl"]) == {"0.1", "0.5", "1.0"}
    for per_model in out["recl"].values():
        assert set(per_model) == {"xl", "norec"}
        assert all(v in (4, 8, 12, 16) for v in per_model.values())
    assert len(out["perplexity"]["xl"]) == 4 and len(out["figures"]) == 2
    text = _txlm(
        env, "recl", str(env / "xl"), str(env / "norec"), "--contexts", "4,8",
        "--targets", "10", "--threads", "1",
    )  # fmt: skip
    assert text.returncode == 0, text.stderr
    assert "RECL (Appendix C)" in text.stdout and "norec" in text.stdout
    # stderr is a pipe here, as a log file would be: plain lines, one per model, no bar
    assert "\r" not in text.stderr
    assert "per-token losses: xl done (1/2)" in text.stderr.splitlines()
    assert "per-token losses: norec done (2/2)" in text.stderr.splitlines()


def test_ablate_help_names_the_presets_it_takes(capsys):
    from txlm.analysis.ablation import ABLATION_PRESETS
    from txlm.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["ablate", "--help"])
    assert exit_.value.code == 0
    usage = " ".join(capsys.readouterr().out.split())
    assert "small, tiny, debug (default small" in usage and "ablation-small" not in usage
    assert {"small", "tiny", "debug"} <= set(ABLATION_PRESETS)


@pytest.mark.slow
def test_ablate_json(env):
    r = _txlm(
        env, "ablate", "--preset", "debug", "--steps", "3", "--eval-tokens", "256",
        "--eval-lengths", "16", "--threads", "1", "--json", "--save-dir", str(env / "group"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [row["name"] for row in out["rows"]] == ["xl", "shaw", "xl-norec", "vanilla"]
    assert out["settings"]["steps"] == 3 and out["metric"] == "bpc"
    # the saved group loads, and reproduces the table's "init" figure of the vanilla row
    model = txlm.load(env / "group" / "vanilla" / "best")
    assert model.config.attn_type == "alrfou" and model.config.mem_len == 0
    assert out["checkpoints"][3] == str(env / "group" / "vanilla" / "best")
    # the saved runs feed `txlm recl` as they are; names come from the run folders
    r = _txlm(env, "recl", *out["checkpoints"][:2], "--contexts", "4,8", "--targets", "10",
              "--threads", "1", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["names"] == ["xl", "shaw"]


@pytest.mark.parametrize(
    "args",
    [
        ["recl", "NOPE_DIR", "--contexts", "4,8"],
        ["attention", "{xl}", "--head", "7:0", "--tokens", "64"],
        ["bench", "eval-speed", "--lengths", "0,8"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(env, args):
    args = [a.format(xl=env / "xl", norec=env / "norec") for a in args]
    r = _txlm(env, *args, "--threads", "1")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("txlm: error:"), r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["recl", "{xl}", "--contexts", "4"],
        ["recl", "{xl}", "--contexts", "4,8,16"],
        ["recl", "{xl}", "{norec}", "--names", "a"],
        ["recl", "{xl}", "{norec}", "--names", "a,a"],
        ["recl", "{xl}", "--contexts", "4:2:1"],
        ["attention", "{xl}", "--text", "NOPE.txt"],
        ["attention", "{xl}", "--position", "999", "--tokens", "64"],
        ["attention", "{xl}", "--dataset", "{xl}"],
        ["ablate", "--preset", "nope"],
    ],
)
def test_more_bad_input_in_process(env, args, capsys, monkeypatch):
    """The same error path, in-process (a subprocess per case costs seconds of imports)."""
    from txlm.cli import main

    monkeypatch.setenv("TXLM_DATA_DIR", str(env / "data"))
    args = [a.format(xl=env / "xl", norec=env / "norec") for a in args]
    try:
        code = main([*args, "--threads", "1"])
    except SystemExit as exc:  # argparse refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("txlm: error:"), err
