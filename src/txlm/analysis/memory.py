"""Does the memory work? Copy accuracy against distance on the ``recall`` task.

Legend: L training segment length, M training memory, m evaluation memory, d distance from a
copy token back to its source (see txlm.data.recall), N tokens of the evaluation split.

The paper's Table 6 group (``txlm.analysis.ablation.variants``: XL, Shaw + recurrence, XL
without recurrence, the vanilla absolute-position model) plus the memory counterpart of every
absolute-position variant that lacks one is trained on the same task with the same trainer
as ``txlm train`` (``txlm.training.Trainer``), preset ``recall`` with the variant's encoding and
memory. Then each model reads the valid split with the ordinary streaming evaluation
(``txlm.inference.evaluate.stream_segments``; segments of L, memory carried) at m = M, 2M and 4M
(once,
m = 0, without recurrence), and every copy token is scored: its loss, and whether the argmax
prediction is right. Copies are bucketed by d in half-octaves.

A copy at distance d is in view of query i of a segment when d <= m + i: a model with working
memory should copy almost perfectly up to d = m and fall to chance (one of the values, or
one of the alphabet) beyond; without memory it should fall to chance past one segment. Models
with memory read segments of ``eval_tgt_len`` (8) so that the edge is nearly d = m; the
relative-sinusoid ones are also read with distances clamped to the training reach M + L.
The table buckets copies by d <= M, M < d <= 2M, 2M < d <= 4M, d > 4M; the figure by
half-octaves.

The evaluation stream is cut into ``rows`` contiguous rows that start with empty memory; a
copy whose source lies before its row's start is left out (no model could see it).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from txlm.analysis.ablation import Variant, variants
from txlm.checkpoints.checkpoint import load
from txlm.data import open_corpus
from txlm.data.recall import copy_distances
from txlm.errors import ConfigError
from txlm.inference.evaluate import stream_segments
from txlm.model import TransformerXL
from txlm.model.lengths import Lengths
from txlm.training import Trainer
from txlm.training.config import TrainConfig, apply_set, parse_set, preset_config

PRESET = "recall"
# The associative form of the recall task (txlm.data.recall.generate_pairs): a value stored
# under one of 32 keys is asked for 2 to 64 tokens later in train, up to 256 in valid.
# Its lookup is one step by content, which a 2-layer model learns in minutes on a CPU; the
# span form's "find my previous occurrence, read what followed" needs an induction circuit
# of two composed heads, which did not form in this budget (README, "Does the memory work?").
BENCH_TASK = "recall:keys=32,values=8,alphabet=302,min_dist=2,valid=100000"


def bench_variants() -> list[Variant]:
    """Table 6's group, and each absolute-position variant also with memory."""
    group = variants()
    out: list[Variant] = []
    for v in group:
        out.append(v)
        absolute = v.encoding in ("vaswani", "alrfou")
        if absolute and not v.recurrence:
            out.append(dataclasses.replace(v, name=f"{v.name}-mem", recurrence=True))
    return out


@dataclass
class MemoryBenchSettings:
    dataset: str = BENCH_TASK  # a recall[:k=v,...] dataset name or a prepared recall folder
    steps: int | None = None  # None: the preset's
    batch_size: int | None = None
    lr: float | None = None
    tgt_len: int | None = None
    mem_len: int | None = None
    eval_multiples: tuple[int, ...] = (1, 2, 4)
    # Segment length of the evaluation of models with memory (None: the training one). A
    # short one makes "in view" sharp: query i of a segment sees m + i tokens back.
    eval_tgt_len: int | None = 8
    # Relative-sinusoid ("xl") models at evaluation: "none" leaves every distance its own
    # encoding, "train" clamps distances to the training reach M + L (farther ones share the
    # farthest trained encoding), "both" evaluates each way.
    clamp: str = "both"
    eval_tokens: int | None = None  # valid tokens evaluated (None: the whole split)
    rows: int = 8  # evaluation rows (batch)
    seed: int = 0
    only: tuple[str, ...] = ()  # variant names to run (empty: all)
    sets: tuple[str, ...] = ()  # extra key=value overrides for every variant's TrainConfig

    def base_config(self, data_dir: str | None, device: str) -> TrainConfig:
        c = preset_config(PRESET)
        overrides: dict[str, Any] = {
            "data.dataset": self.dataset,
            "data.data_dir": data_dir,
            "optim.max_steps": self.steps,
            "data.batch_size": self.batch_size,
            "optim.lr": self.lr,
            "model.tgt_len": self.tgt_len,
            "model.mem_len": self.mem_len,
            "run.seed": self.seed,
            "run.device": device,
            "run.progress": False,
            "run.tensorboard": False,
            "eval.final_eval": False,
        }
        for key, value in overrides.items():
            if value is not None:
                apply_set(c, key, value)
        for item in self.sets:
            apply_set(c, *parse_set(item))
        c.validate()
        return c


