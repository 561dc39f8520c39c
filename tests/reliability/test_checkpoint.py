"""Hostile and broken checkpoints given to ``txlm.checkpoints.checkpoint.load``.

Every case starts from a good checkpoint of the debug model, breaks one thing, and asserts a
``CheckpointError`` whose message names the problem (and the file), never another exception
type, never a partially loaded model, and never code run from the file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import txlm
from tests.helpers.reliability import evil_os_system_pickle, evil_pickle, evil_torch_zip, snapshot
from txlm import atomic
from txlm.checkpoints.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    load,
    read_config,
    resolve,
    save,
)
from txlm.config import ModelConfig
from txlm.errors import CheckpointError
from txlm.model import TransformerXL


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig.from_preset("debug"))
    return save(model, tmp_path_factory.mktemp("good") / "ckpt")


@pytest.fixture
def ckpt(good: Path, tmp_path: Path) -> Path:
    """A fresh copy of the good checkpoint to break."""
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in good.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _config(ckpt: Path) -> dict:
    return json.loads((ckpt / CONFIG_FILE).read_text())


def _set_model_key(ckpt: Path, key: str, value) -> None:
    data = _config(ckpt)
    data["model"][key] = value
    (ckpt / CONFIG_FILE).write_text(json.dumps(data))


def _expect(ckpt: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load(ckpt)
    msg = str(info.value)
    assert "\n" not in msg, msg  # the CLI prints it as one line
    # Needles are matched without the temp path, whose folder name is the test's name.
    bare = msg.replace(str(ckpt.parent), "<tmp>")
    for needle in needles:
        assert needle.lower() in bare.lower(), msg
    return msg


def test_good_checkpoint_loads(good: Path) -> None:
    model = load(good)
    assert not model.training
    assert model.config == ModelConfig.from_preset("debug")


# -- the directory itself --------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    _expect(tmp_path / "nope", "does not exist")


def test_path_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "ckpt"
    f.write_text("hello")
    _expect(f, "not a checkpoint directory")


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    _expect(tmp_path / "ckpt", CONFIG_FILE)


def test_missing_weights(ckpt: Path) -> None:
    (ckpt / WEIGHTS_FILE).unlink()
    _expect(ckpt, WEIGHTS_FILE)


def test_weights_is_a_directory(ckpt: Path) -> None:
    (ckpt / WEIGHTS_FILE).unlink()
    (ckpt / WEIGHTS_FILE).mkdir()
    _expect(ckpt, WEIGHTS_FILE)


# -- model.safetensors -----------------------------------------------------------------------


def test_zero_byte_weights(ckpt: Path) -> None:
    (ckpt / WEIGHTS_FILE).write_bytes(b"")
    _expect(ckpt, WEIGHTS_FILE)


@pytest.mark.parametrize("fraction", [0.0001, 0.5, 0.999])
def test_truncated_weights(ckpt: Path, fraction: float) -> None:
    data = (ckpt / WEIGHTS_FILE).read_bytes()
    (ckpt / WEIGHTS_FILE).write_bytes(data[: max(1, int(len(data) * fraction))])
    _expect(ckpt, WEIGHTS_FILE)


def test_random_bytes_weights(ckpt: Path) -> None:
    (ckpt / WEIGHTS_FILE).write_bytes(torch.randint(0, 256, (5000,), dtype=torch.uint8).numpy())
    _expect(ckpt, WEIGHTS_FILE)


def test_header_claims_huge_length(ckpt: Path) -> None:
    # The 8-byte little-endian header length is the first thing a reader trusts.
    body = (ckpt / WEIGHTS_FILE).read_bytes()
    (ckpt / WEIGHTS_FILE).write_bytes(struct.pack("<Q", 2**62) + body[8:])
    _expect(ckpt, WEIGHTS_FILE)


def test_header_is_not_json(ckpt: Path) -> None:
    header = b"{not json at all" + b" " * 16
    (ckpt / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    _expect(ckpt, WEIGHTS_FILE)


def test_tensor_offsets_past_end(ckpt: Path) -> None:
    header = json.dumps(
        {"u": {"dtype": "F32", "shape": [2, 16], "data_offsets": [0, 10**9]}}
    ).encode()
    (ckpt / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 128)
    _expect(ckpt, WEIGHTS_FILE)


def test_weights_for_another_shape(ckpt: Path) -> None:
    other = TransformerXL(ModelConfig.from_preset("debug", d_model=48, d_head=24))
    other_dir = save(other, ckpt.parent / "other")
    (ckpt / WEIGHTS_FILE).write_bytes((other_dir / WEIGHTS_FILE).read_bytes())
    _expect(ckpt, WEIGHTS_FILE)


def test_weights_missing_a_layer(ckpt: Path) -> None:
    other = TransformerXL(ModelConfig.from_preset("debug", n_layer=1))
    other_dir = save(other, ckpt.parent / "other")
    (ckpt / WEIGHTS_FILE).write_bytes((other_dir / WEIGHTS_FILE).read_bytes())
    _expect(ckpt, WEIGHTS_FILE, "holds 1 layers", "n_layer=2")


def test_weights_missing_a_tensor(ckpt: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt / WEIGHTS_FILE))
    del tensors["layers.1.ff.fc2.bias"]
    save_file(tensors, str(ckpt / WEIGHTS_FILE))
    msg = _expect(ckpt, WEIGHTS_FILE, "1 missing")
    assert "layers.1.ff.fc2.bias" in msg


def test_weights_with_extra_tensor(ckpt: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt / WEIGHTS_FILE))
    tensors["backdoor"] = torch.zeros(3)
    save_file(tensors, str(ckpt / WEIGHTS_FILE))
    _expect(ckpt, WEIGHTS_FILE, "unexpected")


def test_config_vocab_mismatch_with_weights(ckpt: Path) -> None:
    _set_model_key(ckpt, "vocab_size", 65)
    _expect(ckpt, WEIGHTS_FILE)


def test_config_much_larger_than_weights_fails_before_allocating(ckpt: Path) -> None:
    # A config that claims a huge model next to small weights must be refused from the
    # weights' header, not after allocating the claimed model (here ~64 GB of embeddings).
    _set_model_key(ckpt, "vocab_size", 2**31 // 8)
    _set_model_key(ckpt, "d_model", 64)
    _set_model_key(ckpt, "d_embed", 64)
    _expect(ckpt, WEIGHTS_FILE)


# -- config.json -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"\xff\xfe\x00garbage\x80", b"[1, 2, 3]", b"null", b'"txlm"', b"NaN"],
    ids=["empty", "truncated", "binary", "list", "null", "string", "nan"],
)
def test_config_not_an_object(ckpt: Path, content: bytes) -> None:
    (ckpt / CONFIG_FILE).write_bytes(content)
    _expect(ckpt, CONFIG_FILE)


def test_foreign_hf_config(ckpt: Path) -> None:
    (ckpt / CONFIG_FILE).write_text(
        json.dumps({"model_type": "transfo-xl", "d_model": 32, "n_layer": 2})
    )
    _expect(ckpt, "not a txlm checkpoint", "convert")


def test_future_format_version(ckpt: Path) -> None:
    data = _config(ckpt)
    data["format_version"] = 99
    (ckpt / CONFIG_FILE).write_text(json.dumps(data))
    _expect(ckpt, "version")


def test_model_section_missing(ckpt: Path) -> None:
    data = _config(ckpt)
    del data["model"]
    (ckpt / CONFIG_FILE).write_text(json.dumps(data))
    _expect(ckpt, CONFIG_FILE)


def test_model_section_not_an_object(ckpt: Path) -> None:
    data = _config(ckpt)
    data["model"] = [1, 2]
    (ckpt / CONFIG_FILE).write_text(json.dumps(data))
    _expect(ckpt, CONFIG_FILE)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("n_layer", "2"),
        ("n_layer", 2.0),
        ("n_layer", True),
        ("n_layer", None),
        ("n_layer", 0),
        ("n_layer", -3),
        ("d_model", [32]),
        ("vocab_size", 0),
        ("mem_len", -1),
        ("tgt_len", 0),
        ("dropout", "0.1"),
        ("dropout", 1.5),
        ("dropout", float("nan")),
        ("same_length", 1),
        ("same_length", "true"),
        ("cutoffs", "20,40"),
        ("cutoffs", [1.5]),
        ("cutoffs", [70]),
        ("tie_projs", 5),
        ("tie_projs", [True, True]),
        ("d_embed", 3.5),
        ("attn_type", "rnn"),
        ("attn_type", ["xl"]),
        ("attn_impl", {"x": 1}),
        ("layer_norm_eps", "tiny"),
        ("layer_norm_eps", float("nan")),
        ("layer_norm_eps", -1.0),
        ("init_std", float("inf")),
        ("div_val", 0),
    ],
)
def test_config_wrong_types(ckpt: Path, key: str, value) -> None:
    _set_model_key(ckpt, key, value)
    msg = _expect(ckpt, CONFIG_FILE)
    assert key in msg, msg


def test_config_unknown_key(ckpt: Path) -> None:
    _set_model_key(ckpt, "n_layers", 2)
    _expect(ckpt, "unknown", "n_layers")


def test_config_missing_vocab_size(ckpt: Path) -> None:
    data = _config(ckpt)
    del data["model"]["vocab_size"]
    (ckpt / CONFIG_FILE).write_text(json.dumps(data))
    _expect(ckpt, "vocab_size")


def test_read_config_rejects_foreign(tmp_path: Path) -> None:
    d = tmp_path / "c"
    d.mkdir()
    (d / CONFIG_FILE).write_text("{}")
    with pytest.raises(CheckpointError, match="not a txlm checkpoint"):
        read_config(d)


# -- pickles: never executed -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pickle2", "pickle5", "os_system", "torch_zip", "torch_save"])
def test_pickle_as_weights_is_refused_and_not_run(ckpt: Path, tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "pwned"
    if kind == "pickle2":
        payload = evil_pickle(marker, protocol=2)
    elif kind == "pickle5":
        payload = evil_pickle(marker, protocol=5)
    elif kind == "os_system":
        payload = evil_os_system_pickle(marker)
    elif kind == "torch_zip":
        payload = evil_torch_zip(marker)
    else:  # a plain (benign) torch.save state dict: still not our format
        import io

        buf = io.BytesIO()
        torch.save(TransformerXL(ModelConfig.from_preset("debug")).state_dict(), buf)
        payload = buf.getvalue()
    (ckpt / WEIGHTS_FILE).write_bytes(payload)
    _expect(ckpt, WEIGHTS_FILE)
    assert not marker.exists(), "loading the checkpoint ran code from a pickle"


def test_pickled_config_is_refused_and_not_run(ckpt: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (ckpt / CONFIG_FILE).write_bytes(evil_pickle(marker))
    _expect(ckpt, CONFIG_FILE)
    assert not marker.exists()


def test_pickle_beside_checkpoint_is_ignored(ckpt: Path, tmp_path: Path) -> None:
    """Files a txlm checkpoint does not name (e.g. a planted pytorch_model.bin) are never read."""
    marker = tmp_path / "pwned"
    (ckpt / "pytorch_model.bin").write_bytes(evil_torch_zip(marker))
    (ckpt / "vocab.bin").write_bytes(evil_pickle(marker))
    load(ckpt)
    assert not marker.exists()


def test_no_pickle_module_used_by_load(ckpt: Path, monkeypatch) -> None:
    """Loading a good checkpoint never touches pickle or torch.load at all."""
    import pickle

    def boom(*a, **k):
        raise AssertionError("pickle used while loading a txlm checkpoint")

    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    monkeypatch.setattr(torch, "load", boom)
    load(ckpt)


# -- atomic writes: a failed save never replaces a good checkpoint ---------------------------


def test_failed_save_keeps_old_checkpoint(ckpt: Path) -> None:
    before = snapshot(ckpt.parent)
    model = TransformerXL(ModelConfig.from_preset("debug"))

    def fail(tmp: Path) -> None:
        (tmp / "half").write_bytes(b"x" * 100)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        save(model, ckpt, extra_files=fail)
    assert snapshot(ckpt.parent) == before  # no temp dir left, old files untouched
    load(ckpt)


def test_save_to_full_disk_keeps_old_checkpoint(ckpt: Path, monkeypatch) -> None:
    """The weights write itself fails with ENOSPC (simulated: we cannot fill a real disk)."""
    import txlm.checkpoints.files as ck

    before = snapshot(ckpt.parent)

    def enospc(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "save_model", enospc)
    with pytest.raises(OSError, match="No space"):
        save(TransformerXL(ModelConfig.from_preset("debug")), ckpt)
    assert snapshot(ckpt.parent) == before
    load(ckpt)


def test_interrupted_swap_falls_back_to_old(good: Path, tmp_path: Path) -> None:
    """A crash between 'rename old aside' and 'rename new in' leaves NAME.old: it loads."""
    target = tmp_path / "best"
    old = tmp_path / "best.old"
    old.mkdir()
    for f in good.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    assert txlm.load(target).config == ModelConfig.from_preset("debug")


def test_atomic_directory_over_file_parent_fails_cleanly(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError), atomic.directory(blocker / "ckpt"):
        pass
    assert blocker.read_text() == "x"


# -- SIGKILL at every stage of two writes (the fault seam, txlm.atomic) ------------------------

STAGES = ["made", "file:a", "file:b", "swap", "between", "placed"]


def _write_version(version: str) -> Callable[[Path], None]:
    def fill(tmp: Path) -> None:
        (tmp / "a").write_text(version)
        (tmp / "b").write_text(version)

    return fill


def _write(target: Path, version: str) -> None:
    with atomic.directory(target) as tmp:
        _write_version(version)(tmp)


def _complete_version(target: Path) -> str:
    """The version a reader finds through resolve(); it must be whole (a and b agree)."""
    d = resolve(target)
    a, b = (d / "a").read_text(), (d / "b").read_text()
    assert a == b, f"half-written checkpoint at {d}: {a!r} vs {b!r}"
    return a


def _killed_at(target: Path, version: str, stage: str) -> bool:
    """Write ``version`` in a forked child told by TXLM_FAULT to SIGKILL itself at ``stage``.
    True: it died by SIGKILL; False: the write never reached that stage and completed."""
    pid = os.fork()
    if pid == 0:  # the child does no torch work: forking here is safe
        code = 1
        try:
            os.environ["TXLM_FAULT"] = f"{target.name}:{stage}:kill"
            _write(target, version)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    assert rc in (0, -signal.SIGKILL), rc
    return rc == -signal.SIGKILL


def _entries(folder: Path) -> list[str]:
    """The folder's names, temp folders shown as TEMP."""
    return sorted("TEMP" if p.name.endswith(".tmp") else p.name for p in folder.iterdir())


