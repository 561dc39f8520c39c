"""Training configuration: typed dataclasses and their composition.

A run's configuration is built in three layers, each overriding the one before:

    preset (txlm.config.PRESETS[name]: model shape + its ``train`` defaults)
      -> YAML files (--config F.yaml: the nested layout of ``TrainConfig.to_dict()``)
        -> --set key=value (dotted keys: ``optim.lr=1e-3``, ``model.n_layer=2``)

Every key is checked against the dataclass fields, every value against the field's type;
mistakes raise ``ConfigError`` with the key's dotted name. The resolved configuration is
printed when training starts and saved in every checkpoint's ``config.json``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from txlm.config import PRESETS, ModelConfig
from txlm.errors import ConfigError
from txlm.resources import read_bounded

DEFAULT_PRESET = "shakespeare-char"


@dataclass
class DataConfig:
    dataset: str = "shakespeare"  # a txlm.data dataset name, or text:PATH
    data_dir: str | None = None  # None: $TXLM_DATA_DIR or ./data
    level: str | None = None  # None: the dataset's own (char, word, byte)
    batch_size: int = 16  # GLOBAL rows per step, over all ranks and accumulation chunks
    tgt_len: int | None = None  # segment length; None: the model's tgt_len
    doc_mode: str = "continue"  # how streams treat document boundaries (txlm.data)
    varlen: bool = False  # variable segment lengths (txlm.data.StreamIterator)


@dataclass
class OptimConfig:
    optimizer: Literal["adam", "adamw"] = "adam"
    lr: float = 2.5e-4  # the paper's
    schedule: Literal["cosine", "inv_sqrt", "constant"] = "cosine"
    warmup_steps: int = 0  # linear warm-up from 0 (all schedules)
    max_steps: int = 1000
    min_lr: float = 0.0  # cosine decays to this
    clip: float = 0.25  # gradient-norm clipping (the paper's); <= 0 turns it off
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_accum: int = 1  # each rank's rows are split into this many chunks per step
    max_bad_steps: int = 10  # consecutive non-finite steps before the run stops
    # Which positions the loss counts (txlm.training.objective): full, or half (the last
    # L/2 of each segment: the paper's Table 6 ablation objective).
    loss: Literal["full", "half"] = "full"
    # Parameter-name prefixes to keep as they are (no gradient, no Adam state), e.g. a large
    # word model's embedding and softmax when fine-tuning: [embed, softmax].
    freeze: list[str] = field(default_factory=list)
    # Weight averaging (txlm.training.averaging): validation, `best` and the final evaluation
    # read an average of the weights after every step from average_start on, uniform
    # (averaged SGD, as AWD-LSTM) or ema (exponential, average_decay per step); none: the
    # weights as trained.
    average: Literal["none", "uniform", "ema"] = "none"
    average_start: int = 1
    average_decay: float = 0.999


@dataclass
class EvalConfig:
    eval_interval: int = 200  # validate every N steps (0: only at the end)
    eval_tgt_len: int | None = None  # None: the model's lengths
    eval_mem_len: int | None = None
    eval_clamp_len: int | None = None
    same_length: bool | None = None
    batch_size: int = 1  # rows of the evaluation stream (contiguous chunks of the split)
    max_eval_steps: int | None = None  # cap on segments per validation during training
    final_eval: bool = True  # evaluate `best` on valid and test at the end
    # The final evaluation (and a fine-tuning run's init_valid) reads at most this many tokens
    # of each split, so its cost stays bounded on a large corpus; None: whole splits. The
    # default covers wt103's valid and test whole.
    final_max_tokens: int | None = 1_000_000
    sample_tokens: int = 300  # generated sample at the end (0: none)
    sample_prompt: str = "ROMEO:"
    sample_top_k: int = 40


@dataclass
class RunConfig:
    seed: int = 0
    deterministic: bool = False  # deterministic kernels while the trainer works (determinism.py)
    threads: int | None = None  # torch intra-op threads; None: torch's default
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # torch.compile the training forward; auto: on for CUDA, off on CPU (slower there).
    # Steps that compile count against neither time_budget_s nor tokens/s (reported apart).
    compile: bool | Literal["auto"] = "auto"
    # store the heads, widths and key axis padded to multiples of 8 (txlm.model.align: the
    # same arithmetic, aligned kernels); auto: on CUDA, where it pays. Checkpoints keep real
    # shapes.
    align_heads: bool | Literal["auto"] = "auto"
    device: str = "auto"  # auto: cuda when available (per local rank), else cpu
    out_dir: str | None = None  # None: runs/<preset>
    log_interval: int = 10  # steps between metric records
    save_interval: int = 0  # also save `last` every N steps (0: at validations and the end)
    stop_at: int | None = None  # stop (resumably) after this step, schedule unchanged
    # Wall-clock cap on the training of one invocation (seconds of train steps, validation
    # excluded; a --resume gets it whole again): the schedule runs on the larger of the step
    # and the spent fraction of the budget (from where it stood when the invocation began),
    # so a slow machine still gets a complete cosine decay, and training ends when either
    # runs out. Makes a run machine-dependent.
    time_budget_s: float | None = None
    progress: bool = True  # a bar on a terminal; else a plain line every progress_interval
    progress_interval: int = 100  # steps between plain progress lines (stderr not a terminal)
    tensorboard: bool = True  # when the tensorboard package is installed


@dataclass
class ClassifyConfig:
    """``task: classify`` (txlm.training.tasks.classify, txlm.classify.classifier)."""

    pooling: Literal["mean", "last"] = "mean"  # how the head pools the final-layer states
    grad_segments: int = 1  # the last k segments of a document keep their graph (0: all)
    # the seeded, stratified split of a classes:DIR without train/valid/test folders
    valid_fraction: float = 0.1
    test_fraction: float = 0.1


@dataclass
class TrainConfig:
    preset: str = DEFAULT_PRESET
    # A checkpoint the run started from (txlm.training.init): its model section and weights,
    # its vocabulary. None: a model built from the seed, a vocabulary built from the data.
    init: str | None = None
    task: Literal["lm", "classify"] = "lm"  # a language model, or a document classifier
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields but vocab_size
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    classify: ClassifyConfig = field(default_factory=ClassifyConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        config = cls(preset=data.get("preset", DEFAULT_PRESET), init=data.get("init"))
        config.task = _coerce("task", typing.get_type_hints(cls)["task"], data.get("task", "lm"))
        _merge(config, {k: v for k, v in data.items() if k not in ("init", "task")}, "")
        config.validate()
        return config

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The model's configuration for a vocabulary of ``vocab_size``."""
        data = {**self.model, "vocab_size": vocab_size}
        if self.data.tgt_len is not None:
            data["tgt_len"] = self.data.tgt_len
        return ModelConfig.from_dict(data)

    def validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        d, o, e, r = self.data, self.optim, self.eval, self.run
        check(d.batch_size >= 1, f"data.batch_size must be >= 1, got {d.batch_size}")
        check(d.tgt_len is None or d.tgt_len >= 1, f"data.tgt_len must be >= 1, got {d.tgt_len}")
        check(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
        check(o.min_lr >= 0, f"optim.min_lr must be >= 0, got {o.min_lr}")
        check(o.max_steps >= 1, f"optim.max_steps must be >= 1, got {o.max_steps}")
        check(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
        check(o.grad_accum >= 1, f"optim.grad_accum must be >= 1, got {o.grad_accum}")
        check(
            d.batch_size % o.grad_accum == 0,
            f"data.batch_size ({d.batch_size}) must be divisible by optim.grad_accum "
            f"({o.grad_accum})",
        )
        check(o.max_bad_steps >= 1, f"optim.max_bad_steps must be >= 1, got {o.max_bad_steps}")
        check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1/beta2 must be in [0, 1)")
        check(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
        check(o.average_start >= 1, f"optim.average_start must be >= 1, got {o.average_start}")
        check(
            o.average == "none" or o.average_start <= o.max_steps,
            f"optim.average_start ({o.average_start}) is past optim.max_steps ({o.max_steps}): "
            "the average would never begin",
        )
        check(
            0 < o.average_decay < 1, f"optim.average_decay must be in (0, 1), got {o.average_decay}"
        )
        check(e.eval_interval >= 0, f"eval.eval_interval must be >= 0, got {e.eval_interval}")
        check(e.batch_size >= 1, f"eval.batch_size must be >= 1, got {e.batch_size}")
        for name in ("eval_tgt_len", "max_eval_steps", "final_max_tokens"):
            value = getattr(e, name)
            check(value is None or value >= 1, f"eval.{name} must be >= 1, got {value}")
        check(
            e.eval_mem_len is None or e.eval_mem_len >= 0,
            f"eval.eval_mem_len must be >= 0, got {e.eval_mem_len}",
        )
        check(e.sample_tokens >= 0, f"eval.sample_tokens must be >= 0, got {e.sample_tokens}")
        check(e.sample_top_k >= 1, f"eval.sample_top_k must be >= 1, got {e.sample_top_k}")
        check(r.log_interval >= 1, f"run.log_interval must be >= 1, got {r.log_interval}")
        check(
            r.progress_interval >= 1,
            f"run.progress_interval must be >= 1, got {r.progress_interval}",
        )
        check(r.save_interval >= 0, f"run.save_interval must be >= 0, got {r.save_interval}")
        check(r.threads is None or r.threads >= 1, f"run.threads must be >= 1, got {r.threads}")
        check(r.stop_at is None or r.stop_at >= 1, f"run.stop_at must be >= 1, got {r.stop_at}")
        check(
            r.time_budget_s is None or r.time_budget_s > 0,
            f"run.time_budget_s must be > 0, got {r.time_budget_s}",
        )
        check(
            r.device == "auto" or r.device == "cpu" or r.device.startswith("cuda"),
            f"run.device must be auto, cpu or cuda[:N], got {r.device!r}",
        )
        k = self.classify
        check(k.grad_segments >= 0, f"classify.grad_segments must be >= 0, got {k.grad_segments}")
        check(
            k.valid_fraction >= 0 and k.test_fraction >= 0
            and k.valid_fraction + k.test_fraction < 1,
            "classify.valid_fraction and test_fraction must be >= 0 with a sum below 1",
        )  # fmt: skip
        # The model keys: validated by building the config with a stand-in vocabulary.
        if "vocab_size" in self.model:
            raise ConfigError("model.vocab_size comes from the data's vocabulary; do not set it")
        self.model_config(vocab_size=max([2, *[c + 1 for c in self.model.get("cutoffs", [])]]))


# -- composition ------------------------------------------------------------------------
def preset_config(name: str) -> TrainConfig:
    """The TrainConfig a preset defines (its model dict, eval lengths and train defaults)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    config = TrainConfig(preset=name)
    config.model = {k: v for k, v in preset.model.items() if k != "vocab_size"}
    if preset.dataset is not None:
        config.data.dataset = preset.dataset
    # The paper's evaluation lengths live in Preset.eval under the model's names.
    for src, dst in (
        ("tgt_len", "eval_tgt_len"),
        ("mem_len", "eval_mem_len"),
        ("clamp_len", "eval_clamp_len"),
        ("same_length", "same_length"),
    ):
        if src in preset.eval:
            setattr(config.eval, dst, preset.eval[src])
    _merge(config, getattr(preset, "train", None) or {}, "")
    return config


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        # bounded: a configuration is small, and a device or pipe would never end
        data = yaml.safe_load(read_bounded(path, 16 * 2**20).decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # a binary file (e.g. a pickle) passed as --config
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start}): not a YAML file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model, data, optim, ...)")
    return data


def parse_set(item: str) -> tuple[str, Any]:
    """``'optim.lr=1e-3'`` -> ``('optim.lr', 0.001)`` (the value read as YAML)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects key=value (e.g. optim.lr=1e-3), got {item!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, _Raw(raw, value)


@dataclass
class _Raw:
    """A --set value: kept with its text so a str field gets the text as typed."""

    text: str
    value: Any


def apply_set(config: TrainConfig, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) != 2:
        raise ConfigError(
            f"unknown config key {key!r}: use section.name, sections: {', '.join(_SECTIONS)}"
        )
    _merge(config, {parts[0]: {parts[1]: value}}, "")


def resolve(
    preset: str | None = None,
    config_files: list[str] | None = None,
    sets: list[str] | None = None,
    base: TrainConfig | None = None,
    init: Any = None,
) -> TrainConfig:
    """Compose preset -> YAML files -> --set overrides into a validated TrainConfig.

    ``base`` (a checkpoint's saved config, for --resume) replaces the preset layer.
    ``init`` (a ``txlm.checkpoints.checkpoint.Checkpoint``, for --init) gives the model section: the
    files and --set may change only what ``txlm.training.init.TUNABLE_MODEL_KEYS`` names,
    and the evaluation lengths default to the checkpoint's (``Checkpoint.lengths``: what its
    run evaluated with, else its model's), not the preset's.
    """
    files = [load_yaml(f) for f in config_files or []]
    if base is not None:
        config = TrainConfig.from_dict(base.to_dict())
    else:
        name = preset
        for data in files:  # a YAML file may name its preset; --preset wins
            if name is None and isinstance(data.get("preset"), str):
                name = data["preset"]
        config = preset_config(name or DEFAULT_PRESET)
    if init is not None:
        config.model = {}  # from here on: the run's own model settings
        # the checkpoint's evaluation lengths (its run's, else its model's), not the preset's
        lengths, e = init.lengths(), config.eval
        e.eval_tgt_len, e.eval_mem_len = lengths.tgt_len, lengths.mem_len
        e.eval_clamp_len, e.same_length = lengths.clamp_len, lengths.same_length
    for data in files:
        data = {k: v for k, v in data.items() if k != "preset"}
        _merge(config, data, "")
    for item in sets or []:
        key, value = parse_set(item)
        apply_set(config, key, value)
    if init is not None:
        from txlm.training.init import init_from

        return init_from(init, config)
    config.validate()
    return config


# -- typed merging ----------------------------------------------------------------------
_SECTIONS = ("model", "data", "optim", "eval", "run", "classify")


def _merge(config: TrainConfig, data: dict[str, Any], prefix: str) -> None:
    for section, values in data.items():
        if section == "preset":
            if not isinstance(values, str) or values not in PRESETS:
                raise ConfigError(f"unknown preset {values!r}; choose from: {', '.join(PRESETS)}")
            config.preset = values
            continue
        if section == "task":  # a top-level scalar, as --print-config writes it
            config.task = _coerce("task", typing.get_type_hints(TrainConfig)["task"], values)
            continue
        if section == "init":  # --print-config writes the run's; a new one comes from --init
            if values is not None:
                raise ConfigError(f"{prefix}init is set with txlm train --init CKPT, not in a file")
            continue
        if section not in _SECTIONS:
            raise ConfigError(
                f"unknown config section {prefix + section!r}; sections: {', '.join(_SECTIONS)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        if section == "model":
            _merge_model(config, values)
            continue
        target = getattr(config, section)
        hints = typing.get_type_hints(type(target))
        names = {f.name for f in dataclasses.fields(target)}
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if key not in names:
                raise ConfigError(
                    f"unknown config key {dotted!r}; {section} keys: {', '.join(sorted(names))}"
                )
            setattr(target, key, _coerce(dotted, hints[key], value))


_MODEL_HINTS = typing.get_type_hints(ModelConfig)


def _merge_model(config: TrainConfig, values: dict[str, Any]) -> None:
    for key, value in values.items():
        dotted = f"model.{key}"
        if key not in _MODEL_HINTS:
            raise ConfigError(
                f"unknown config key {dotted!r}; model keys: {', '.join(sorted(_MODEL_HINTS))}"
            )
        config.model[key] = _coerce(dotted, _MODEL_HINTS[key], value)


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """``value`` as type ``hint`` or a ConfigError naming the key."""
    raw: str | None = None
    if isinstance(value, _Raw):
        raw, value = value.text, value.value
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        last: ConfigError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, arg, _Raw(raw, value) if raw is not None else value)
            except ConfigError as exc:
                last = exc
        assert last is not None
        raise last
    if origin is Literal:
        if value not in args:
            choices = ", ".join(str(a) for a in args)
            raise ConfigError(f"{name} must be one of {choices}, got {value!r}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if hint is str:
        if raw is not None:
            return raw.strip()
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} must be a string, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        (item,) = args
        return [_coerce(f"{name}[{i}]", item, v) for i, v in enumerate(value)]
    return value
