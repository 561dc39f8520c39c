"""The paper's Table 6 ablation, on a corpus this machine has (default: Shakespeare, chars).

Legend: B batch rows, L training segment length, M memory length, A evaluation attention
length (keys each query sees), V vocabulary.

A model group with one shape, trained for the same number of steps on the same batches, that
differs only in the positional encoding, the recurrence and the loss (paper Sec. 4.3):

    name        recurrence  encoding                 loss   config
    xl          yes         ours (Sec. 3.3)          full   attn_type xl,     mem_len L
    shaw        yes         Shaw et al. 2018         full   attn_type shaw,   mem_len L
    xl-norec    no          ours                     full   attn_type xl,     mem_len 0
    vanilla     no          Al-Rfou et al. 2018      full   attn_type alrfou, mem_len 0
  with --half-loss also
    xl-half     yes         ours                     half   (loss on the last L/2 positions)
    vanilla-half no         Al-Rfou et al. 2018      half

Parameter budgets: the shapes are identical; the learned encodings add a small table (Shaw:
2L distances x heads x head dim per layer; Al-Rfou: L positions x D per layer); the counts
are reported per row.

Evaluation on the validation split (the corpus's metric: bpc for characters, else ppl):
- "init": exactly the training condition: segments of L, memory as in training (none
  without recurrence), no same_length.
- "best": the best over "init" and every A in ``eval_lengths``: segments of L, a memory of A
  states, same_length on, so every query sees exactly A keys (the paper's "Attn Len"). Each
  row reports the A of its best result ("train" when init wins).

Every model is trained by ``txlm train``'s own trainer (``txlm.training.Trainer``) with the
configuration ``variant_config`` builds: Adam, linear warm-up over the first 5% of steps then
cosine to 0, clip 0.25 (the paper's optimiser), and ``optim.loss=half`` for the half-loss
rows. The group sees the same batches in the same order (one seed, one stream layout), and
``txlm train --config`` with a variant's configuration reproduces its run step for step.
Evaluation is ``txlm.inference.evaluate.evaluate_tokens``.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from txlm.config import PRESETS, ModelConfig
from txlm.data import open_corpus
from txlm.errors import ConfigError
from txlm.inference.evaluate import evaluate_tokens
from txlm.training import Trainer
from txlm.training.config import TrainConfig
from txlm.training.metrics import METRICS_FILE

# Shapes for this analysis. "small": the default, about 30 minutes for the four models on
# 2 CPU cores; "tiny": a couple of minutes; "debug": seconds (tests).
ABLATION_PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(
        model=dict(n_layer=4, d_model=128, n_head=4, d_head=32, d_inner=512, dropout=0.1),
        steps=1200, batch_size=16, tgt_len=64, lr=1e-3,
        eval_lengths=[64, 128, 192, 256], eval_tokens=32768,
    ),
    "tiny": dict(
        model=dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=256, dropout=0.0),
        steps=300, batch_size=16, tgt_len=32, lr=2e-3,
        eval_lengths=[32, 64, 96, 128], eval_tokens=8192,
    ),
    "debug": dict(
        model=dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, dropout=0.0),
        steps=20, batch_size=4, tgt_len=16, lr=3e-3,
        eval_lengths=[16, 32], eval_tokens=1024,
    ),
}  # fmt: skip
ABLATION_PRESETS["ablation-small"] = ABLATION_PRESETS["small"]


@dataclass(frozen=True)
class Variant:
    name: str
    recurrence: bool
    encoding: str  # attn_type
    half_loss: bool

    @property
    def encoding_label(self) -> str:
        return {
            "xl": "Ours",
            "shaw": "Shaw et al. 2018",
            "vaswani": "Vaswani et al. 2017",
            "alrfou": "Al-Rfou et al. 2018",
        }[self.encoding]


def variants(half_loss: bool = False) -> list[Variant]:
    group = [
        Variant("xl", True, "xl", False),
        Variant("shaw", True, "shaw", False),
        Variant("xl-norec", False, "xl", False),
        Variant("vanilla", False, "alrfou", False),
    ]
    if half_loss:
        group.insert(1, Variant("xl-half", True, "xl", True))
        group.append(Variant("vanilla-half", False, "alrfou", True))
    return group


@dataclass
class AblationSettings:
    preset: str = "small"
    steps: int | None = None
    batch_size: int | None = None
    tgt_len: int | None = None
    eval_lengths: list[int] | None = None
    eval_tokens: int | None = None
    half_loss: bool = False
    seed: int = 0
    lr: float | None = None

    def resolved(self) -> dict[str, Any]:
        """The preset's values with the explicit settings on top."""
        if self.preset in ABLATION_PRESETS:
            base = dict(ABLATION_PRESETS[self.preset])
            model = dict(base.pop("model"))
        elif self.preset in PRESETS:  # a library preset: its shape, small-run defaults
            model = {
                k: v
                for k, v in PRESETS[self.preset].model.items()
                if k in ("n_layer", "d_model", "n_head", "d_head", "d_inner", "dropout")
            }
            base = dict(ABLATION_PRESETS["small"])
            base.pop("model")
            base["tgt_len"] = PRESETS[self.preset].model.get("tgt_len", base["tgt_len"])
        else:
            # dict.fromkeys: one mention each ("debug" is both an ablation and a model preset)
            names = ", ".join(dict.fromkeys([*ABLATION_PRESETS, *PRESETS]))
            raise ConfigError(f"unknown ablation preset {self.preset!r}; choose from: {names}")
        for key in ("steps", "batch_size", "tgt_len", "eval_lengths", "eval_tokens", "lr"):
            value = getattr(self, key)
            if value is not None:
                base[key] = value
        for key in ("steps", "batch_size", "tgt_len", "eval_tokens"):
            if not isinstance(base[key], int) or base[key] < 1:
                raise ConfigError(f"{key} must be a positive integer, got {base[key]!r}")
        if not base["eval_lengths"] or min(base["eval_lengths"]) < 1:
            raise ConfigError(f"eval lengths must be positive, got {base['eval_lengths']}")
        if not base["lr"] > 0:
            raise ConfigError(f"lr must be positive, got {base['lr']}")
        base["model"] = model
        return base