def _after_kill(before: list[str], stage: str) -> list[str]:
    """What a kill at ``stage`` of a write of ``last`` leaves, from the names ``before``."""
    whole = [n for n in before if n != "TEMP"]  # a dead writer's temp is removed first
    if stage in ("made", "file:a", "file:b", "swap"):
        return sorted([*whole, "TEMP"])
    if stage == "between":
        return ["TEMP", "last.old"]
    return sorted({"last", *(["last.old"] if "last" in whole or "last.old" in whole else [])})


@pytest.mark.parametrize("start", ["complete", "after-crashed-swap"])
def test_sigkill_at_every_stage_of_two_writes(tmp_path: Path, start: str) -> None:
    """SIGKILL at each stage of a write, then at each stage of the next write: the process
    dies exactly there (what it leaves is that stage's), and resolve() always finds a whole
    checkpoint: the old one until the new one is renamed in, then the new one."""
    cases = 0
    for s1 in STAGES:
        case = tmp_path / s1.replace(":", "-")
        target = case / "last"
        if start == "complete":
            _write(target, "v1")
        else:  # the state a crash between the two renames leaves: only last.old
            _write(case / "last.old", "v1")
        before = _entries(case)
        reachable = s1 != "between" or target.exists()  # no old copy: one rename only
        assert _killed_at(target, "v2", s1) == reachable, s1
        if not reachable:
            continue
        assert _entries(case) == _after_kill(before, s1), s1
        v1 = "v2" if s1 == "placed" else "v1"
        assert _complete_version(target) == v1
        for s2 in STAGES:
            sub = tmp_path / f"{case.name}-{s2.replace(':', '-')}"
            shutil.copytree(case, sub, symlinks=True)
            before = _entries(sub)
            reachable = s2 != "between" or (sub / "last").exists()
            assert _killed_at(sub / "last", "v3", s2) == reachable, (s1, s2)
            if reachable:
                assert _entries(sub) == _after_kill(before, s2), (s1, s2)
            placed = s2 == "placed" or not reachable
            assert _complete_version(sub / "last") == ("v3" if placed else v1), (s1, s2)
            cases += 1
        # A later write that is not interrupted cleans up: one dir, no temp dirs left behind.
        _write(target, "v4")
        assert _complete_version(target) == "v4"
        assert _entries(case) == ["last"]
    assert cases >= 25