def variant_config(base: TrainConfig, v: Variant) -> TrainConfig:
    """The base configuration with the variant's encoding and memory (mem_len 0: none)."""
    c = TrainConfig.from_dict(base.to_dict())
    tgt = int(c.model["tgt_len"])
    mem = int(c.model["mem_len"]) if v.recurrence else 0
    if v.half_loss:
        raise ConfigError("the half-loss variants are not part of the memory benchmark")
    c.model.update(attn_type=v.encoding, mem_len=mem)
    # Learned tables cover what training shows: Shaw one vector per distance (up to M + L),
    # Al-Rfou one per position of a segment. Longer evaluation reuses the last entry.
    if v.encoding == "shaw":
        c.model["n_positions"] = tgt + mem
    elif v.encoding == "alrfou":
        c.model["n_positions"] = tgt
    c.validate()
    return c


def distance_bins(min_dist: int, max_dist: int) -> list[int]:
    """Half-octave bucket edges from ``min_dist`` to ``max_dist + 1`` (the last one closed)."""
    edges = [min_dist]
    k = 1
    while edges[-1] <= max_dist:
        edges.append(max(edges[-1] + 1, round(min_dist * 2 ** (k / 2))))
        k += 1
    edges[-1] = max_dist + 1
    return edges


def chance(spec: dict[str, Any]) -> float:
    """A blind guess's copy accuracy: one of the values, or one of the alphabet."""
    return 1.0 / int(spec["values"] if spec.get("keys") else spec["alphabet"])


def memory_reach_bins(min_dist: int, mem_len: int, max_dist: int) -> list[int]:
    """Coarse bucket edges d <= M, M < d <= 2M, 2M < d <= 4M, d > 4M (empty ones left out)."""
    edges = [min_dist] + [k * mem_len + 1 for k in (1, 2, 4) if min_dist < k * mem_len + 1]
    edges = [e for e in edges if e <= max_dist]
    return [*edges, max_dist + 1]


@dataclass
class CopyProfile:
    """One model at one evaluation memory: copy accuracy and loss per distance bucket."""

    variant: str
    train_mem: int
    eval_mem: int
    accuracy: list[float | None]  # per bucket (None when it holds no copy)
    loss: list[float | None]  # mean NLL (nats) of copy tokens per bucket
    count: list[int]
    bpc: float  # over every scored token of the split
    copy_bpc: float | None  # over the copy tokens in view of this memory (d <= m)
    eval_tgt_len: int = 0  # segment length of the evaluation
    clamp_len: int = -1  # > 0: relative distances beyond it shared one encoding
    # the same copies in the coarse reach buckets (MemoryBenchResult.reach_bins)
    reach_accuracy: list[float | None] = field(default_factory=list)
    reach_count: list[int] = field(default_factory=list)
    seconds: float = 0.0


