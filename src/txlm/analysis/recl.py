"""Relative Effective Context Length (paper Sec. 4.3 and Appendix C).

Legend: N models in the group, C context lengths c_0 < c_1 < ... (step Delta), T target tokens.

``losses[i, k, t]`` = l_i(c_k, t) = -log P_{m_i}(x_t | x_{t-1}, ..., x_{t-c_k}).

    b(c, t)       = min_i l_i(c, t)                                   (group baseline)
    T             = the top-r fraction of positions t with the largest b(c, t)
    f_i(c, c')    = mean_{t in T} min(b(c, t), l_i(c', t))            (relative loss)
    g_i(c, c')    = (exp f_i(c, c) - exp f_i(c, c')) / exp f_i(c, c)  (relative gain)
    RECL_i        : start at c = c_0; while g_i(c, c + Delta) >= 0.01 move to c + Delta;
                    the first c whose gain falls below the threshold is the RECL.

Since b(c, t) <= l_i(c, t), f_i(c, c) is the mean of the baseline over T: the same for every
model of the group, which is what makes the comparison fair. When the gain never falls below
the threshold inside the measured grid, the RECL is the largest c measured and is flagged as a
lower bound (``reached_end``).

Per-token losses (``token_losses``): each target is scored with exactly c tokens of context —
one window x_{t-c} .. x_{t-1} per target, no memory, only the last position scored. For a
causal model one pass over the window computes the same states as segment-wise evaluation
with a memory that holds the whole window (contract 5 of the design), so this is the
model's own recurrent computation with its context cut at c. The same targets are scored at
every c (all t >= c_max), so the losses are comparable across lengths.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from txlm.checkpoints.checkpoint import Checkpoint
from txlm.errors import CheckpointError, ConfigError
from txlm.model import TransformerXL
from txlm.model.modes import evaluating

THRESHOLD = 0.01
RATIOS = (0.1, 0.5, 1.0)


def _check(losses: np.ndarray) -> np.ndarray:
    losses = np.asarray(losses, dtype=np.float64)
    if losses.ndim != 3 or min(losses.shape) < 1:
        raise ConfigError(f"losses must be [models, contexts, tokens], got {losses.shape}")
    return losses


def baseline(losses: np.ndarray, k: int) -> np.ndarray:
    """b(c_k, t) [T]: the group's smallest loss at context c_k."""
    return _check(losses)[:, k, :].min(axis=0)


def hard_positions(base: np.ndarray, r: float) -> np.ndarray:
    """Indices of the top-r positions with the largest baseline loss (at least one).

    Ties are broken by position (stable sort), so the set is deterministic.
    """
    if not 0.0 < r <= 1.0:
        raise ConfigError(f"r must be in (0, 1], got {r}")
    n = max(1, math.ceil(r * base.size - 1e-9))
    order = np.argsort(-base, kind="stable")
    return np.sort(order[:n])


def relative_loss(losses: np.ndarray, i: int, k: int, k2: int, r: float) -> float:
    """f_i(c_k, c_k2) over the top-r hard positions of b(c_k, .)."""
    losses = _check(losses)
    base = baseline(losses, k)
    pos = hard_positions(base, r)
    return float(np.minimum(base[pos], losses[i, k2, pos]).mean())


def relative_gain(losses: np.ndarray, i: int, k: int, k2: int, r: float) -> float:
    """g_i(c_k, c_k2) = 1 - exp(f_i(c_k, c_k2) - f_i(c_k, c_k))."""
    short = relative_loss(losses, i, k, k, r)
    long = relative_loss(losses, i, k, k2, r)
    return (math.exp(short) - math.exp(long)) / math.exp(short)


def unnormalised_gain(losses: np.ndarray, i: int, k: int, k2: int, r: float) -> float:
    """exp f_i(c, c) - exp f_i(c, c'): the quantity of the paper's Figure 3."""
    return math.exp(relative_loss(losses, i, k, k, r)) - math.exp(
        relative_loss(losses, i, k, k2, r)
    )


