"""Model configuration and the paper's presets.

``ModelConfig`` is a frozen-by-convention dataclass: validated in ``__post_init__``, written to
``config.json`` in every checkpoint, and changed only through ``replace`` (so a changed copy is
validated again). Presets name the configurations of the paper's tables; each cites its table.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from txlm.errors import ConfigError

# Positional encodings of the paper's ablation (Table 6):
#   "xl"      the paper's relative encoding: sinusoid R, W_kR, global biases u, v (Sec. 3.3)
#   "shaw"    Shaw et al. (2018): learned relative embeddings per layer, terms (a) + (b) only
#   "vaswani" Vaswani et al. (2017): absolute sinusoid added to the word embeddings
#   "alrfou"  Al-Rfou et al. (2018): learned absolute embeddings added at every layer
AttnType = Literal["xl", "shaw", "vaswani", "alrfou"]
ATTN_TYPES = ("xl", "shaw", "vaswani", "alrfou")
# Attention kernels: "sdpa" torch's fused attention where it pays, "math" the reference
# (explicit scores and softmax), "triton" txlm.model.triton_attention (needs the triton
# package; on the CPU its interpreter, TRITON_INTERPRET=1)
ATTN_IMPLS = ("sdpa", "math", "triton")


@dataclass
class ModelConfig:
    vocab_size: int
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 8
    d_head: int = 32
    d_inner: int = 1024
    d_embed: int | None = None  # None: d_model
    dropout: float = 0.1
    dropatt: float = 0.0
    # Variational (locked) dropout, the paper's Penn Treebank recipe after AWD-LSTM (Sec. 4.1):
    # every `dropout` site on hidden states (the embedding output, each layer's attention and
    # feed-forward outputs, the feed-forward's inner activation, the last layer's output)
    # draws one mask per row and feature, shared across the positions of a segment
    # (txlm.model.dropout). The position encoding's and the attention's dropout stay
    # element-wise.
    variational_dropout: bool = False
    # Lengths. tgt_len is the segment length the model was trained with (the data pipeline
    # uses it); mem_len the number of earlier hidden states each layer keeps (Tail_M).
    tgt_len: int = 128
    mem_len: int = 128
    clamp_len: int = -1  # > 0: relative distances beyond this share one encoding
    # same_length: every query attends to at most the mem_len most recent keys ending at
    # itself (query at key index q sees keys q - mem_len < j <= q), so the first and last
    # query of a segment see contexts of the same length. The same mask as the original code
    # and transformers' TransfoXL, also while memory is still filling up.
    same_length: bool = False
    attn_type: AttnType = "xl"
    n_positions: int = 1024  # table size for the learned encodings (shaw, alrfou)
    pre_lnorm: bool = False
    untie_r: bool = False  # per-layer u, v instead of one pair shared by all layers
    # Adaptive input / softmax (Baevski & Auli; Grave et al.). cutoffs exclude vocab_size.
    cutoffs: list[int] = field(default_factory=list)
    div_val: int = 1
    tie_weight: bool = True
    # Per cluster (head first): share the softmax projection with the embedding's.
    tie_projs: list[bool] | None = None  # None: [False] + [True] * len(cutoffs)
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    proj_init_std: float = 0.01
    attn_impl: Literal["sdpa", "math", "triton"] = "sdpa"

    def __post_init__(self) -> None:
        if self.d_embed is None:
            self.d_embed = self.d_model
        self.cutoffs = [int(c) for c in self.cutoffs]
        if self.tie_projs is None:
            self.tie_projs = [False] + [True] * len(self.cutoffs)
        self.tie_projs = [bool(t) for t in self.tie_projs]
        self._validate()

    def _validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "vocab_size",
            "n_layer",
            "d_model",
            "n_head",
            "d_head",
            "d_inner",
            "d_embed",
            "tgt_len",
            "div_val",
            "n_positions",
        ):
            positive(name)
        if not isinstance(self.mem_len, int) or self.mem_len < 0:
            raise ConfigError(f"mem_len must be a non-negative integer, got {self.mem_len!r}")
        if not isinstance(self.clamp_len, int):
            raise ConfigError(f"clamp_len must be an integer, got {self.clamp_len!r}")
        for name in ("dropout", "dropatt"):
            p = getattr(self, name)
            if not isinstance(p, int | float) or not 0.0 <= p < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {p!r}")
        # JSON accepts NaN/Infinity and negatives here; each would only surface later as NaN
        # activations (eps) or a RuntimeError from normal_ (std) deep inside construction.
        for name, low in (
            ("layer_norm_eps", "> 0"),
            ("init_std", ">= 0"),
            ("proj_init_std", ">= 0"),
        ):
            x = getattr(self, name)
            ok = (
                isinstance(x, int | float)
                and math.isfinite(x)
                and (x > 0 if low == "> 0" else x >= 0)
            )
            if not ok:
                raise ConfigError(f"{name} must be a finite number {low}, got {x!r}")
        if self.attn_type not in ATTN_TYPES:
            raise ConfigError(f"attn_type must be one of {ATTN_TYPES}, got {self.attn_type!r}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ConfigError(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        if self.attn_impl == "triton" and importlib.util.find_spec("triton") is None:
            raise ConfigError("attn_impl triton needs the triton package (pip install triton)")
        if self.same_length and self.mem_len < 1:
            raise ConfigError("same_length needs mem_len >= 1 (the window it keeps constant)")
        if self.cutoffs != sorted(set(self.cutoffs)) or any(
            c <= 0 or c >= self.vocab_size for c in self.cutoffs
        ):
            raise ConfigError(
                f"cutoffs must be increasing and inside (0, vocab_size={self.vocab_size}), "
                f"got {self.cutoffs}"
            )
        if len(self.tie_projs or []) != len(self.cutoffs) + 1:
            raise ConfigError(
                f"tie_projs needs one flag per cluster ({len(self.cutoffs) + 1}), "
                f"got {self.tie_projs}"
            )
        if self.div_val > 1 and self.d_embed // self.div_val ** len(self.cutoffs) < 1:
            raise ConfigError("div_val too large: the last cluster's embedding would be empty")

    # -- convenience -----------------------------------------------------------------
    @property
    def n_clusters(self) -> int:
        return len(self.cutoffs)

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown model config key(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise ConfigError("model config must be a JSON object")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(known)
        if unknown:
            raise ConfigError(f"unknown model config key(s): {', '.join(sorted(unknown))}")
        if "vocab_size" not in data:
            raise ConfigError("model config lacks vocab_size")
        _check_types(data)
        try:
            return cls(**data)
        except TypeError as exc:  # a wrongly typed value that slipped past validation
            raise ConfigError(f"bad model config: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model config is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose from: {', '.join(PRESETS)}")
        data = {**PRESETS[name].model, **overrides}
        return cls.from_dict(data)


# How a loosely typed JSON/YAML value is checked against a field's type hint: a test, and
# the words an error says it must be (one value, and a list's items). bool is an int in
# Python, but true is no layer count and 1 no flag.
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


_KINDS: dict[type, tuple[Callable[[Any], bool], str, str]] = {
    int: (_is_int, "an integer", "integers"),
    float: (_is_number, "a number", "numbers"),
    bool: (_is_bool, "true or false", "true/false"),
}


def _kind(hint: Any) -> tuple[Callable[[Any], bool], str] | None:
    """The check a field's type hint asks of a value, and its words; None for a Literal
    (``_validate`` names the choices)."""
    if hint in _KINDS:
        test, words, _ = _KINDS[hint]
        return test, words
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args[0] in _KINDS:
        item, _, items = _KINDS[args[0]]
        return (lambda v: isinstance(v, list) and all(item(x) for x in v)), f"a list of {items}"
    if typing.get_origin(hint) is types.UnionType and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        kind = _kind(inner)
        if kind is not None:
            test, words = kind
            return (lambda v: v is None or test(v)), f"{words} or null"
    return None


_HINTS = typing.get_type_hints(ModelConfig)
_FIELD_KINDS = {
    f.name: kind for f in dataclasses.fields(ModelConfig) if (kind := _kind(_HINTS[f.name]))
}


def _check_types(data: dict[str, Any]) -> None:
    """JSON and YAML hand us loosely typed values: refuse the wrong kind by name (a string or
    a number where __post_init__ would fail with a message that does not name the key)."""
    for key, value in data.items():
        kind = _FIELD_KINDS.get(key)
        if kind is not None and not kind[0](value):
            raise ConfigError(f"{key} must be {kind[1]}, got {value!r}")


@dataclass(frozen=True)
class Preset:
    """A named model shape plus the training/evaluation lengths the paper used with it."""

    source: str  # where the numbers come from
    model: dict[str, Any]
    eval: dict[str, Any] = field(default_factory=dict)  # tgt_len / mem_len / clamp_len
    paper_params: float | None = None  # parameter count the paper reports
    dataset: str | None = None
    note: str = ""
    # Training defaults for ``txlm train --preset NAME`` (txlm.training.config): nested sections
    # {"data": {...}, "optim": {...}, "eval": {...}, "run": {...}} over TrainConfig's defaults.
    train: dict[str, Any] = field(default_factory=dict)


# Vocabulary sizes of the corpora the paper presets are meant for (the original code's).
_WT103_VOCAB = 267735
_LM1B_VOCAB = 793470
_ENWIK8_VOCAB = 204
_TEXT8_VOCAB = 27
_PTB_VOCAB = 10000
# and of this project's default corpus (txlm.data.corpora's Shakespeare, at the character level)
_SHAKESPEARE_VOCAB = 85

PRESETS: dict[str, Preset] = {
    "debug": Preset(
        source="tests: seconds on a CPU",
        model=dict(
            vocab_size=64,
            n_layer=2,
            d_model=32,
            n_head=2,
            d_head=16,
            d_inner=64,
            tgt_len=16,
            mem_len=16,
            dropout=0.0,
        ),
        eval=dict(tgt_len=16, mem_len=32),
        train=dict(
            data=dict(batch_size=4),
            optim=dict(lr=1e-3, warmup_steps=2, max_steps=20),
            eval=dict(eval_interval=10, max_eval_steps=4, batch_size=2, sample_tokens=20),
            run=dict(log_interval=5, progress=False),
        ),
    ),
    "shakespeare-char": Preset(
        source="this project's default run (make run): 2400 steps in a 600 s budget",
        model=dict(
            # 84 symbols and <unk>: `txlm info` counts the model the default run trains (training
            # takes the data's vocabulary in any case)
            vocab_size=_SHAKESPEARE_VOCAB,
            n_layer=4,
            d_model=256,
            n_head=4,
            d_head=64,
            d_inner=1024,
            tgt_len=128,
            mem_len=128,
            # Under one epoch of a 4.6M-character corpus nothing repeats: dropout only slows
            # learning down.
            dropout=0.0,
        ),
        eval=dict(tgt_len=128, mem_len=256),
        dataset="shakespeare",
        note="a short run, so a higher learning rate than the paper's 2.5e-4, with warm-up",
        train=dict(
            # For a budget of a few million characters, more and smaller steps learn faster
            # than fewer big ones (300 steps of 16 rows ended at 2.87 bpc, 2400 of 8 at 2.36).
            data=dict(batch_size=8),
            optim=dict(lr=1.5e-3, warmup_steps=100, max_steps=2400),
            eval=dict(eval_interval=600, max_eval_steps=20, batch_size=8),
            # A safety net: on a slower machine the cosine decay is compressed into 10 minutes.
            run=dict(log_interval=10, time_budget_s=600.0),
        ),
    ),
    "recall": Preset(
        source="this project's memory benchmark (txlm bench memory): a few minutes on 2 CPU cores",
        model=dict(
            vocab_size=256,
            n_layer=2,
            d_model=64,
            n_head=4,
            d_head=16,
            d_inner=256,
            tgt_len=32,
            mem_len=32,
            dropout=0.0,
            # 0.02 (the paper's, for d_model >= 410) leaves this model's attention products
            # near zero: every head starts uniform and the copy tasks sat at the uniform
            # loss for thousands of steps; about 1/sqrt(d_model) lets them learn in hundreds
            init_std=0.1,
        ),
        dataset="recall",
        note="the synthetic copy task of txlm.data.recall",
        train=dict(
            data=dict(batch_size=32),
            optim=dict(lr=3e-3, warmup_steps=100, max_steps=5000),
            eval=dict(eval_interval=0, max_eval_steps=50, batch_size=8, sample_tokens=0),
            run=dict(log_interval=50),
        ),
    ),
    "enwik8-base": Preset(
        source="paper Table 2 (12L); original run_enwik8_base.sh",
        model=dict(
            vocab_size=_ENWIK8_VOCAB,
            n_layer=12,
            d_model=512,
            n_head=8,
            d_head=64,
            d_inner=2048,
            tgt_len=512,
            mem_len=512,
            dropout=0.1,
            dropatt=0.0,
        ),
        eval=dict(tgt_len=80, mem_len=2100, clamp_len=820, same_length=True),
        paper_params=41e6,
        dataset="enwik8",
    ),
    "enwik8-18l": Preset(
        source="paper Table 2 (18L, 88M); the shape is not in the paper's text",
        model=dict(
            vocab_size=_ENWIK8_VOCAB,
            n_layer=18,
            d_model=512,
            n_head=8,
            d_head=64,
            d_inner=3584,
            tgt_len=512,
            mem_len=512,
            dropout=0.1,
        ),
        eval=dict(tgt_len=80, mem_len=2100, clamp_len=820, same_length=True),
        paper_params=88e6,
        dataset="enwik8",
        note="d_inner 3584 chosen so the count lands on the paper's 88M",
    ),
    "enwik8-large": Preset(
        source="paper Table 2 (24L, 277M); original run_enwik8_large.sh",
        model=dict(
            vocab_size=_ENWIK8_VOCAB,
            n_layer=24,
            d_model=1024,
            n_head=8,
            d_head=128,
            d_inner=3072,
            tgt_len=768,
            mem_len=768,
            dropout=0.15,
            dropatt=0.15,
        ),
        eval=dict(tgt_len=128, mem_len=3800, clamp_len=1000, same_length=True),
        paper_params=277e6,
        dataset="enwik8",
    ),
    "text8-large": Preset(
        source="paper Table 3 (24L, 277M); original run_text8_large.sh",
        model=dict(
            vocab_size=_TEXT8_VOCAB,
            n_layer=24,
            d_model=1024,
            n_head=8,
            d_head=128,
            d_inner=3072,
            tgt_len=768,
            mem_len=768,
            dropout=0.15,
            dropatt=0.15,
        ),
        eval=dict(tgt_len=128, mem_len=3800, clamp_len=1000, same_length=True),
        paper_params=277e6,
        dataset="text8",
    ),
    "wt103-base": Preset(
        source="paper Table 1 (151M); original run_wt103_base.sh",
        model=dict(
            vocab_size=_WT103_VOCAB,
            n_layer=16,
            d_model=410,
            n_head=10,
            d_head=41,
            d_inner=2100,
            tgt_len=150,
            mem_len=150,
            dropout=0.1,
            dropatt=0.0,
            cutoffs=[20000, 40000, 200000],
            div_val=1,
        ),
        eval=dict(tgt_len=64, mem_len=640, clamp_len=400, same_length=True),
        paper_params=151e6,
        dataset="wt103",
    ),
    "wt103-large": Preset(
        source="paper Table 1 (257M); original run_wt103_large.sh, the published transfo-xl-wt103",
        model=dict(
            vocab_size=_WT103_VOCAB,
            n_layer=18,
            d_model=1024,
            n_head=16,
            d_head=64,
            d_inner=4096,
            tgt_len=384,
            mem_len=384,
            dropout=0.2,
            dropatt=0.2,
            cutoffs=[20000, 40000, 200000],
            div_val=4,
        ),
        eval=dict(tgt_len=128, mem_len=1600, clamp_len=1000, same_length=True),
        paper_params=257e6,
        dataset="wt103",
        note="this shape (the paper's, and the published checkpoint's) counts 285M; the "
        "paper's 257M does not follow from its own configuration",
    ),
    "lm1b-base": Preset(
        source="paper Table 4 (0.46B); original run_lm1b_base.sh",
        model=dict(
            vocab_size=_LM1B_VOCAB,
            n_layer=18,
            d_model=1024,
            n_head=8,
            d_head=128,
            d_inner=4096,
            tgt_len=32,
            mem_len=32,
            dropout=0.0,
            dropatt=0.0,
            cutoffs=[60000, 100000, 640000],
            div_val=4,
            tie_weight=False,
            tie_projs=[False, False, False, False],
        ),
        eval=dict(tgt_len=32, mem_len=128, clamp_len=-1, same_length=True),
        paper_params=0.46e9,
        dataset="lm1b",
        note="input and output embeddings untied: tied, this shape counts 0.36B, not the "
        "paper's 0.46B",
    ),
    "lm1b-large": Preset(
        source="paper Table 4 (0.8B); original run_lm1b_large.sh",
        model=dict(
            vocab_size=_LM1B_VOCAB,
            n_layer=24,
            d_model=1280,
            n_head=16,
            d_head=80,
            d_inner=8192,
            tgt_len=32,
            mem_len=32,
            dropout=0.05,
            dropatt=0.05,
            cutoffs=[60000, 100000, 640000],
            div_val=4,
            tie_weight=True,
        ),
        eval=dict(tgt_len=32, mem_len=128, clamp_len=-1, same_length=True),
        paper_params=0.8e9,
        dataset="lm1b",
        note="counts 0.84B, which the paper gives to one significant figure",
    ),
    "ptb": Preset(
        source="paper Table 5 (24M); the shape is not in the paper's text",
        model=dict(
            vocab_size=_PTB_VOCAB,
            n_layer=16,
            d_model=350,
            n_head=10,
            d_head=35,
            d_inner=1000,
            tgt_len=70,
            mem_len=70,
            dropout=0.4,
            dropatt=0.0,
            # "similar to AWD-LSTM, we apply variational dropout and weight average" (Sec. 4.1)
            variational_dropout=True,
        ),
        eval=dict(tgt_len=70, mem_len=140),
        paper_params=24e6,
        dataset="ptb",
        note="16 layers of width 350 chosen so the count lands on the paper's 24M",
        train=dict(
            # Weight averaging as AWD-LSTM's averaged SGD (uniform over the last iterates). The
            # paper gives neither its number of steps nor where the average starts: about 50
            # epochs of PTB's 930k training words in rows of 16 x 70, averaged over the last
            # quarter of the cosine schedule.
            optim=dict(max_steps=40000, warmup_steps=1000, average="uniform", average_start=30001),
        ),
    ),
}


def preset_names() -> list[str]:
    return list(PRESETS)