@dataclass
class AblationRow:
    name: str
    recurrence: bool
    encoding: str
    loss: str  # "full" | "half"
    params: int
    train_loss: float  # mean of the last 10% of steps (nats, counted positions)
    init: float  # metric at the training condition
    best: float
    best_attn_len: int | str  # A of the best, or "train"
    by_attn_len: dict[str, float] = field(default_factory=dict)
    train_seconds: float = 0.0


@dataclass
class AblationResult:
    rows: list[AblationRow]
    metric: str  # "bpc", "bpb" or "ppl"
    settings: dict[str, Any]
    dataset: str
    seconds: float
    threads: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


EVAL_ROWS = 8  # rows of the validation stream: each starts without memory once


def variant_config(
    s: dict[str, Any],
    variant: Variant,
    *,
    dataset: str,
    data_dir: str | None,
    level: str | None,
    seed: int,
    progress: bool = False,
) -> TrainConfig:
    """The ``txlm train`` configuration of one model of the group (``s``: resolved settings).

    The model section lists every ModelConfig field, so the configuration means the same
    whatever preset ``txlm train --config`` starts from.
    """
    tgt = s["tgt_len"]
    model = ModelConfig(
        vocab_size=2,  # a stand-in: the data's vocabulary replaces it
        **s["model"],
        tgt_len=tgt,
        mem_len=tgt if variant.recurrence else 0,
        attn_type=variant.encoding,  # type: ignore[arg-type]
        # Shaw: one learned vector per distance seen in training (up to L + M); Al-Rfou:
        # one per position of a segment.
        n_positions=2 * tgt if variant.encoding == "shaw" else tgt,
        attn_impl="sdpa",
    ).to_dict()
    del model["vocab_size"]
    steps = s["steps"]
    return TrainConfig.from_dict(
        {
            "preset": "debug",  # a label only: the model section sets every field
            "model": model,
            "data": {
                "dataset": dataset,
                "data_dir": data_dir,
                "level": level,
                "batch_size": s["batch_size"],
            },
            "optim": {
                "lr": s["lr"],
                "schedule": "cosine",
                "warmup_steps": max(1, steps // 20),
                "max_steps": steps,
                "min_lr": 0.0,
                "clip": 0.25,
                "loss": "half" if variant.half_loss else "full",
            },
            # Validation at the end only, short: the table's own evaluation follows.
            "eval": {
                "eval_interval": 0,
                "max_eval_steps": 1,
                "final_eval": False,
                "sample_tokens": 0,
            },
            "run": {
                "seed": seed,
                "log_interval": 1,  # every step's loss: the train_loss column averages them
                "progress": progress,
                "tensorboard": False,
                "compile": False,
            },
        }
    )


def train_variant(config: TrainConfig, out: Path, *, device: str) -> tuple[Any, float]:
    """Train one model of the group with the trainer; (model, mean loss of the last 10% of
    steps)."""
    config.run.device = device
    trainer = Trainer(config, out, echo=False)
    trainer.fit()
    records = [r for r in trainer_records(out) if r["split"] == "train"]
    recent = records[-max(1, len(records) // 10) :]
    return trainer.model.eval(), float(np.mean([r["loss"] for r in recent]))


def trainer_records(out: Path) -> list[dict[str, Any]]:
    path = out / METRICS_FILE
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _dataset(data: str) -> tuple[str, str | None, str | None]:
    """(dataset name, data dir, level) for the trainer from a dataset name or prepared folder."""
    folder = Path(data)
    if not (folder / "meta.json").is_file():
        return data, None, None
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    name = meta.get("dataset")
    if name == "text" or not isinstance(name, str):
        raise ConfigError(f"{folder} holds a prepared text corpus: pass it as text:PATH")
    return name, str(folder.parent), meta.get("level")


def run_ablation(
    settings: AblationSettings,
    *,
    data: str = "shakespeare",
    data_dir: str | None = None,
    device: torch.device | str = "cpu",
    progress: bool = False,
    save_dir: str | Path | None = None,
) -> AblationResult:
    """Train and evaluate the group; the Table-6-shaped result.

    save_dir: keep every model's run (``save_dir/<variant name>``: ``best``, ``last``,
    metrics), e.g. to measure the group's RECL with ``txlm recl save_dir/<name>/best``.
    """
    start = time.perf_counter()
    s = settings.resolved()
    dataset, folder_dir, level = _dataset(data)
    data_dir = folder_dir or data_dir
    tgt = s["tgt_len"]
    corpus = open_corpus(dataset, data_dir, level=level)
    valid = np.asarray(corpus.split("valid")[: s["eval_tokens"] + 1])
    metric = corpus.metric  # bpc, bpb or ppl, as txlm train reports it
    rows = []
    with tempfile.TemporaryDirectory(prefix="txlm-ablate-") as scratch:
        runs = Path(save_dir) if save_dir is not None else Path(scratch)
        for v in variants(settings.half_loss):
            config = variant_config(
                s, v, dataset=dataset, data_dir=data_dir, level=level, seed=settings.seed,
                progress=progress,
            )  # fmt: skip
            t0 = time.perf_counter()
            model, train_loss = train_variant(config, runs / v.name, device=str(device))
            seconds = time.perf_counter() - t0

            def nll(model: Any = model, **lengths: Any) -> float:
                used = model.lengths.replace(**lengths)
                return evaluate_tokens(model, valid, batch_size=EVAL_ROWS, lengths=used)["loss"]

            init = nll(tgt_len=tgt, mem_len=model.config.mem_len, same_length=False)
            by_len = {
                str(a): nll(tgt_len=tgt, mem_len=a, same_length=True) for a in s["eval_lengths"]
            }
            best_key, best = min(by_len.items(), key=lambda kv: kv[1])
            best_len: int | str = int(best_key)
            if init <= best:
                best, best_len = init, "train"
            rows.append(
                AblationRow(
                    name=v.name,
                    recurrence=v.recurrence,
                    encoding=v.encoding_label,
                    loss="half" if v.half_loss else "full",
                    params=model.num_parameters(),
                    train_loss=train_loss,
                    init=corpus.metric_value(init, "valid"),
                    best=corpus.metric_value(best, "valid"),
                    best_attn_len=best_len,
                    by_attn_len={k: corpus.metric_value(x, "valid") for k, x in by_len.items()},
                    train_seconds=seconds,
                )
            )
            if progress:
                r = rows[-1]
                print(
                    f"{r.name}: init {r.init:.4f} best {r.best:.4f} (A={r.best_attn_len}) "
                    f"[{seconds:.0f} s]",
                    flush=True,
                )
    settings_out = {k: v for k, v in s.items()}
    settings_out["preset"] = settings.preset
    settings_out["half_loss"] = settings.half_loss
    settings_out["seed"] = settings.seed
    return AblationResult(
        rows=rows,
        metric=metric,
        settings=settings_out,
        dataset=str(corpus.meta.get("name", data)),
        seconds=time.perf_counter() - start,
        threads=torch.get_num_threads(),
    )


def format_table(res: AblationResult) -> str:
    s = res.settings
    m = res.metric
    lines = [
        f"Ablation (paper Table 6) on {res.dataset}: {s['steps']} steps x {s['batch_size']} x "
        f"{s['tgt_len']} tokens per model, {res.threads} threads, {res.seconds / 60:.1f} min",
        f"{'model':<13} {'recur':>5}  {'encoding':<20} {'loss':<4}  {'params':>8}  "
        f"{m + ' init':>9}  {m + ' best':>9}  {'attn len':>8}",
    ]
    for r in res.rows:
        lines.append(
            f"{r.name:<13} {'yes' if r.recurrence else 'no':>5}  {r.encoding:<20} {r.loss:<4}  "
            f"{r.params:>8,}  {r.init:>9.4f}  {r.best:>9.4f}  {r.best_attn_len!s:>8}"
        )
    lines.append(
        f"init: evaluated as trained (segment {s['tgt_len']}, training memory); best: over init "
        f"and attention lengths {s['eval_lengths']} (memory A, same_length); "
        f"{s['eval_tokens']} validation tokens"
    )
    return "\n".join(lines)


def plot_ablation(res: AblationResult, path) -> None:
    """Metric against evaluation attention length, one line per model (init as a marker)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in res.rows:
        xs = [int(k) for k in r.by_attn_len]
        line = ax.plot(xs, list(r.by_attn_len.values()), "o-", label=r.name)[0]
        ax.plot([res.settings["tgt_len"]], [r.init], "x", color=line.get_color(), ms=9)
    ax.set_xlabel("evaluation attention length (x: as trained)")
    ax.set_ylabel(res.metric)
    ax.set_title("Ablation: recurrence and positional encoding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
