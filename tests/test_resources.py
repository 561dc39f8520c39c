"""Memory checks before allocation (txlm.resources): the estimates are lower bounds of what
the model, Adam, one training step, the memory and the KV cache really hold; a size above
what the device can give is refused in one line naming the option; an allocation that fails
anyway is one line and exit 2 at the CLI, with nothing on disk changed."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.env import subprocess_env
from tests.helpers.reliability import snapshot
from tests.helpers.train import FAST, REPO, tiny_text, txlm
from txlm import resources
from txlm.config import ModelConfig
from txlm.model import TransformerXL

CONFIGS = {
    "debug": ModelConfig.from_preset("debug"),
    "adaptive": ModelConfig.from_preset(
        "debug", vocab_size=1000, cutoffs=[100, 500], div_val=2, d_embed=32
    ),
    "untied": ModelConfig.from_preset(
        "debug", vocab_size=300, cutoffs=[50], tie_weight=False, d_embed=16
    ),
    "shaw": ModelConfig.from_preset("debug", attn_type="shaw", pre_lnorm=True),
}


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("name", CONFIGS)
def test_model_and_optimizer_estimates_are_lower_bounds(name: str) -> None:
    c = CONFIGS[name]
    torch.manual_seed(0)
    model = TransformerXL(c)
    assert resources.parameter_count(c) <= model.num_parameters()
    # one real step: weights, gradients and Adam's two moments as they are held
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, c.vocab_size, (2, c.tgt_len))
    model(ids, labels=ids).loss.backward()
    opt.step()
    params = list(model.parameters())
    held = _bytes(params)
    held += _bytes(p.grad for p in params)
    held += _bytes(t for s in opt.state.values() for t in s.values() if t.dim() > 0)
    needs = {n.what: n.nbytes for n in resources.training_needs(c, rows=2, chunks=1,
                                                                precision="fp32")}  # fmt: skip
    estimate = needs["the model's weights"] + needs["gradients and Adam's moments"]
    assert 0 < estimate <= held


@pytest.mark.parametrize("name", CONFIGS)
def test_activation_estimate_is_below_what_backward_keeps(name: str) -> None:
    """What autograd saves for backward in one training forward (every saved tensor's
    storage, counted once) is at least the estimate."""
    c = CONFIGS[name]
    torch.manual_seed(0)
    model = TransformerXL(c).train()
    rows = 3
    ids = torch.randint(0, c.vocab_size, (rows, c.tgt_len))
    mems = model(ids).mems  # a full memory, as every step after the first has
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, mems=mems, labels=ids).loss.backward()
    estimate = resources.activation_bytes(c, rows, c.tgt_len, "fp32", train=True)
    assert 0 < estimate <= sum(saved.values())
    assert resources.memory_bytes(c, rows, c.mem_len, "fp32") <= _bytes(mems)


def test_kv_cache_estimate_is_what_the_cache_allocates() -> None:
    c = CONFIGS["debug"]
    model = TransformerXL(c)
    cache = model.new_cache(5, 1)
    assert resources.kv_cache_bytes(c, 5, c.mem_len + 1, "fp32") <= cache.kv.nbytes
    assert resources.kv_cache_bytes(c, 5, c.mem_len + 1, "fp32") == cache.kv.nbytes


def test_a_size_that_cannot_fit_is_refused_naming_the_option() -> None:
    c = CONFIGS["debug"]
    cpu = torch.device("cpu")
    room = resources.available_bytes(cpu)
    assert room > 0
    resources.check_generation(c, cpu, weights=0, rows=2, samples=2, mem_len=16,
                               precision="fp32", cache=True)  # fmt: skip
    mem_len = 4 * room // resources.kv_cache_bytes(c, 1, 1, "fp32")  # 4x what is there
    with pytest.raises(resources.ResourceError) as err:
        resources.check_generation(c, cpu, weights=0, rows=1, samples=1, mem_len=mem_len,
                                   precision="fp32", cache=True)  # fmt: skip
    message = str(err.value)
    assert "\n" not in message
    assert "KV cache" in message and f"--mem-len ({mem_len})" in message
    with pytest.raises(resources.ResourceError, match=r"--num-samples \(10000000000\)"):
        resources.check_generation(c, cpu, weights=0, rows=10**10, samples=10**10,
                                   mem_len=16, precision="fp32", cache=True)  # fmt: skip


def test_the_training_check_counts_the_activations_of_one_accumulation_chunk(
    monkeypatch,
) -> None:
    """Gradient accumulation splits a step's rows into chunks, and only one chunk's
    activations live at a time: a batch refused at grad_accum 1 for its activations, the
    refusal advising to raise grad_accum, is accepted at 4."""
    from txlm.training.config import resolve

    def train(accum: int):
        sets = ["data.batch_size=64", "model.tgt_len=512", f"optim.grad_accum={accum}"]
        config = resolve("debug", None, sets)
        return config, config.model_config(64)

    (one, c), (four, _) = train(1), train(4)
    need = {a: sum(n.nbytes for n in resources.training_needs(c, rows=64, chunks=a,
                                                              precision="fp32"))
            for a in (1, 4)}  # fmt: skip
    assert need[4] < need[1] / 2  # the activations are most of it
    room = (need[1] + need[4]) // 2
    monkeypatch.setattr(resources, "available_bytes", lambda device: room)
    cpu = torch.device("cpu")
    with pytest.raises(resources.ResourceError) as err:
        resources.check_training(c, cpu, one, world_size=1)
    message = str(err.value)
    assert "the activations of one step" in message and "raise optim.grad_accum" in message
    resources.check_training(c, cpu, four, world_size=1)  # a quarter of them: it fits


def test_out_of_memory_errors_become_one_line() -> None:
    cpu_error = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 3221225472 bytes. Error code 12"
    )
    for exc in (cpu_error, MemoryError(), torch.OutOfMemoryError("CUDA out of memory.")):
        message = resources.out_of_memory_message(exc)
        assert message is not None and "\n" not in message
        assert message.startswith("out of memory")
    assert "3.0 GiB" in resources.out_of_memory_message(cpu_error)
    assert resources.out_of_memory_message(RuntimeError("shape mismatch")) is None
    assert resources.out_of_memory_message(ValueError("x")) is None


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    text = tiny_text(root, n_chars=6000)
    args = ["train", "--preset", "debug", "--out", str(root / "run"), "--set", *FAST,
            f"data.dataset=text:{text}", "optim.max_steps=2", "eval.eval_interval=0",
            "eval.final_eval=false"]  # fmt: skip
    r = txlm(args, root)
    assert r.returncode == 0, r.stderr
    return root


LIMIT = 3 * 2**30  # address space of the child: far below what the machine has


@pytest.mark.parametrize(
    "argv",
    [
        # caches of ~3.8 GiB: under the machine's memory (the check passes), over the limit
        # (the prompt is read once: the samples' cache of mem_len + 1 slots is the large one)
        ["generate", "run/best", "--prompt", "The", "--num-samples", "4000", "--mem-len",
         "2000", "--max-new-tokens", "2", "--seed", "0"],
        ["eval", "run/best", "--kv-cache", "--mem-len", "3000000", "--batch-size", "2"],
    ],
    ids=["generate", "eval"],
)  # fmt: skip
def test_an_allocation_that_fails_anyway_is_one_line(argv, trained: Path) -> None:
    """An out-of-memory error the lower bound let through (here an address-space limit the
    estimate does not know) ends as one line, exit 2, no traceback, nothing changed."""
    if resources.available_bytes(torch.device("cpu")) < 2 * LIMIT:
        pytest.skip("the machine has too little free memory for the check to pass first")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))

    before = snapshot(trained)
    proc = subprocess.run(
        [sys.executable, "-m", "txlm", *argv, "--threads", "1"],
        cwd=trained, env=subprocess_env(trained), preexec_fn=limit, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("txlm: error: out of memory"), lines
    assert snapshot(trained) == before


def test_a_used_out_is_replaced_only_with_overwrite(tmp_path: Path, runner) -> None:
    text = tiny_text(tmp_path, n_chars=6000)
    out = tmp_path / "run"
    base = ["train", "--preset", "debug", "--out", str(out), "--set", *FAST,
            f"data.dataset=text:{text}", "eval.eval_interval=0",
            "eval.final_eval=false"]  # fmt: skip

    def train(*argv: str) -> tuple[int, str, str]:  # a forked `python -m txlm train`
        return runner.run(["train", *argv], tmp_path, tmp_path / "io",
                          {"TXLM_DATA_DIR": str(tmp_path)})  # fmt: skip

    assert train(*base[1:], "optim.max_steps=3")[0] == 0
    first = snapshot(out)
    rc, _, err = train(*base[1:], "optim.max_steps=1")
    assert rc == 2 and "--overwrite" in err
    assert snapshot(out) == first
    # resuming the run in its own folder is what --out DIR with DIR/last is for
    rc, _, err = train("--resume", str(out / "last"), "--set", "optim.max_steps=4")
    assert rc == 0, err
    rc, stdout, err = train(*base[1:], "optim.max_steps=1", "--overwrite")
    assert rc == 0, err
    assert "--overwrite: removed the run" in stdout
    steps = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert len(steps) == 1  # the old run's records went with it


def test_a_run_killed_between_the_renames_still_counts_as_a_used_out(tmp_path: Path) -> None:
    """A kill between a checkpoint's two renames leaves only ``last.old``: the folder still
    holds a run, and a fresh run into it is refused (its first save would delete that copy)."""
    from txlm.commands.train import used_by_another_run

    out = tmp_path / "run"
    (out / "last.old").mkdir(parents=True)
    assert used_by_another_run(out, None) == ["last"]
    assert used_by_another_run(tmp_path / "empty", None) == []


def test_benchmarks_write_to_a_scratch_folder_by_default(tmp_path: Path) -> None:
    """Run as the README shows (no --out), a benchmark leaves benchmarks/results/ alone."""
    results = REPO / "benchmarks" / "results"
    before = snapshot(results)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "memory_growth.py"), "--engines", "score",
         "--segments", "120", "--warmup", "100", "--sample-every", "100"],
        cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "runs" / "bench" / "memory_growth.json").is_file()
    assert snapshot(results) == before


def test_a_bpe_size_above_what_the_text_gives_learns_the_same_vocabulary(monkeypatch) -> None:
    """The size handed to the tokenizer library is capped at what the text can give; the
    vocabulary is the one an uncapped size learns (the library stops when no pair repeats)."""
    from tests.helpers.reliability import corpus_text
    from txlm.data import bpe

    texts = [corpus_text(80), "héllo wörld, ünïcode naïve café " * 20]
    capped = bpe.train_bpe(texts, 10**6)
    monkeypatch.setattr(bpe, "_learnable", lambda vocab_size, chars: vocab_size)
    uncapped = bpe.train_bpe(texts, 10**6)
    assert len(capped) == len(uncapped) < 10**6
    assert capped.fingerprint == uncapped.fingerprint
    with pytest.raises(bpe.DataError, match="--vocab-size"):
        bpe.check_vocab_size(10**12)


OOM_AT_STEP_3 = """\
import sys, torch
from txlm.training import loop
step = loop.Trainer.train_step
def failing(self):
    if self.step == 2:  # the third step: after `last` and `best` were written at step 2
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return step(self)
loop.Trainer.train_step = failing
from txlm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_out_of_memory_in_training_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    """An allocation failure inside a step (planted at step 3) ends as one line, exit 2; the
    checkpoint written at step 2 is whole and the run resumes from it."""
    import json

    from txlm.checkpoints import checkpoint

    (tmp_path / "oom.py").write_text(OOM_AT_STEP_3)
    text = tiny_text(tmp_path, n_chars=6000)
    out = tmp_path / "run"
    args = ["train", "--preset", "debug", "--out", str(out), "--set", *FAST,
            f"data.dataset=text:{text}", "optim.max_steps=4", "eval.eval_interval=2",
            "eval.final_eval=false"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "oom.py"), *args],
        cwd=REPO, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "out of memory allocating 2.0 GiB" in lines[0], lines
    state = json.loads((out / "last" / "trainer_state.json").read_text())
    assert state["step"] == 2
    checkpoint.load(out / "last")  # whole
    assert not [p for p in out.iterdir() if p.name.endswith((".tmp", ".old"))]
    resumed = txlm(["train", "--resume", str(out / "last")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "last" / "trainer_state.json").read_text())["step"] == 4
