"""The restricted unpickler: plain containers in, everything else refused before it runs."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path

import pytest
import torch

from txlm.checkpoints.safe_unpickle import load_pickled_object, restricted_loads
from txlm.errors import CheckpointError


class _Touch:
    """Unpickling this calls os.system (a shell) to create a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _Open:
    """Unpickling this calls open(path, "w"): a file appears without any shell."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


PLAIN = {
    "idx2sym": ["<eos>", "the", "é"],
    "sym2idx": OrderedDict([("<eos>", 0), ("the", 1), ("é", 2)]),
    "counter": Counter({"the": 5, "é": 1}),
    "special": ["<eos>"],
    "flags": (True, False, None, 1.5, 3, -(2**70)),
    "seen": {"a", "b"},
    "frozen": frozenset({1}),
}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plain_containers_round_trip(protocol: int) -> None:
    assert restricted_loads(pickle.dumps(PLAIN, protocol=protocol)) == PLAIN


@pytest.mark.parametrize("payload_cls", [_Touch, _Open])
def test_malicious_payload_is_refused_and_never_runs(tmp_path: Path, payload_cls) -> None:
    # The payload is live: an unrestricted load really creates its file.
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(payload_cls(live)))
    assert live.exists()

    target = tmp_path / "pwned"
    data = pickle.dumps({"idx2sym": ["a"], "evil": payload_cls(target)})
    with pytest.raises(CheckpointError, match=r"refused to load global (posix|os|builtins|io)\."):
        restricted_loads(data)
    assert not target.exists()


def test_refused_global_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"refused to load global posix\.system"):
        restricted_loads(pickle.dumps(_Touch(tmp_path / "x")))
    # a global that would only be looked up, never called, is refused as well
    with pytest.raises(CheckpointError, match=r"builtins\.eval"):
        restricted_loads(pickle.dumps(eval))
    # a harmless but non-container class (what HF's tokenizer pickles) is refused too
    import re

    with pytest.raises(CheckpointError, match=r"re\._compile"):
        restricted_loads(pickle.dumps(re.compile("x")))


def test_persistent_ids_and_garbage_are_errors() -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError):
        restricted_loads(buf.getvalue()[-200:])
    with pytest.raises(CheckpointError, match="not a readable pickle"):
        restricted_loads(b"definitely not a pickle")


def test_torch_save_layouts(tmp_path: Path) -> None:
    vocab = {"idx2sym": ["<eos>", "a"], "sym2idx": OrderedDict([("<eos>", 0), ("a", 1)])}
    legacy = tmp_path / "legacy.bin"
    torch.save(vocab, legacy, _use_new_zipfile_serialization=False)
    assert load_pickled_object(legacy) == vocab
    modern = tmp_path / "zip.bin"
    torch.save(vocab, modern)
    assert zipfile.is_zipfile(modern)
    assert load_pickled_object(modern) == vocab
    plain = tmp_path / "vocab.pkl"
    plain.write_bytes(pickle.dumps(vocab))
    assert load_pickled_object(plain) == vocab


def test_malicious_payload_inside_torch_zip_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    path = tmp_path / "vocab.bin"
    torch.save({"x": _Open(target)}, path)  # torch.save pickles whatever it is given
    with pytest.raises(CheckpointError, match="refused"):
        load_pickled_object(path)
    assert not target.exists()
