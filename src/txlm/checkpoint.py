"""Checkpoints: a directory of JSON and safetensors files, written atomically. No pickle.

    config.json          the ModelConfig (plus "format": "txlm", a version, and extras)
    model.safetensors    weights (tied tensors stored once)
    vocab.json           the vocabulary, when there is one
    tokenizer.json       a bpe vocabulary's tokenizer (the model's ids mean nothing without it)
    ...                  training adds optimizer.safetensors, trainer_state.json, memory

A checkpoint is written with ``txlm.atomic.directory``: filled in a temp directory beside it
and swapped into place, so at every instant the old or the new checkpoint is whole on disk;
``resolve`` reads ``NAME.old`` after a crash between the two renames of the swap.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model

from txlm import atomic
from txlm.config import ModelConfig
from txlm.data.vocab import Vocab, check_fingerprint
from txlm.errors import CheckpointError, ConfigError, DataError
from txlm.model import TransformerXL, align

FORMAT = "txlm"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
VOCAB_FILE = "vocab.json"
TOKENIZER_FILE = "tokenizer.json"


def estimate_checkpoint_bytes(model: torch.nn.Module, *, optimizer_moments: int = 2) -> int:
    """Bytes a `last` checkpoint of ``model`` takes: weights plus Adam's two moments."""
    params = {id(p): p for p in model.parameters()}.values()  # tied tensors once
    return sum(p.numel() * p.element_size() for p in params) * (1 + optimizer_moments)


def ensure_writable(directory: str | Path, need_bytes: int = 0) -> Path:
    """Fail early, in one clear line, when checkpoints cannot be written to ``directory``.

    Creates the directory, writes and fsyncs a probe file (a read-only file system, missing
    permissions, a file in the way), and checks that ``need_bytes`` are free. An atomic save
    holds the old and the new checkpoint at once, so pass twice a checkpoint's size. On
    failure a directory this call created is removed again: nothing on disk changes.
    """
    directory = Path(directory)
    created = [p for p in [directory, *directory.parents] if not p.exists()]
    try:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=directory, prefix=".txlm-write-probe.")
            try:
                os.write(fd, b"probe")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            raise CheckpointError(
                f"cannot write checkpoints to {directory}: {exc.strerror or exc}"
            ) from None
        free = shutil.disk_usage(directory).free
        if free < need_bytes:
            raise CheckpointError(
                f"{directory} has {free / 2**20:.1f} MiB free; checkpoints need about "
                f"{need_bytes / 2**20:.1f} MiB (the old one is kept until the new is whole)"
            )
    except CheckpointError:
        for p in created:  # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    return directory


def resolve(path: str | Path) -> Path:
    """The checkpoint directory to read: ``path``, or ``path.old`` after an interrupted swap."""
    path = atomic.resolve(path)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    raise CheckpointError(f"checkpoint {path} does not exist")


def save(
    model: TransformerXL,
    directory: str | Path,
    *,
    vocab_json: str | None = None,
    extra_config: dict[str, Any] | None = None,
    extra_files: Callable[[Path], None] | None = None,
    vocab: Any = None,
) -> Path:
    """Write ``model`` (and optionally its vocabulary and more files) atomically.

    ``vocab`` (a ``txlm.data.Vocab``) writes every file the vocabulary needs, a bpe
    tokenizer.json included; ``vocab_json`` is the bare vocab.json text of a symbol-table
    vocabulary (char, word, byte), e.g. one converted from another format.
    """
    if vocab is not None and vocab_json is not None:
        raise ValueError("pass vocab or vocab_json, not both")
    if vocab_json is not None and json.loads(vocab_json).get("level") == "bpe":
        raise ValueError("a bpe vocabulary has a tokenizer.json too: pass vocab=, not vocab_json=")

    directory = Path(directory)
    with atomic.directory(directory) as tmp:
        config = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": model.config.to_dict(),
            **(extra_config or {}),
        }
        atomic.write_json(tmp / CONFIG_FILE, config)
        save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        if vocab_json is not None:
            (tmp / VOCAB_FILE).write_text(vocab_json)
        if vocab is not None:
            vocab.save(tmp / VOCAB_FILE)
        if extra_files is not None:
            extra_files(tmp)
    return directory


def read_config(directory: str | Path) -> dict[str, Any]:
    """The parsed config.json of a txlm checkpoint, checked to be ours."""
    directory = resolve(directory)
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {CONFIG_FILE}: not a txlm checkpoint")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a txlm checkpoint config (foreign checkpoints: txlm convert)"
        )
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {data.get('format_version')!r}; "
            f"this txlm reads version {FORMAT_VERSION}"
        )
    return data