def recl_of(
    losses: np.ndarray, i: int, contexts: Sequence[int], r: float, threshold: float = THRESHOLD
) -> tuple[int, bool]:
    """Appendix C's thresholding for model i: (RECL, reached_end).

    ``contexts`` are the measured c, evenly spaced by Delta; step 1 starts at contexts[0].
    """
    losses = _check(losses)
    if len(contexts) != losses.shape[1]:
        raise ConfigError(f"{len(contexts)} contexts for {losses.shape[1]} loss columns")
    for k in range(len(contexts) - 1):
        if relative_gain(losses, i, k, k + 1, r) < threshold:
            return int(contexts[k]), False
    return int(contexts[-1]), True


@dataclass
class ReclResult:
    names: list[str]
    contexts: list[int]
    ratios: list[float]
    n_tokens: int
    recl: dict[str, dict[str, int]]  # ratio -> model -> RECL
    reached_end: dict[str, dict[str, bool]]  # ratio -> model -> gain never fell below threshold
    gains: dict[str, dict[str, list[float]]]  # ratio -> model -> g(c_k, c_k+1) per k
    unnormalised: dict[str, dict[str, list[float]]]  # ratio -> model -> Figure 3 values
    perplexity: dict[str, list[float]]  # model -> exp(mean loss) at each c: Figure 4
    threshold: float = THRESHOLD
    method: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def compute_recl(
    losses: np.ndarray,
    contexts: Sequence[int],
    names: Sequence[str],
    ratios: Sequence[float] = RATIOS,
    threshold: float = THRESHOLD,
    method: str = "",
) -> ReclResult:
    """Everything of Appendix C for one model group from its per-token losses [N, C, T]."""
    losses = _check(losses)
    n, c, t = losses.shape
    if len(names) != n:
        raise ConfigError(f"{len(names)} names for {n} models")
    contexts = [int(x) for x in contexts]
    if len(contexts) != c or contexts != sorted(set(contexts)):
        raise ConfigError(f"contexts must be {c} increasing lengths, got {contexts}")
    res = ReclResult(
        names=list(names),
        contexts=contexts,
        ratios=[float(r) for r in ratios],
        n_tokens=t,
        recl={},
        reached_end={},
        gains={},
        unnormalised={},
        perplexity={
            name: [float(np.exp(losses[i, k].mean())) for k in range(c)]
            for i, name in enumerate(names)
        },
        threshold=threshold,
        method=method,
    )
    for r in ratios:
        key = str(float(r))
        res.recl[key], res.reached_end[key], res.gains[key], res.unnormalised[key] = {}, {}, {}, {}
        for i, name in enumerate(names):
            value, end = recl_of(losses, i, contexts, r, threshold)
            res.recl[key][name], res.reached_end[key][name] = value, end
            res.gains[key][name] = [relative_gain(losses, i, k, k + 1, r) for k in range(c - 1)]
            res.unnormalised[key][name] = [
                unnormalised_gain(losses, i, k, k + 1, r) for k in range(c - 1)
            ]
    return res


# -- the model group ---------------------------------------------------------------------------
def group_names(checkpoints: Sequence[str | Path], names: Sequence[str] | None = None) -> list[str]:
    """One distinct name per checkpoint: ``names``, else each run's folder (RUN for RUN/best
    or RUN/last, else the checkpoint's own folder name)."""
    if names is None:
        names = [_run_name(Path(p)) for p in checkpoints]
    names = list(names)
    if len(names) != len(checkpoints):
        raise ConfigError(f"{len(names)} --names for {len(checkpoints)} checkpoints")
    if len(set(names)) != len(names):
        raise ConfigError(f"model names must differ, got {names} (use --names)")
    return names


def _run_name(p: Path) -> str:
    return p.parent.name if p.name in ("best", "last") and p.parent.name else p.name


def check_contexts(contexts: Sequence[int]) -> None:
    """RECL compares each context with the next: at least two, one step Delta apart."""
    if len(contexts) < 2:
        raise ConfigError("RECL needs at least two context lengths")
    steps = {b - a for a, b in itertools.pairwise(contexts)}
    if len(steps) != 1 or min(contexts) < 1:
        raise ConfigError(
            f"context lengths must be positive and evenly spaced (one step Delta), got "
            f"{list(contexts)}"
        )


def check_same_vocabulary(checkpoints: Sequence[Checkpoint]) -> None:
    """Every model of the group must read the same token ids: one vocabulary."""
    first = checkpoints[0].vocab_fingerprint
    for other in checkpoints[1:]:
        found = other.vocab_fingerprint
        if first is not None and found is not None and found != first:
            raise CheckpointError(f"{other.path} has another vocabulary than {checkpoints[0].path}")


