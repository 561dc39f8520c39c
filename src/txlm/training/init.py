"""A run that starts from a checkpoint's model: fine-tuning (``txlm train --init CKPT``).

The checkpoint gives the model (its configuration and weights) and the vocabulary; the run's
other sections (data, optim, eval, run) come from the preset, YAML files and ``--set`` as for
any run. What a trained model allows to change is only what its weights do not fix: dropout
and the lengths (positions are relative, so tgt_len, mem_len, clamp_len and same_length may
differ from training's). Everything else of a run starts fresh: optimizer, schedule,
counters, memory and the data stream.

``init_from(ckpt, config)`` is the one place that turns a checkpoint and a resolved
configuration into the run's configuration; ``load_init_weights`` copies the checkpoint's
weights into the model a run builds from it (a language model, or the body of another);
``init_record`` is what the run records of its start (the checkpoint's path and the sha256
of its weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from txlm.checkpoints.checkpoint import Checkpoint
from txlm.errors import CheckpointError, ConfigError

# The model keys a trained model lets a new run change: its weights fix every other one.
TUNABLE_MODEL_KEYS = (
    "dropout", "dropatt", "variational_dropout", "tgt_len", "mem_len", "clamp_len", "same_length",
)  # fmt: skip


def open_init(path: str | Path) -> Checkpoint:
    """The checkpoint to start from; it must carry the vocabulary its model reads."""
    ckpt = Checkpoint.open(path)
    if not ckpt.has_vocab:
        raise CheckpointError(
            f"--init {ckpt.path} has no vocab.json: the new corpus must be encoded with the "
            "vocabulary the model was trained with"
        )
    ckpt.vocab()  # read now: its fingerprint and size checked against the model
    return ckpt


def check_model_keys(keys: Any) -> None:
    """Refuse a ``model.*`` setting that a trained model's weights fix."""
    for key in keys:
        if key not in TUNABLE_MODEL_KEYS:
            raise ConfigError(
                f"model.{key} is fixed by the --init checkpoint's weights; a run started from "
                f"it may set only model.{', model.'.join(TUNABLE_MODEL_KEYS)}"
            )


def init_from(ckpt: Checkpoint, config: Any) -> Any:
    """``config`` (a ``TrainConfig`` whose ``model`` section holds only the run's own
    ``model.*`` settings) as a run started from ``ckpt``: the model section becomes the
    checkpoint's, changed by those settings (tunable keys only), and ``init`` names the
    checkpoint. A ``data.level`` other than the vocabulary's is refused."""
    check_model_keys(config.model)
    level = ckpt.vocab().level
    if config.data.level is not None and config.data.level != level:
        raise ConfigError(
            f"data.level={config.data.level} contradicts the --init checkpoint's {level} "
            "vocabulary (the corpus is encoded with it): drop data.level"
        )
    model = ckpt.model_config.to_dict()
    model.pop("vocab_size")
    model.update(config.model)
    config.model = model
    config.init = str(ckpt.path.resolve())
    config.validate()
    return config


def check_same_model(ckpt: Checkpoint, model_config: Any) -> None:
    """Refuse a run configuration whose model is not ``ckpt``'s but for the tunable keys (one
    with ``init`` set by hand instead of through ``init_from``)."""
    mine, theirs = model_config.to_dict(), ckpt.model_config.to_dict()
    differ = sorted(k for k in theirs if k not in TUNABLE_MODEL_KEYS and mine.get(k) != theirs[k])
    if differ:
        raise ConfigError(
            f"the configuration's model differs from the --init checkpoint's in "
            f"model.{', model.'.join(differ)}: build it with txlm.training.init.init_from "
            "(or resolve(..., init=...))"
        )


def init_record(ckpt: Checkpoint) -> dict[str, Any]:
    """What a run records of its start."""
    return {"path": str(ckpt.path.resolve()), "weights_sha256": ckpt.weights_sha256()}


def load_init_weights(model: nn.Module, source: Checkpoint | nn.Module) -> None:
    """Copy the weights of ``source`` (the checkpoint, or its model already loaded) into
    ``model``, built (unaligned) from the checkpoint's model configuration with at most the
    tunable keys changed: none of them shapes a weight."""
    if isinstance(source, Checkpoint):
        source = source.load_model(device="cpu", align_heads=False, task="lm")
    model.load_state_dict(source.state_dict())
