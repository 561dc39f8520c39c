"""The bad-input table's shared runner: the cases' type, the assets they break, one check.

Each ``tests/cli/test_bad_<command>.py`` holds one command's cases and runs them through
``run_case``, which builds a working directory from good assets, breaks one thing, runs
``python -m txlm ARGS`` there and asserts ARCHITECTURE.md contract C24:

* exit code 2;
* stderr is exactly one line, ``txlm: error: ...``, naming the problem (a needle per case);
* no traceback;
* nothing on disk changed: sha256 of every file under the working directory (inputs, the
  data dir, any --out) is the same before and after, and no file was created;
* for crafted pickles, the file the pickle would create never appears.

Runs go through ``reliability_cli_runner`` (one warm parent, a forked child per case: the same
code path as ``python -m txlm``, without 1.5 s of start-up per case); a few cases also run as
real ``python -m txlm`` subprocesses to keep the runner honest (``cli/test_bad_table.py``,
which also checks that every subcommand has cases).

Imported as ``tests.helpers.cli_table``; its fixtures are in ``tests/cli/conftest.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.env import subprocess_env
from tests.helpers.hf import save_tiny_hf
from tests.helpers.reliability import (
    Runner,
    corpus_text,
    evil_os_system_pickle,
    evil_pickle,
    evil_torch_zip,
    snapshot,
)

HERE = Path(__file__).resolve().parent
MARKER = "PWNED"  # the file a crafted pickle would create, relative to the working directory

# -- assets built once -----------------------------------------------------------------------

TRAIN_BASE = [
    "train",
    "--preset",
    "debug",
    "--set",
    "data.dataset=text:corpus.txt",
    "data.batch_size=4",
    "eval.eval_interval=0",
    "eval.final_eval=false",
    "eval.sample_tokens=0",
    "run.tensorboard=false",
    "run.progress=false",
    "run.threads=1",
]


def build_assets(root: Path, runner: Runner) -> Path:
    """Good inputs the cases start from: a corpus, its prepared copies, a run, checkpoints."""
    import torch

    from txlm.checkpoints.checkpoint import save
    from txlm.config import ModelConfig
    from txlm.data import load_prepared, prepare_dataset
    from txlm.model import TransformerXL

    (root / "corpus.txt").write_text(corpus_text())
    ds = prepare_dataset(f"text:{root / 'corpus.txt'}", root / "data", progress=False)
    corpus = load_prepared(ds)
    # Another corpus (other symbols: another vocabulary) for the vocab/checkpoint mismatch.
    (root / "other.txt").write_text("0123456789+-*/=\n" * 300)
    prepare_dataset(f"text:{root / 'other.txt'}", root / "data", progress=False)
    # A real (2-step) training run: `run/best` and `run/last` as eval/generate/resume see them.
    rc, _, err = runner.run(
        [*TRAIN_BASE, "optim.max_steps=2", "--out", "run"],
        root,
        root / "io",
        {"TXLM_DATA_DIR": str(root / "data")},
    )
    assert rc == 0, err
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig.from_preset("debug", vocab_size=len(corpus.vocab)))
    save(model, root / "ckpt", vocab_json=corpus.vocab.to_json())
    # A checkpoint with a bpe vocabulary (tokenizer.json travels with it), and another bpe
    # vocabulary's pair of files for the "consistent but foreign tokenizer" case.
    bpe_corpus = load_prepared(
        prepare_dataset(
            f"text:{root / 'corpus.txt'}", root / "data", level="bpe", vocab_size=300,
            progress=False,
        )
    )  # fmt: skip
    bpe_model = TransformerXL(ModelConfig.from_preset("debug", vocab_size=len(bpe_corpus.vocab)))
    extra = {"vocab_fingerprint": bpe_corpus.vocab.fingerprint}
    save(bpe_model, root / "bpe-ckpt", vocab=bpe_corpus.vocab, extra_config=extra)
    other_bpe = load_prepared(
        prepare_dataset(
            f"text:{root / 'other.txt'}", root / "data", level="bpe", vocab_size=300,
            progress=False,
        )
    )  # fmt: skip
    other_bpe.vocab.save(root / "other-bpe" / "vocab.json")

    # A Hugging Face TransfoXL directory for `txlm convert` (pytorch_model.bin: a zip pickle
    # that torch.load(weights_only=True) reads).
    save_tiny_hf(root / "hf", safe=False)
    return root


# -- building cases -------------------------------------------------------------------------------

Setup = Callable[[Path], None]


@dataclass
class Case:
    id: str
    argv: list[str]
    needle: str  # must appear (case-insensitively) in the error line
    setup: Setup | None = None
    uses: tuple[str, ...] = ()  # assets copied into the working directory
    pickle: bool = False  # a crafted pickle is involved: MARKER must never appear

    @property
    def command(self) -> str:
        return self.argv[0]


def write(name: str, data: bytes | str) -> Setup:
    def f(work: Path) -> None:
        p = work / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)

    return f


def edit_json(name: str, change: Callable[[dict], None]) -> Setup:
    def f(work: Path) -> None:
        p = work / name
        data = json.loads(p.read_text())
        change(data)
        p.write_text(json.dumps(data))

    return f


def truncate(name: str, keep: float) -> Setup:
    def f(work: Path) -> None:
        p = work / name
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * keep)])

    return f


def both(*fs: Setup) -> Setup:
    def f(work: Path) -> None:
        for g in fs:
            g(work)

    return f


def hf_model(key: str, value) -> Setup:
    return edit_json("hf/config.json", lambda d: d.__setitem__(key, value))


def txlm_model(key: str, value) -> Setup:
    return edit_json("ckpt/config.json", lambda d: d["model"].__setitem__(key, value))


def swap_ids(vocab: dict, a: str, b: str) -> None:
    """Two tokens trade ids: still a well-formed tokenizer, but not the model's."""
    vocab[a], vocab[b] = vocab[b], vocab[a]