# -- per-token losses from a model ------------------------------------------------------------
def target_positions(n_stream: int, max_context: int, n_targets: int) -> np.ndarray:
    """Evenly spaced targets t in [max_context, n_stream - 1], each with max_context before it."""
    if n_stream - 1 < max_context:
        raise ConfigError(
            f"the text has {n_stream} tokens; context {max_context} needs at least "
            f"{max_context + 1}"
        )
    available = n_stream - max_context
    n = min(n_targets, available)
    return np.unique(np.linspace(max_context, n_stream - 1, n).round().astype(np.int64))


@torch.no_grad()
def token_losses(
    model: TransformerXL,
    stream: Sequence[int] | torch.Tensor,
    contexts: Sequence[int],
    targets: np.ndarray,
    *,
    batch_size: int = 32,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """[C, T] losses l(c, t) (nats): target t scored from exactly the c tokens before it."""
    with evaluating(model):
        ids = torch.as_tensor(stream, dtype=torch.long).flatten()
        device = next(model.parameters()).device
        out = np.zeros((len(contexts), len(targets)), dtype=np.float64)
        tgt = torch.as_tensor(targets, dtype=torch.long)
        # No memory is used or kept: a single window is the whole context.
        lengths = model.lengths.replace(mem_len=0, same_length=False)
        for k, c in enumerate(contexts):
            offsets = torch.arange(-c, 0)
            for s in range(0, len(tgt), batch_size):
                t = tgt[s : s + batch_size]
                windows = ids[t[:, None] + offsets[None, :]].to(device)  # [b, c]
                hidden, _, _ = model.transform(windows, lengths=lengths)
                nll = model.softmax.nll(hidden[:, -1], ids[t].to(device))
                out[k, s : s + len(t)] = nll.double().cpu().numpy()
                if progress:
                    progress(int(t.numel()) * c)
        return out


# -- output -----------------------------------------------------------------------------------
def format_table(res: ReclResult) -> str:
    width = max(8, *(len(n) for n in res.names))
    head = f"{'model':<{width}}" + "".join(f"  {'r=' + str(r):>9}" for r in res.ratios)
    lines = [
        f"RECL (Appendix C), contexts {res.contexts[0]}..{res.contexts[-1]} step "
        f"{res.contexts[1] - res.contexts[0] if len(res.contexts) > 1 else 0}, "
        f"{res.n_tokens} target tokens, gain threshold {res.threshold}",
        head,
    ]
    for name in res.names:
        cells = []
        for r in res.ratios:
            key = str(r)
            mark = "+" if res.reached_end[key][name] else ""
            cells.append(f"  {str(res.recl[key][name]) + mark:>9}")
        lines.append(f"{name:<{width}}" + "".join(cells))
    lines.append("'+': the gain never fell below the threshold: a lower bound (grid too short)")
    lines.append("perplexity at each context (Figure 4):")
    lines.append(f"{'model':<{width}}" + "".join(f"  {c:>8}" for c in res.contexts))
    for name in res.names:
        lines.append(f"{name:<{width}}" + "".join(f"  {p:>8.3f}" for p in res.perplexity[name]))
    return "\n".join(lines)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_gains(res: ReclResult, path) -> None:
    """Figure 3: exp f(c, c) - exp f(c, c + Delta) against c, one panel per r."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(res.ratios), figsize=(4.5 * len(res.ratios), 3.5))
    axes = np.atleast_1d(axes)
    for ax, r in zip(axes, res.ratios, strict=True):
        for name in res.names:
            ax.plot(res.contexts[:-1], res.unnormalised[str(r)][name], "o-", label=name)
        ax.set_title(f"relative gain, r = {r}")
        ax.set_xlabel("context length c (c' = c + step)")
        ax.set_ylabel("exp f(c,c) - exp f(c,c')")
        ax.axhline(0.0, color="grey", lw=0.5)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_perplexity(res: ReclResult, path, metric: str = "perplexity") -> None:
    """Figure 4: plain perplexity against context length."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name in res.names:
        ax.plot(res.contexts, res.perplexity[name], "o-", label=name)
    ax.set_xlabel("context length")
    ax.set_ylabel(metric)
    ax.set_title("Perplexity against context length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
