"""Files txlm writes get the modes the user's umask gives any file (0644 and 0755 under the
usual 022), written atomically as ever: checkpoints, prepared corpora, single files."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.models import debug_model
from tests.helpers.train import tiny_text
from txlm import atomic
from txlm.checkpoints.checkpoint import save
from txlm.data.prepare import prepare_dataset


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and of everything under it, by relative path."""
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in sorted(root.rglob("*")):
        out[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return out


def expected(root: Path, file_mode: int, dir_mode: int) -> dict[str, int]:
    return {rel: dir_mode if (root / rel).is_dir() else file_mode for rel in modes(root)}


@pytest.mark.parametrize(
    "mask, file_mode, dir_mode",
    [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)],
)
def test_a_checkpoint_has_the_umasks_modes(tmp_path, mask, file_mode, dir_mode):
    with umask(mask):
        assert atomic.umask() == mask
        out = save(debug_model(), tmp_path / "ckpt")
    got = modes(out)
    assert {"config.json", "model.safetensors"} <= set(got)
    assert got == expected(out, file_mode, dir_mode)


def test_a_prepared_corpus_and_a_single_file_have_the_umasks_modes(tmp_path):
    text = tiny_text(tmp_path, n_chars=3000)
    with umask(0o022):
        out = prepare_dataset(f"text:{text}", tmp_path / "data", progress=False)
        single = atomic.write_text(tmp_path / "notes" / "a.json", "{}")
    got = modes(out)
    assert {"train.bin", "vocab.json", "meta.json"} <= set(got)
    assert got == expected(out, 0o644, 0o755)
    assert stat.S_IMODE(single.stat().st_mode) == 0o644


def test_reading_the_umask_leaves_it_as_it_was():
    with umask(0o027):
        assert atomic.umask() == 0o027
        assert atomic.shared_mode() == 0o640 and atomic.shared_mode(directory=True) == 0o750
        assert os.umask(0o027) == 0o027  # unchanged by the reads above
