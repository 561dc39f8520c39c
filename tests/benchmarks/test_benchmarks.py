"""The benchmark scripts run, and their FLOP accounting (the MFU denominator) is right."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import compare
import gpu_check

SMALL = compare.Shape("t", n_layer=2, d_model=64, n_head=4, d_head=16, d_inner=128, batch=2,
                      tgt_len=16, mem_len=16)  # fmt: skip


_counted = gpu_check.count_flops  # torch's FLOP counter, with the in-place baddbmm_ known


def test_forward_flops_match_the_ops_the_model_runs():
    """compare.forward_flops equals what torch's FLOP counter sees in txlm's forward with a
    full memory (math attention path, so every product is a plain matmul)."""
    _, tx = compare.build_pair(SMALL)
    for layer in tx.layers:
        layer.attn.attn_impl = "math"
    tx.eval()
    ids = torch.randint(0, SMALL.vocab, (SMALL.batch, SMALL.tgt_len))
    with torch.no_grad():
        mems = tx(ids).mems
        counted = _counted(lambda: tx(ids, mems=mems))
    assert counted == compare.forward_flops(SMALL, SMALL.mem_len)


def test_train_flops_are_forward_and_backward_less_the_unneeded_input_gradients():
    _, tx = compare.build_pair(SMALL)
    for layer in tx.layers:
        layer.attn.attn_impl = "math"
    tx.train()
    for module in tx.modules():  # dropout does no matmul work; keep the count exact
        if hasattr(module, "p"):
            module.p = 0.0
    ids = torch.randint(0, SMALL.vocab, (SMALL.batch, SMALL.tgt_len))
    mems = tx(ids).mems

    def step():
        tx(ids, mems=mems, labels=ids).loss.backward()

    # Backward = 2x forward, except for inputs that need no gradient: the memory's rows of
    # the key/value projection (txlm projects the memory apart so that this is really
    # skipped) and R in W_kR R.
    assert _counted(step) == compare.train_flops(SMALL)


@pytest.mark.slow
def test_compare_quick_run_writes_ratios(tmp_path):
    out = tmp_path / "compare.json"
    argv = ["--quick", "--configs", "cpu", "--dtypes", "fp32", "--rounds", "1",
            "--workloads", "train,eval_m128", "--threads", "1", "--out", str(out)]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert compare.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the script's --threads is for its own process
    result = json.loads(out.read_text())
    assert result["cpu"] == compare.cpu_name() != ""  # the CPU the ratios belong to
    assert result["parity_max_abs_logprob_diff"]["cpu"] < 1e-4
    rows = {r["workload"]: r for r in result["results"]}
    assert set(rows) == {"train", "eval_m128"}
    for row in rows.values():
        assert row["speedup"] > 0 and len(row["speedup_rounds"]) == row["rounds"] == 1
        assert 0 < row["txlm_mfu"] < 5
    assert "speedup_kv" in rows["eval_m128"]


def test_first_call_hands_over_the_code_inductor_generates(fresh_dynamo):
    """gpu_check counts a compiled decoding step's kernels from the code its first call
    generates (on CUDA: the Triton kernels and library calls a token launches)."""
    from inductor_code import kernel_counts

    fn = torch.compile(lambda x, w: torch.relu(x @ w).sum(-1), fullgraph=True)
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    code: list[str] = []
    out = gpu_check.first_call(fn, x, w, into=code)
    torch.testing.assert_close(out, torch.relu(x @ w).sum(-1))
    kinds = kernel_counts(code)
    assert kinds.get("fused", 0) >= 1 and sum(kinds.values()) >= 2, kinds  # + the product
    assert gpu_check.first_call(fn, x, w, into=None) is not None  # compiled: no new code
    again: list[str] = []
    gpu_check.first_call(fn, x, w, into=again)
    assert again == []


def test_gpu_check_script_runs_on_the_cpu(tmp_path, fresh_dynamo):
    """The prepared device script (benchmarks/gpu_check.py) runs every section end to end on
    a tiny shape, so a session that is lent a GPU can run it as it is. (It counts the graphs
    it compiles, as in the fresh process a session runs it in: dynamo reset first, else the
    graphs earlier tests left, and their recompile limits, change the count.)"""
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["errors"] == {} and result["skipped"] == []
    assert result["parity_max_abs_logprob_diff_vs_cpu"] == 0.0  # CPU against itself
    if importlib.util.find_spec("triton") is not None:  # the test extra has it on Linux
        # the Triton attention against the math path (the interpreter: conftest sets it)
        triton_parity = result["triton_attention_parity"]["fp32"]
        assert triton_parity["loss_rel_diff"] <= 1e-6 and triton_parity["grad_rel_diff"] <= 1e-5
    shape = result["shapes"]["debug"]
    rows = [(r["precision"], r["compiled"]) for r in shape["train"]]
    assert rows == [("bf16", False), ("bf16", "eager"), ("fp32", False)]
    for row in shape["train"]:
        assert row["tokens_per_s"] > 0 and row["flops_per_step"] > 1e6
        assert math.isfinite(row["loss_first"]) and math.isfinite(row["loss_last"])
    # the compiled step is the same arithmetic: the same FLOPs and the same first loss
    assert shape["train"][1]["flops_per_step"] == shape["train"][0]["flops_per_step"]
    assert shape["train"][1]["loss_first"] == shape["train"][0]["loss_first"]
    assert all(v["kv_cache_tokens_per_s"] > 0 for v in shape["eval"].values())
    # no CUDA graph on a CPU; compiled with dynamo alone
    assert set(result["generate_tokens_per_s"]) == {"fp32", "bf16", "fp32_compiled",
                                                    "bf16_compiled"}  # fmt: skip
    assert result["shapes"]["debug"]["train"][1]["graphs_compiled"] == 2  # without, with memory
    assert result["generate_parity_max_abs_logprob_diff_vs_cpu"] == 0.0
    for what in ("train_step_bf16", "decode_token_fp32_eager"):
        assert result["profile"][what]["count"] > 10 and result["profile"][what]["top"]
    attention = result["attention"]
    assert {(r["attn_impl"], r["padded_heads"]) for r in attention["candidates"]} == {
        ("sdpa", False),
        ("sdpa", True),
        ("math", False),
        ("math", True),
    }
    assert attention["train_winner"] in [
        {"attn_impl": r["attn_impl"], "padded_heads": r["padded_heads"]}
        for r in attention["candidates"]
    ]
    assert result["txlm_generate_cli"]["eager"]["tokens_per_s"] > 0
    # the padded model's correctness section, and the profile's time by kernel class
    assert result["aligned_parity"]["max_grad_diff"] < 1e-4
    classes = result["profile"]["train_step_bf16"]["by_class_ms"]
    assert set(classes) == {"gemm", "attention", "copies_and_casts", "elementwise", "optimizer"}
    assert classes["gemm"] > 0 and classes["optimizer"] > 0


def test_gpu_check_records_a_failing_section_and_goes_on(tmp_path, monkeypatch):
    """A section that raises (a device failure) is recorded; the later sections still run
    and the JSON is written; the exit code says something failed."""

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_check, "evaluate", broken)
    out = tmp_path / "gpu.json"
    # the failing section and one after it (every section: test_gpu_check_script_runs_on_the_cpu)
    argv = ["--device", "cpu", "--quick", "--only", "debug eval", "decode fp32", "--out", str(out)]
    assert gpu_check.main(argv) == 1
    result = json.loads(out.read_text())
    assert result["errors"]["debug eval"].startswith("RuntimeError: CUDA error")
    assert "eval" not in result["shapes"]["debug"]
    assert result["generate_tokens_per_s"]["fp32"] > 0  # a later section


def test_gpu_check_targets_read_the_measured_figures():
    wt103 = {
        "train": [{"precision": "bf16", "tokens_per_s": 310_000.0, "mfu": 0.12}],
        "eval": {"bf16_mem600": {"tokens_per_s": 1.0, "kv_cache_tokens_per_s": 170_000.0}},
    }
    result = {
        "shapes": {"wt103-base": wt103},
        "generate_tokens_per_s": {"fp32": 900.0, "bf16_cuda_graph": 3100.0},
        "parity_max_abs_logprob_diff_vs_cpu": 2e-4,
    }
    got = {t["target"]: (t["measured"], t["met"]) for t in gpu_check.targets(result)}
    assert got["wt103-base training bf16, tokens/s"] == (310_000.0, True)
    assert got["wt103-base training bf16, MFU"] == (0.12, False)
    assert got["enwik8-base training bf16, MFU"] == (None, None)
    assert got["decoding, batch 1, mem 512, wt103-base, tokens/s"] == (3100.0, True)
    assert got["eval 4x memory wt103-base bf16, tokens/s (2x of 83k)"] == (170_000.0, True)
    assert got["fp32 parity with the CPU, max |log p| diff"] == (2e-4, False)


def test_gpu_check_synthetic_stream_is_zipfian_over_the_whole_vocabulary():
    """wt103's vocabulary and cutoffs: each cluster gets its Zipfian share of the tokens
    (the tail clusters ~ 25% together), half the tokens repeat the one before, and the
    stream is a function of its seed."""
    vocab, cutoffs = 267_735, [20_000, 40_000, 200_000]
    ids = gpu_check.synthetic_stream(vocab, 4, 20_000, seed=0)
    assert ids.shape == (4, 20_000) and int(ids.min()) >= 0 and int(ids.max()) < vocab
    assert torch.equal(ids, gpu_check.synthetic_stream(vocab, 4, 20_000, seed=0))
    harmonic = torch.cumsum(1.0 / torch.arange(1, vocab + 1, dtype=torch.float64), 0)
    ends = [0, *cutoffs, vocab]
    for lo, hi in itertools.pairwise(ends):
        want = float((harmonic[hi - 1] - (harmonic[lo - 1] if lo else 0)) / harmonic[-1])
        got = float(((ids >= lo) & (ids < hi)).double().mean())
        assert abs(got - want) < 0.02, (lo, hi, got, want)
    repeats = float((ids[:, 1:] == ids[:, :-1]).double().mean())
    assert 0.48 < repeats < 0.53