@torch.no_grad()
def copy_profile(
    model: TransformerXL,
    tokens: np.ndarray,
    distances: np.ndarray,
    bins: list[int],
    *,
    mem_len: int,
    rows: int = 8,
    variant: str = "",
    train_mem: int = 0,
    tgt_len: int | None = None,
    clamp_len: int = -1,
    reach_bins: list[int] | None = None,
) -> CopyProfile:
    """Stream ``tokens`` with memory ``mem_len`` and score every copy token by distance.

    ``tgt_len``: evaluation segment length (None: the model's); ``clamp_len`` > 0: distances
    beyond it share one encoding; ``reach_bins``: a second, coarse set of distance buckets.
    """
    start = time.perf_counter()
    n = len(tokens)
    row_len = math.ceil((n - 1) / rows)
    nll = np.full(n, np.nan)
    right = np.zeros(n, dtype=bool)
    segments = stream_segments(
        model, tokens, batch_size=rows,
        lengths=Lengths.of(
            model.config, tgt_len=tgt_len, mem_len=mem_len, clamp_len=clamp_len, same_length=False
        ),
    )  # fmt: skip
    # the ordinary streaming evaluation; labels[b, c] is token b * row_len + start + c + 1
    for seg in segments:
        hidden, labels = seg.out.hidden, seg.labels
        log_probs = model.softmax.log_prob(hidden.reshape(-1, hidden.size(-1)))
        log_probs = log_probs.view(*labels.shape, -1)
        safe = labels.clamp(min=0)
        token_nll = -log_probs.gather(-1, safe[..., None])[..., 0]
        hit = log_probs.argmax(-1) == safe
        b, c = torch.nonzero(labels != -100, as_tuple=True)
        index = (b * row_len + seg.start + c + 1).cpu().numpy()
        nll[index] = token_nll[b, c].double().cpu().numpy()
        right[index] = hit[b, c].cpu().numpy()
    scored = ~np.isnan(nll)
    position = np.arange(n)
    row_start = ((position - 1) // row_len) * row_len  # the row's first input token
    dist = np.asarray(distances, dtype=np.int64)
    is_copy = scored & (dist > 0) & (position - dist >= row_start)

    def buckets(edges: list[int]) -> tuple[list[float | None], list[float | None], list[int]]:
        accuracy, loss, count = [], [], []
        for lo, hi in itertools.pairwise(edges):
            sel = is_copy & (dist >= lo) & (dist < hi)
            k = int(sel.sum())
            count.append(k)
            accuracy.append(float(right[sel].mean()) if k else None)
            loss.append(float(nll[sel].mean()) if k else None)
        return accuracy, loss, count

    accuracy, loss, count = buckets(bins)
    reach_accuracy, _, reach_count = buckets(reach_bins) if reach_bins else ([], [], [])
    in_view = is_copy & (dist <= mem_len)
    return CopyProfile(
        variant=variant,
        train_mem=train_mem,
        eval_mem=mem_len,
        accuracy=accuracy,
        loss=loss,
        count=count,
        bpc=float(nll[scored].mean() / math.log(2)),
        copy_bpc=float(nll[in_view].mean() / math.log(2)) if in_view.any() else None,
        eval_tgt_len=int(tgt_len or model.config.tgt_len),
        clamp_len=clamp_len,
        reach_accuracy=reach_accuracy,
        reach_count=reach_count,
        seconds=time.perf_counter() - start,
    )


@dataclass
class TrainedVariant:
    name: str
    recurrence: bool
    encoding: str
    params: int
    train_mem: int
    checkpoint: str
    train_seconds: float
    final_train_loss: float | None


@dataclass
class MemoryBenchResult:
    dataset: str
    spec: dict[str, Any]
    chance: float  # a blind guess's accuracy (txlm.analysis.memory.chance)
    tgt_len: int
    mem_len: int
    bins: list[int]
    reach_bins: list[int]
    variants: list[TrainedVariant]
    profiles: list[CopyProfile]
    settings: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    threads: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _final_train_loss(out_dir: Path) -> float | None:
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    train = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    train = [r for r in train if r.get("split") == "train"]
    return float(train[-1]["loss"]) if train else None


def run_memory_bench(
    settings: MemoryBenchSettings,
    runs_dir: str | Path,
    *,
    data_dir: str | None = None,
    device: str = "cpu",
    log=None,
) -> MemoryBenchResult:
    """Train every variant with ``txlm.training.Trainer`` into ``runs_dir/NAME``; profile each."""
    start = time.perf_counter()
    if settings.clamp not in ("none", "train", "both"):
        raise ConfigError(f"clamp must be none, train or both, got {settings.clamp!r}")
    base = settings.base_config(data_dir, device)
    corpus = open_corpus(base.data.dataset, data_dir)
    folder = corpus.path
    if corpus.meta.get("dataset") != "recall":
        raise ConfigError(f"{folder} is not a recall dataset (txlm prepare recall)")
    spec = corpus.meta["corpus"]["spec"]
    tokens = np.asarray(corpus.split("valid"), dtype=np.int64)
    distances = np.asarray(copy_distances(folder, "valid"))
    if settings.eval_tokens is not None:
        tokens, distances = tokens[: settings.eval_tokens], distances[: settings.eval_tokens]
    bins = distance_bins(int(spec["min_dist"]), int(spec["max_dist"]))
    reach_bins = memory_reach_bins(
        int(spec["min_dist"]), base.model["mem_len"], int(spec["max_dist"])
    )
    group = bench_variants()
    if settings.only:
        unknown = set(settings.only) - {v.name for v in group}
        if unknown:
            names = ", ".join(v.name for v in group)
            raise ConfigError(
                f"unknown variant(s) {', '.join(sorted(unknown))}; choose from {names}"
            )
        group = [v for v in group if v.name in settings.only]
    runs = Path(runs_dir)
    trained, profiles = [], []
    for v in group:
        config = variant_config(base, v)
        out = runs / v.name
        t0 = time.perf_counter()
        trainer = Trainer(config, out, echo=False)
        trainer.fit()
        seconds = time.perf_counter() - t0
        model = load(out / "best", device=device)
        train_mem = model.config.mem_len
        trained.append(
            TrainedVariant(
                name=v.name,
                recurrence=v.recurrence,
                encoding=v.encoding_label,
                params=model.num_parameters(),
                train_mem=train_mem,
                checkpoint=str(out / "best"),
                train_seconds=seconds,
                final_train_loss=_final_train_loss(out),
            )
        )
        if log:
            log(f"{v.name}: trained {config.optim.max_steps} steps in {seconds:.0f} s")
        mems = sorted({k * train_mem for k in settings.eval_multiples}) if train_mem else [0]
        eval_tgt = settings.eval_tgt_len if train_mem else None
        reach = model.config.tgt_len + train_mem
        clamps = {"none": [-1], "train": [reach], "both": [-1, reach]}[settings.clamp]
        if v.encoding != "xl" or not train_mem:  # no sinusoid distances, or none past reach
            clamps = [-1]
        for m, clamp in itertools.product(mems, clamps):
            p = copy_profile(
                model, tokens, distances, bins, mem_len=m, rows=settings.rows,
                variant=v.name, train_mem=train_mem, tgt_len=eval_tgt, clamp_len=clamp,
                reach_bins=reach_bins,
            )  # fmt: skip
            profiles.append(p)
            if log:
                log(f"  memory {m}{_clamp_note(p)}: " + _accuracy_cells(p))
    model_c = base.model_config(len(corpus.vocab))
    return MemoryBenchResult(
        dataset=str(corpus.meta.get("name")),
        spec=spec,
        chance=chance(spec),
        tgt_len=model_c.tgt_len,
        mem_len=model_c.mem_len,
        bins=bins,
        reach_bins=reach_bins,
        variants=trained,
        profiles=profiles,
        settings={
            "train": base.to_dict(),
            "eval_multiples": list(settings.eval_multiples),
            "eval_tgt_len": settings.eval_tgt_len,
            "clamp": settings.clamp,
            "eval_tokens": len(tokens),
            "rows": settings.rows,
        },
        seconds=time.perf_counter() - start,
        threads=torch.get_num_threads(),
    )


def _bucket_labels(bins: list[int]) -> list[str]:
    return [f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(bins)]


def _clamp_note(p: CopyProfile) -> str:
    return f" clamp {p.clamp_len}" if p.clamp_len > 0 else ""


def _accuracy_cells(p: CopyProfile) -> str:
    return " ".join("  -  " if a is None else f"{a:5.3f}" for a in p.accuracy)


def _reach_labels(res: MemoryBenchResult) -> list[str]:
    m = res.mem_len
    names = {m + 1: f"d<={m}", 2 * m + 1: f"{m}<d<={2 * m}", 4 * m + 1: f"{2 * m}<d<={4 * m}"}
    return [names.get(hi, f"d>{lo - 1}") for lo, hi in itertools.pairwise(res.reach_bins)]


def _cells(values: list[float | None], width: int) -> str:
    return " ".join(f"{'-':>{width}}" if a is None else f"{a:>{width}.3f}" for a in values)


def format_table(res: MemoryBenchResult) -> str:
    s = res.spec
    if s.get("keys"):
        task = f"{s['keys']} keys x {s['values']} values"
    else:
        lengths = "" if s.get("min_span") is None else f"{s['min_span']}-"
        task = f"alphabet {s['alphabet']}, spans of {lengths}{s['span']}"
    lines = [
        f"Copy accuracy by distance on {res.dataset} ({task}, chance "
        f"{res.chance:.3f}); trained with segments of "
        f"{res.tgt_len} and memory M={res.mem_len}; {res.seconds / 60:.1f} min, "
        f"{res.threads} threads",
    ]
    head = f"{'model':<12} {'mem':>4} {'seg':>4} {'clamp':>5}  {'bpc':>6}  "
    reach = _reach_labels(res)
    w = max(6, *(len(x) for x in reach))
    lines.append(head + " ".join(f"{x:>{w}}" for x in reach))
    for p in res.profiles:
        clamp = str(p.clamp_len) if p.clamp_len > 0 else "-"
        lines.append(
            f"{p.variant:<12} {p.eval_mem:>4} {p.eval_tgt_len:>4} {clamp:>5}  {p.bpc:>6.3f}  "
            + _cells(p.reach_accuracy, w)
        )
    counts = res.profiles[0].reach_count if res.profiles else []
    lines.append(
        f"{'copies':<12} {'':>4} {'':>4} {'':>5}  {'':>6}  " + " ".join(f"{c:>{w}}" for c in counts)
    )
    labels = _bucket_labels(res.bins)
    width = max(6, *(len(x) for x in labels))
    lines += ["", "half-octave buckets (the figure's points):"]
    lines.append(
        f"{'model':<12} {'mem':>4} {'clamp':>5}  " + " ".join(f"{x:>{width}}" for x in labels)
    )
    for p in res.profiles:
        clamp = str(p.clamp_len) if p.clamp_len > 0 else "-"
        lines.append(f"{p.variant:<12} {p.eval_mem:>4} {clamp:>5}  " + _cells(p.accuracy, width))
    counts = res.profiles[0].count if res.profiles else []
    lines.append(f"{'copies':<12} {'':>4} {'':>5}  " + " ".join(f"{c:>{width}}" for c in counts))
    lines.append(
        "d: distance back to the source (tokens); mem: evaluation memory (training memory x "
        "1, 2, 4; 0 without recurrence); seg: evaluation segment length; clamp: relative "
        "distances beyond it share one encoding; bpc over all tokens of the split"
    )
    return "\n".join(lines)


def plot_memory(res: MemoryBenchResult, path) -> None:
    """Copy accuracy against distance: one line per variant and evaluation memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    centers = [math.sqrt(lo * (hi - 1)) for lo, hi in zip(res.bins[:-1], res.bins[1:], strict=True)]
    fig, ax = plt.subplots(figsize=(8, 5))
    names = list(dict.fromkeys(p.variant for p in res.profiles))
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    styles = ["-", "--", ":", "-."]
    for p in res.profiles:
        k = 0 if p.train_mem == 0 else round(math.log2(max(1, p.eval_mem // p.train_mem)))
        ax.plot(
            centers,
            # a bucket of a handful of copies (the range's rounded-up end) is noise, not a point
            [
                math.nan if a is None or k < 20 else a
                for a, k in zip(p.accuracy, p.count, strict=True)
            ],
            styles[k % len(styles)],
            marker="s" if p.clamp_len > 0 else "o",
            ms=3,
            color=colors[p.variant],
            label=f"{p.variant}, memory {p.eval_mem}" + (", clamped" if p.clamp_len > 0 else ""),
        )
    marks: dict[int, str] = {}
    for x, text in ((res.tgt_len, "L"), (res.mem_len, "M"), (2 * res.mem_len, "2M"),
                    (4 * res.mem_len, "4M")):  # fmt: skip
        if x > 0:
            marks[x] = f"{marks[x]}={text}" if x in marks else text
    for x, text in marks.items():
        ax.axvline(x, color="grey", lw=0.6, ls=":")
        ax.text(x, 1.02, text, ha="center", fontsize=8, color="grey")
    ax.axhline(res.chance, color="grey", lw=0.6)
    ax.set_xscale("log")
    ax.set_xticks(res.bins[:-1], [str(b) for b in res.bins[:-1]], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("distance back to the source (tokens)")
    ax.set_ylabel("copy accuracy (argmax)")
    ax.set_ylim(-0.02, 1.08)
    ax.set_title(
        f"Does the memory work? recall task, trained with L={res.tgt_len}, M={res.mem_len}"
    )
    ax.legend(fontsize=7, ncol=2, loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
