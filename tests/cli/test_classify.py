"""``txlm train --init CKPT --task classify`` through the real CLI: the memory carries a label
that only it can see; eval and classify read the checkpoint; a paused and resumed run ends
bit for bit as one straight run; bad datasets and misused checkpoints get one line, exit 2.

Runs go through the warm fork runner (``reliability_cli_runner``: ``python -m txlm`` without
an interpreter start-up each).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.helpers.classify import LENGTH, MARKERS, label_folders, marker_documents, tiny_lm
from tests.helpers.cli_table import Case, both, run_case, write
from tests.helpers.train import assert_same_run

FAST = ["run.threads=1", "run.progress=false", "run.tensorboard=false", "run.deterministic=true"]


def train_argv(*sets: str, out: str = "run") -> list[str]:
    return [
        "train", "--init", "lm", "--task", "classify", "--preset", "debug", "--out", out,
        "--set", "data.dataset=classes:ds", "data.batch_size=16", "eval.batch_size=32",
        "eval.eval_interval=0", "optim.lr=3e-3", "optim.warmup_steps=10", *FAST, *sets,
    ]  # fmt: skip


def run(runner, work: Path, argv: list[str], name: str = "io") -> tuple[int, str, str]:
    return runner.run(argv, work, work / name, {"TXLM_DATA_DIR": str(work / "data")})


@pytest.fixture(scope="module")
def marker_runs(runner, tmp_path_factory) -> Path:
    """The marker task (the label set by a symbol in the second of four segments), trained
    from a seed-0 debug model with the ``last`` pooling: with memory 16 and without."""
    work = tmp_path_factory.mktemp("marker")
    tiny_lm(work / "lm")
    marker_documents(work / "ds", {"train": 64, "valid": 16, "test": 32})
    for mem_len in (16, 0):
        argv = train_argv(
            "classify.pooling=last", f"model.mem_len={mem_len}", "optim.max_steps=80",
            out=f"mem{mem_len}",
        )  # fmt: skip
        rc, out, err = run(runner, work, argv, f"io{mem_len}")
        assert rc == 0, err + out
    return work


def test_the_memory_carries_a_label_set_before_the_last_segment(marker_runs) -> None:
    """The last segment sees the marker only through the memory: near 1 with it, chance
    (0.5: two labels, 64 test documents) without."""
    with_memory = json.loads((marker_runs / "mem16" / "results.json").read_text())
    without = json.loads((marker_runs / "mem0" / "results.json").read_text())
    assert with_memory["test"]["accuracy"] >= 0.95
    assert 0.3 <= without["test"]["accuracy"] <= 0.7
    assert with_memory["test"]["documents"] == 64 and with_memory["metric"] == "accuracy"


def test_the_checkpoint_records_the_task_labels_and_split(marker_runs) -> None:
    config = json.loads((marker_runs / "mem16" / "best" / "config.json").read_text())
    assert config["task"] == "classify" and config["train"]["task"] == "classify"
    assert config["classifier"] == {"labels": ["x", "y"], "pooling": "last", "grad_segments": 1}
    assert config["dataset"]["split"] == {"given": True}
    assert len(config["dataset"]["files"]["test"]) == 64
    assert config["init"]["path"] == str((marker_runs / "lm").resolve())
    records = (marker_runs / "mem16" / "metrics.jsonl").read_text().splitlines()
    valid = [json.loads(r) for r in records if json.loads(r)["split"] == "valid"]
    assert valid and {"accuracy", "bits", "loss"} <= set(valid[-1])


def test_eval_reports_what_the_run_measured(runner, marker_runs) -> None:
    work = marker_runs
    results = json.loads((work / "mem16" / "results.json").read_text())
    rc, out, err = run(
        runner, work, ["eval", "mem16/best", "--split", "test", "--json", "--batch-size", "32"]
    )
    assert rc == 0, err
    got = json.loads(out)
    # the same documents, batches and weights as the run's final evaluation: equal numbers
    for key in ("accuracy", "confusion", "per_class", "loss", "macro_f1"):
        assert got[key] == results["test"][key], key
    assert sum(map(sum, got["confusion"])) == 64
    rc, out, err = run(runner, work, ["eval", "mem16/best", "--split", "valid"])
    assert rc == 0, err
    assert out.startswith("valid: accuracy ") and "confusion (rows: true" in out


def test_info_shows_a_classifier(runner, marker_runs) -> None:
    rc, out, err = run(runner, marker_runs, ["info", "mem16/best", "--json"])
    assert rc == 0, err
    info = json.loads(out)
    assert info["task"] == "classify" and info["classifier"]["labels"] == ["x", "y"]
    import txlm

    body = txlm.load(marker_runs / "lm").num_parameters()
    assert info["params"] == body + 2 * info["model"]["d_model"] + 2  # the body's and the head's


def test_classify_labels_files(runner, marker_runs) -> None:
    work = marker_runs
    files = [f"ds/test/{label}/{i:03d}.txt" for label in MARKERS for i in range(4)]
    rc, out, err = run(runner, work, ["classify", "mem16/best", *files, "--json"])
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [r["file"] for r in lines] == files
    for r in lines:
        assert set(r["probs"]) == {"x", "y"}
        assert r["label"] == max(r["probs"], key=r["probs"].get)
    assert sum(r["label"] == r["file"].split("/")[2] for r in lines) >= 7
    # a new document, ten times longer than any training document, marker near its end
    long = "abcdefgh" * (10 * LENGTH // 8 - 3) + "abYdefgh" + "abcdefgh" * 2
    (work / "long.txt").write_text(long)
    rc, out, err = run(runner, work, ["classify", "mem16/best", "long.txt"])
    assert rc == 0, err
    path, label, probs = out.strip().split("\t")
    assert (path, label) == ("long.txt", "y") and probs.startswith("x 0.")


def test_a_paused_and_resumed_run_ends_as_a_straight_one(runner, tmp_path) -> None:
    tiny_lm(tmp_path / "lm")
    marker_documents(tmp_path / "ds", {"train": 12, "valid": 4})
    steps = ["optim.max_steps=6", "run.log_interval=1", "eval.final_eval=false"]
    rc, _, err = run(runner, tmp_path, train_argv(*steps, "data.batch_size=8", out="straight"))
    assert rc == 0, err
    argv = train_argv(*steps, "data.batch_size=8", "run.stop_at=3", out="paused")
    rc, _, err = run(runner, tmp_path, argv, "io1")
    assert rc == 0, err
    resume = ["train", "--resume", "paused/last", "--set", "run.stop_at=null"]
    rc, _, err = run(runner, tmp_path, resume, "io2")
    assert rc == 0, err
    # 24 training documents in batches of 8: the resumed run crosses into the second epoch
    assert_same_run(tmp_path / "straight", tmp_path / "paused", 6)


def test_a_seeded_split_is_recorded_in_the_data_folder_and_the_checkpoint(runner, tmp_path):
    tiny_lm(tmp_path / "lm")
    rng = random.Random(0)
    docs = {label: ["".join(rng.choice("abcdefgh") for _ in range(20)) + marker
                    for _ in range(10)] for label, marker in MARKERS.items()}  # fmt: skip
    label_folders(tmp_path / "ds", docs)
    argv = train_argv("optim.max_steps=2", "eval.final_eval=false", "run.seed=3")
    rc, out, err = run(runner, tmp_path, argv)
    assert rc == 0, err
    config = json.loads((tmp_path / "run" / "last" / "config.json").read_text())
    dataset = config["dataset"]
    assert dataset["split"] == {"given": False, "seed": 3, "valid_fraction": 0.1,
                                "test_fraction": 0.1}  # fmt: skip
    assert [len(dataset["files"][s]) for s in ("train", "valid", "test")] == [16, 2, 2]
    [recorded] = (tmp_path / "data" / "classes").glob("ds-*/split.json")
    assert json.loads(recorded.read_text()) == {k: v for k, v in dataset.items() if k != "metric"}
    assert f"split recorded in {recorded}" in out


def test_a_frozen_body_trains_only_the_head(runner, tmp_path) -> None:
    """``optim.freeze=[body]`` (a linear probe): the body ends as the language model was."""
    from tests.helpers.train import weights

    tiny_lm(tmp_path / "lm")
    marker_documents(tmp_path / "ds", {"train": 8, "valid": 4})
    argv = train_argv("optim.max_steps=3", "eval.final_eval=false", "optim.freeze=[body]")
    rc, _, err = run(runner, tmp_path, argv)
    assert rc == 0, err
    trained, lm = weights(tmp_path / "run" / "last"), weights(tmp_path / "lm")
    assert all(torch.equal(trained[f"body.{k}"], v) for k, v in lm.items())
    # Adam kept moments for the head's weight and bias only
    from safetensors.torch import load_file

    moments = load_file(str(tmp_path / "run" / "last" / "optimizer.safetensors"))
    assert len({key.split(".")[0] for key in moments}) == 2


# -- bad input (contract C24: one line, exit 2, nothing on disk changed) ---------------------
def _setup(docs: dict[str, list[str]]):
    def f(work: Path) -> None:
        tiny_lm(work / "lm")
        label_folders(work / "ds", docs)

    return f


GOOD = {"x": ["abcX", "abXd", "Xbcd"], "y": ["abcY", "abYd", "Ybcd"]}
CASES = [
    Case("classify-train-one-label", train_argv(), "at least two label folders",
         _setup({"x": GOOD["x"]})),
    Case("classify-train-empty-label-folder", train_argv(), "holds no .txt documents",
         both(_setup(GOOD), lambda w: (w / "ds" / "z").mkdir())),
    Case("classify-train-empty-document", train_argv(), "is empty",
         both(_setup(GOOD), write("ds/y/003.txt", ""))),
    Case("classify-train-unreadable-document", train_argv(), "not UTF-8",
         both(_setup(GOOD), write("ds/y/003.txt", b"\xff\xfeab"))),
    Case("classify-train-not-classes", train_argv("data.dataset=text:ds/x/000.txt"),
         "classes:DIR", _setup(GOOD)),
    Case("classify-train-compiled", train_argv("run.compile=true"), "run.compile=true",
         _setup(GOOD)),
    Case("classify-train-without-init", [a for a in train_argv() if a not in ("--init", "lm")],
         "pass --init", _setup(GOOD)),
    Case("classify-generate-a-classifier", ["generate", "clf", "--prompt", "ab"],
         "not a language model", lambda w: _classifier(w)),
    Case("classify-eval-lm-option", ["eval", "clf", "--kv-cache"],
         "not options of a classifier", lambda w: _classifier(w)),
    Case("classify-eval-precision", ["eval", "clf", "--precision", "int8"],
         "--precision int8: not options of a classifier", lambda w: _classifier(w)),
]  # fmt: skip


def _classifier(work: Path) -> None:
    from tests.helpers.classify import save_classifier

    save_classifier(work / "clf", tiny_lm(work / "lm"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, runner, tmp_path) -> None:
    run_case(case, tmp_path / "no-assets", runner, tmp_path)


@pytest.mark.slow
def test_two_processes_and_accumulation_match_one(runner, tmp_path) -> None:
    """DDP (2 CPU processes of 4 documents) and 2 accumulation chunks take the steps of one
    process of 8: the gradient is the mean over the global batch's documents either way."""
    import subprocess
    import sys

    import torch

    from tests.helpers.env import subprocess_env
    from tests.helpers.train import metrics, weights

    tiny_lm(tmp_path / "lm")
    marker_documents(tmp_path / "ds", {"train": 8, "valid": 4})
    steps = ["optim.max_steps=4", "run.log_interval=1", "eval.final_eval=false",
             "data.batch_size=8"]  # fmt: skip
    rc, _, err = run(runner, tmp_path, train_argv(*steps, out="one"))
    assert rc == 0, err
    rc, _, err = run(runner, tmp_path, train_argv(*steps, "optim.grad_accum=2", out="accum"))
    assert rc == 0, err
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "txlm", *train_argv(*steps, out="two")],
        cwd=tmp_path, env=subprocess_env(tmp_path / "data"), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es)" in two.stdout
    ref = [m["loss"] for m in metrics(tmp_path / "one")]
    assert len(ref) == 4
    for other in ("two", "accum"):
        # the same sums in another order (rows split across ranks or chunks): float32 rounding
        assert [m["loss"] for m in metrics(tmp_path / other)] == pytest.approx(ref, rel=1e-5)
        a, b = weights(tmp_path / "one" / "last"), weights(tmp_path / other / "last")
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