def _header_shapes(weights: Path, config: ModelConfig) -> dict[str, list[int]]:
    """Tensor shapes from the weights file's header (no tensor data is read).

    Also checks the layer count against config.json before any model is built: a config
    claiming a million layers must not cost a million module constructions to refuse.
    """
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {key: list(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{weights} is not a readable safetensors file: {str(exc).splitlines()[0]}"
        ) from None
    layers = {k.split(".")[1] for k in shapes if k.startswith("layers.")}
    if len(layers) != config.n_layer:
        raise CheckpointError(
            f"{weights} does not match its config.json: it holds {len(layers)} layers, "
            f"the config says n_layer={config.n_layer}"
        )
    return shapes


def _check_shapes(weights: Path, shapes: dict[str, list[int]], model: TransformerXL) -> None:
    """Compare the header's shapes with the model (on the meta device: still unallocated).

    config.json decides how much memory ``to_empty`` allocates; a config that claims a huge
    vocabulary or width next to a small weights file must be refused here, from the header
    alone, not by exhausting memory. Missing/unexpected tensors are reported after loading.
    """
    wanted = model.state_dict()
    for key, shape in sorted(shapes.items()):
        if key in wanted and list(wanted[key].shape) != shape:
            raise CheckpointError(
                f"{weights} does not match its config.json: {key} has shape {shape}, "
                f"the config needs {list(wanted[key].shape)}"
            )


_BUILD_DIRECTLY_BELOW = 20_000_000  # parameters; larger models are built on the meta device


def _rough_parameter_count(c: ModelConfig) -> int:
    """An upper-end estimate from the config alone (attention, feed-forward, embeddings)."""
    assert c.d_embed is not None
    per_layer = 4 * c.d_model * c.n_head * c.d_head + 2 * c.d_model * c.d_inner
    return c.n_layer * per_layer + 2 * c.vocab_size * max(c.d_embed, c.d_model)


def load(
    directory: str | Path, *, device: str | torch.device = "cpu", align_heads: bool | str = "auto"
) -> TransformerXL:
    """A model in eval mode from a checkpoint directory. ``align_heads``: store the heads
    padded to a multiple of 8 dims (``txlm.model.align``; auto: on CUDA, where it pays)."""
    directory = resolve(directory)
    data = read_config(directory)
    try:
        config = ModelConfig.from_dict(data.get("model"))  # type: ignore[arg-type]
    except ConfigError as exc:
        raise CheckpointError(f"{directory / CONFIG_FILE}: {exc}") from None
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{directory} has no {WEIGHTS_FILE}")
    shapes = _header_shapes(weights, config)
    if _rough_parameter_count(config) <= _BUILD_DIRECTLY_BELOW:
        # A small model is cheaper to build for real (milliseconds of random init) than on
        # the meta device, whose first use imports torch's Python reference kernels (~2 s of
        # start-up for every `txlm eval/generate`). fork_rng: loading must not advance the
        # caller's random stream (a resumed run restores its own RNG state afterwards).
        with torch.random.fork_rng(devices=[]):
            model = TransformerXL(config)
        _check_shapes(weights, shapes, model)
        model = model.to(device)
    else:
        with torch.device("meta"):
            model = TransformerXL(config)
        _check_shapes(weights, shapes, model)  # before allocating what config.json claims
        model = model.to_empty(device=device)
        model.tie_weights()
    try:
        missing, unexpected = load_model(model, str(weights), strict=False, device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(
            f"{weights} is unreadable or does not fit its config: {str(exc).splitlines()[0]}"
        ) from None
    if missing or unexpected:
        detail = ", ".join(sorted(missing)[:3] or sorted(unexpected)[:3])
        raise CheckpointError(
            f"{weights} does not match its config.json "
            f"({len(missing)} missing, {len(unexpected)} unexpected tensors: {detail})"
        )
    if align.wanted(align_heads, device):
        align.pad_model(model)
    return model.eval()


def load_vocab(directory: str | Path) -> Vocab:
    """The vocabulary saved with a checkpoint, checked to be the one the model was trained
    with: vocab.json (and a bpe vocabulary's tokenizer.json) must give the fingerprint
    config.json records. Missing: ``CheckpointError``. The one reader of a checkpoint's
    vocabulary."""
    directory = resolve(directory)
    path = directory / VOCAB_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {VOCAB_FILE}: cannot encode text")
    try:
        vocab = Vocab.load(path)
    except DataError as exc:  # the checkpoint is what is damaged, not a dataset
        raise CheckpointError(str(exc)) from None
    what = TOKENIZER_FILE if vocab.level == "bpe" else VOCAB_FILE
    check_fingerprint(
        vocab,
        read_config(directory).get("vocab_fingerprint"),
        what=str(directory / what),
        against="the checkpoint's config.json",
        error=CheckpointError,
    )
    return vocab


def vocab_fingerprint(directory: str | Path) -> str | None:
    """The fingerprint of the vocabulary a checkpoint's model was trained with: the one
    config.json records, else its vocab.json's; None when it has neither (converted
    weights without a vocabulary)."""
    directory = resolve(directory)
    recorded = read_config(directory).get("vocab_fingerprint")
    if recorded is not None or not (directory / VOCAB_FILE).is_file():
        return recorded
    return load_vocab(directory).fingerprint


class Checkpoint:
    """A checkpoint directory opened once: ``Checkpoint.open(path)`` resolves ``NAME`` or
    ``NAME.old`` and parses config.json (``CheckpointError`` when it is not a txlm one)."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path, self.data = path, data
        try:
            self.model_config = ModelConfig.from_dict(data.get("model"))  # type: ignore[arg-type]
        except ConfigError as exc:
            raise CheckpointError(f"{path / CONFIG_FILE}: {exc}") from None

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        directory = resolve(path)
        return cls(directory, read_config(directory))

    @property
    def train_config(self) -> dict[str, Any] | None:
        train = self.data.get("train")
        return train if isinstance(train, dict) else None

    @property
    def has_vocab(self) -> bool:
        return (self.path / VOCAB_FILE).is_file()

    def vocab(self) -> Vocab:
        return load_vocab(self.path)

    def load_model(
        self, device: str | torch.device = "cpu", align_heads: bool | str = "auto"
    ) -> TransformerXL:
        return load(self.path, device=device, align_heads=align_heads)

    def weights_sha256(self) -> str:
        import hashlib

        digest = hashlib.sha256()
        with open(self.path / WEIGHTS_FILE, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()