def test_interrupt_between_the_renames_puts_the_old_copy_back(tmp_path: Path) -> None:
    """An exception (a second Ctrl-C) between the renames undoes the write: `last` is back."""
    target = tmp_path / "last"
    _write(target, "v1")
    real = os.rename
    calls = []

    def rename(src, dst):
        real(src, dst)
        calls.append(dst)
        if len(calls) == 1:  # the old copy has just been moved aside
            raise KeyboardInterrupt

    import txlm.atomic as at

    at.os.rename = rename  # type: ignore[attr-defined]
    try:
        with pytest.raises(KeyboardInterrupt):
            _write(target, "v2")
    finally:
        at.os.rename = real  # type: ignore[attr-defined]
    assert _entries(tmp_path) == ["last"] and _complete_version(target) == "v1"


# -- writability checked before work starts --------------------------------------------------


def test_ensure_writable_creates_and_probes(tmp_path: Path) -> None:
    from txlm.checkpoints.checkpoint import ensure_writable

    out = ensure_writable(tmp_path / "a" / "b", need_bytes=1)
    assert out.is_dir() and list(out.iterdir()) == []  # the probe is gone


@pytest.mark.parametrize("where", ["under-a-file", "read-only-fs"])
def test_ensure_writable_refuses_unwritable(tmp_path: Path, where: str) -> None:
    from txlm.checkpoints.checkpoint import ensure_writable

    if where == "under-a-file":
        (tmp_path / "blocker").write_text("x")
        target = tmp_path / "blocker" / "run"
    else:
        target = Path("/proc/txlm-run")  # procfs: no directories can be made there
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="cannot write checkpoints") as info:
        ensure_writable(target)
    assert str(target) in str(info.value) and "\n" not in str(info.value)
    assert snapshot(tmp_path) == before