def mkdir(name: str) -> Setup:
    return lambda work: (work / name).mkdir(parents=True)


def dos_vocab() -> bytes:
    # builtins.bytes is on the restricted unpickler's allow-list; bytes(2**62) asks for an
    # exabyte. A vocabulary file must not be able to take the process down.
    return b"\x80\x02c__builtin__\nbytes\n\x8a\x08\x00\x00\x00\x00\x00\x00\x00@\x85R."


EVIL = evil_pickle(Path(MARKER))
EVIL_SYSTEM = evil_os_system_pickle(Path(MARKER))
EVIL_ZIP = evil_torch_zip(Path(MARKER))


# -- running ---------------------------------------------------------------------------------


def prepare_workdir(case: Case, assets: Path, tmp_path: Path) -> tuple[Path, Path]:
    work = tmp_path / "work"
    io_dir = tmp_path / "io"
    work.mkdir()
    io_dir.mkdir()
    for name in case.uses:
        src = assets / name
        if src.is_dir():
            shutil.copytree(src, work / name)
        else:
            shutil.copy2(src, work / name)
    if case.command == "prepare" and not case.id.startswith("prepare-fresh"):
        # The data dir exists, as it does after any earlier prepare: these cases test the
        # refusal itself; "prepare-fresh-*" tests that a refused first prepare leaves none.
        (work / "data").mkdir()
    if case.setup is not None:
        case.setup(work)
    return work, io_dir


def check_result(case: Case, rc: int, out: str, err: str, before: dict, after: dict, work: Path):
    lines = err.splitlines()
    # First, so that no other failure (or a known-defect xfail) can hide executed code.
    assert not (work / MARKER).exists(), f"{case.id}: a crafted pickle ran code"
    assert "Traceback" not in err, f"{case.id}: traceback\n{err}"
    assert rc == 2, f"{case.id}: exit {rc}, expected 2\nstderr: {err}\nstdout: {out}"
    assert len(lines) == 1, f"{case.id}: stderr must be one line, got {len(lines)}:\n{err}"
    assert lines[0].startswith("txlm: error: "), lines[0]
    # The needle is matched without the temp path, whose folder name is the case's id.
    bare = lines[0].replace(str(work.parent), "<tmp>").lower()
    assert case.needle.lower() in bare, f"{case.id}: {case.needle!r} not in {err!r}"
    assert after == before, f"{case.id}: files changed: {set(after) ^ set(before)}"


def run_case(case: Case, assets: Path, runner: Runner, tmp_path: Path) -> None:
    """Run one case through the warm runner and check contract C24."""
    work, io_dir = prepare_workdir(case, assets, tmp_path)
    before = snapshot(work)
    rc, out, err = runner.run(case.argv, work, io_dir, {"TXLM_DATA_DIR": str(work / "data")})
    check_result(case, rc, out, err, before, snapshot(work), work)


def run_case_subprocess(case: Case, assets: Path, tmp_path: Path) -> None:
    """The same case as a real ``python -m txlm`` process."""
    work, _ = prepare_workdir(case, assets, tmp_path)
    before = snapshot(work)
    env = subprocess_env(work / "data")
    proc = subprocess.run(
        [sys.executable, "-m", "txlm", *case.argv],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    check_result(case, proc.returncode, proc.stdout, proc.stderr, before, snapshot(work), work)


def check_pickle_never_runs(case: Case, assets: Path, runner: Runner, tmp_path: Path) -> None:
    """Only the one property: even where a case fails for a known defect (a traceback), the
    crafted file was not executed."""
    work, io_dir = prepare_workdir(case, assets, tmp_path)
    rc, _, err = runner.run(case.argv, work, io_dir, {"TXLM_DATA_DIR": str(work / "data")})
    assert rc != 0, err
    assert not (work / MARKER).exists(), f"{case.id}: a crafted pickle ran code"
