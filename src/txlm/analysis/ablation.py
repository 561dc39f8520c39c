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

Training is a small self-contained loop (Adam, linear warm-up then cosine to 0, clip 0.25,
the paper's optimiser): half loss is an ablation-only objective, and the group must see the
same batches in the same order, which a fixed seed and one StreamIterator layout give.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from txlm.config import PRESETS, ModelConfig
from txlm.errors import ConfigError
from txlm.model import TransformerXL

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
    metric: str  # "bpc" or "ppl"
    settings: dict[str, Any]
    dataset: str
    seconds: float
    threads: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _metric(nll: float, metric: str) -> float:
    return nll / math.log(2) if metric == "bpc" else math.exp(nll)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine from ``peak`` to 0 at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * peak * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_variant(
    config: ModelConfig,
    variant: Variant,
    tokens: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    device: torch.device,
    progress: bool = False,
) -> tuple[TransformerXL, float]:
    """Train one model of the group; returns (model, mean loss of the last 10% of steps)."""
    from tqdm import tqdm

    from txlm.data import StreamIterator

    torch.manual_seed(seed)  # the same initial draw for every variant where shapes agree
    model = TransformerXL(config).to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    stream = StreamIterator(tokens, batch_size, config.tgt_len, seed=seed, device=device)
    warmup = max(1, steps // 20)
    half = config.tgt_len // 2
    mems = None
    recent: list[float] = []
    batches = iter(stream)
    bar = tqdm(total=steps, desc=variant.name, unit="step", disable=not progress, leave=False)
    for step in range(steps):
        try:
            batch = next(batches)
        except StopIteration:  # an epoch ended: the next starts every row afresh
            batches, mems = iter(stream), None
            batch = next(batches)
        if batch.index == 0:
            mems = None
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        labels = batch.labels
        if variant.half_loss:  # the paper's "half" loss: only the recent half of positions
            labels = labels.clone()
            labels[:, :half] = -100
        out = model(batch.input_ids, mems=mems if variant.recurrence else None, labels=labels)
        counted = (labels != -100).sum().clamp(min=1)
        loss = out.losses.sum() / counted
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        mems = out.mems if variant.recurrence else None
        value = loss.item()
        if step >= steps - max(1, steps // 10):
            recent.append(value)
        bar.update(1)
        rate = (bar.format_dict["rate"] or 0.0) * batch.num_tokens
        bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{rate:.0f}")
    bar.close()
    return model.eval(), float(np.mean(recent))


@torch.no_grad()
def evaluate_nll(
    model: TransformerXL,
    tokens: np.ndarray,
    *,
    tgt_len: int,
    mem_len: int,
    same_length: bool,
    rows: int = 8,
) -> float:
    """Mean NLL (nats) over ``tokens`` split into ``rows`` contiguous streams.

    Every row is read in segments of ``tgt_len`` with a memory of ``mem_len`` states; the
    rows only batch the work (each row's first segment starts without memory).
    """
    original = model.config
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    per_row = (ids.numel() - 1) // rows
    if per_row < 1:
        raise ConfigError(f"{ids.numel()} evaluation tokens are too few for {rows} rows")
    inp = torch.stack([ids[r * per_row : (r + 1) * per_row] for r in range(rows)]).to(device)
    lab = torch.stack([ids[r * per_row + 1 : (r + 1) * per_row + 1] for r in range(rows)])
    lab = lab.to(device)
    total, count = 0.0, 0
    try:
        model.set_lengths(mem_len=mem_len, same_length=same_length)
        mems = None
        for s in range(0, per_row, tgt_len):
            out = model(inp[:, s : s + tgt_len], mems=mems, labels=lab[:, s : s + tgt_len])
            total += float(out.losses.double().sum())
            count += out.losses.numel()
            mems = out.mems if mem_len > 0 else None
    finally:
        model.config = original
    return total / count


def _corpus(data: str, data_dir: str | None):
    from txlm.data import load_prepared, prepare_dataset
    from txlm.data.prepare import default_data_dir

    folder = Path(data)
    if not (folder / "meta.json").is_file():
        folder = prepare_dataset(data, data_dir or default_data_dir(), progress=False)
    return load_prepared(folder)


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

    save_dir: also save every trained model as a checkpoint ``save_dir/<variant name>`` (with
    the corpus's vocabulary), e.g. to measure the group's RECL with ``txlm recl``.
    """
    start = time.perf_counter()
    s = settings.resolved()
    device = torch.device(device)
    corpus = _corpus(data, data_dir)
    train_tokens = corpus.split("train")
    valid = np.asarray(corpus.split("valid")[: s["eval_tokens"] + 1])
    metric = corpus.metric if corpus.metric in ("bpc", "ppl") else "ppl"
    tgt = s["tgt_len"]
    rows = []
    for v in variants(settings.half_loss):
        config = ModelConfig(
            vocab_size=len(corpus.vocab),
            **s["model"],
            tgt_len=tgt,
            mem_len=tgt if v.recurrence else 0,
            attn_type=v.encoding,  # type: ignore[arg-type]
            # Shaw: one learned vector per distance seen in training (up to L + M); Al-Rfou:
            # one per position of a segment.
            n_positions=2 * tgt if v.encoding == "shaw" else tgt,
            attn_impl="sdpa",
        )
        t0 = time.perf_counter()
        model, train_loss = train_variant(
            config, v, train_tokens, steps=s["steps"], batch_size=s["batch_size"], lr=s["lr"],
            seed=settings.seed, device=device, progress=progress,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        if save_dir is not None:
            from txlm.checkpoint import save

            save(
                model,
                Path(save_dir) / v.name,
                vocab_json=corpus.vocab.to_json(),
                extra_config={
                    "ablation": {**asdict(v), "steps": s["steps"], "seed": settings.seed}
                },
            )
        init = evaluate_nll(model, valid, tgt_len=tgt, mem_len=config.mem_len, same_length=False)
        by_len = {
            str(a): evaluate_nll(model, valid, tgt_len=tgt, mem_len=a, same_length=True)
            for a in s["eval_lengths"]
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
                init=_metric(init, metric),
                best=_metric(best, metric),
                best_attn_len=best_len,
                by_attn_len={k: _metric(x, metric) for k, x in by_len.items()},
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