def test_ensure_writable_refuses_full_disk(tmp_path: Path, monkeypatch) -> None:
    import txlm.checkpoints.files as ck

    class Usage:
        total, used, free = 10**9, 10**9 - 1000, 1000

    monkeypatch.setattr(ck.shutil, "disk_usage", lambda path: Usage)
    model = TransformerXL(ModelConfig.from_preset("debug"))
    need = 2 * ck.estimate_checkpoint_bytes(model)
    assert need > 3 * 4 * 20_000  # weights + two Adam moments of ~20k fp32 parameters
    with pytest.raises(CheckpointError, match="MiB free"):
        ck.ensure_writable(tmp_path / "run", need_bytes=need)
    assert not (tmp_path / "run").exists()  # created for the probe, removed again


def test_train_refuses_full_disk_before_the_first_step(tmp_path: Path, monkeypatch) -> None:
    import txlm.checkpoints.files as ck
    from txlm.training import Trainer
    from txlm.training.config import resolve as resolve_config

    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)

    class Usage:
        total, used, free = 10**9, 10**9 - 1000, 1000

    config = resolve_config(
        "debug",
        [],
        [
            f"data.dataset=text:{tmp_path / 'corpus.txt'}",
            f"data.data_dir={tmp_path / 'data'}",
            "optim.max_steps=1",
            "eval.eval_interval=0",
            "eval.final_eval=false",
            "run.tensorboard=false",
            "run.progress=false",
        ],
    )
    trainer = Trainer(config, tmp_path / "run", echo=False)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda path: Usage)
    steps = []
    real = trainer.train_step
    trainer.train_step = lambda: steps.append(1) or real()
    with pytest.raises(CheckpointError, match="free"):
        trainer.fit()
    assert steps == []


@pytest.mark.parametrize("kind", ["pickle", "os_system", "torch_zip"])
def test_the_crafted_payloads_are_live(tmp_path: Path, kind: str) -> None:
    """Loaded unsafely, each payload does create its file: the refusals above are meaningful."""
    import io
    import pickle

    marker = tmp_path / "pwned"
    if kind == "pickle":
        pickle.loads(evil_pickle(marker))
    elif kind == "os_system":
        pickle.loads(evil_os_system_pickle(marker))
    else:
        torch.load(io.BytesIO(evil_torch_zip(marker)), weights_only=False)
    assert marker.exists()


def test_config_claiming_a_million_layers_is_refused_from_the_header(ckpt: Path) -> None:
    _set_model_key(ckpt, "n_layer", 1_000_000)
    _expect(ckpt, WEIGHTS_FILE, "n_layer=1000000")
