"""Evaluation speed: Transformer-XL with memory against the vanilla Transformer (paper Table 9).

Legend: A attention length (keys each query sees), L evaluation segment length, D model dim.

Both sides predict every token of a stream with A tokens of context:

- Transformer-XL (Sec. 3.2, "during evaluation ... the representations from the previous
  segments can be reused"): segments of L tokens, memory of A hidden states per layer,
  ``same_length`` on, so every query attends to exactly A keys. One forward yields L
  predictions; earlier positions are never recomputed.
- Vanilla Transformer, evaluated the way Al-Rfou et al. (2018) do (paper Sec. 2, Fig. 1c): a
  window of A tokens, shifted by one token per prediction; each forward recomputes all A
  positions from scratch and yields one prediction (the last). Its per-token cost is flat in
  the stream length, so we time it on a sample of positions and report the mean.

The vanilla model is, by default, a same-shape model with the Al-Rfou absolute encoding (the
paper's baseline); weights do not change timing, so random ones are used. Both sides run in the
same process, interleaved per length, with the same thread count and device.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from txlm.errors import ConfigError
from txlm.inference.evaluate import stream_segments
from txlm.model import TransformerXL
from txlm.model.lengths import Lengths
from txlm.model.modes import evaluating

# The paper's Table 9: attention length -> how many times slower Al-Rfou et al. is (one GPU).
PAPER_TABLE9: dict[int, float] = {800: 363.0, 1800: 773.0, 2800: 1409.0, 3800: 1874.0}


@dataclass
class SpeedRow:
    attn_len: int
    xl_ms_per_token: float
    vanilla_ms_per_token: float
    slowdown: float  # vanilla / XL per-token time
    xl_tokens: int  # tokens timed on the XL side (after memory warm-up)
    vanilla_positions: int  # positions timed on the vanilla side (one forward each)
    vanilla_forwards: int  # forwards the vanilla side ran while timed (positions x repeats)
    repeats: int = 1  # interleaved rounds; the times are per-side medians
    paper_slowdown: float | None = None


@dataclass
class SpeedResult:
    rows: list[SpeedRow]
    tgt_len: int
    device: str
    threads: int
    model: dict = field(default_factory=dict)  # shape summary of the XL model
    vanilla: str = "alrfou"
    vanilla_sampled: bool = True
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vanilla_model_for(model: TransformerXL, max_attn_len: int) -> TransformerXL:
    """A same-shape vanilla Transformer (Al-Rfou absolute encoding, no memory)."""
    cfg = model.config.replace(
        attn_type="alrfou",
        mem_len=0,
        same_length=False,
        n_positions=max(max_attn_len, model.config.n_positions),
        dropout=0.0,
        dropatt=0.0,
    )
    p = next(model.parameters())
    return TransformerXL(cfg).to(device=p.device, dtype=p.dtype).eval()


def time_xl(model: TransformerXL, stream: Tensor, attn_len: int, tgt_len: int, n_tokens: int):
    """Per-token seconds of segment-wise evaluation with a memory of ``attn_len`` states.

    stream: [1, T] token ids, T >= warm-up + timed tokens + 1. The memory is filled by
    untimed warm-up segments first, so every timed query attends to exactly ``attn_len`` keys.
    Returns (seconds per token, tokens timed).
    """
    device = stream.device
    warm = -(-attn_len // tgt_len) + 1  # segments to fill the memory, plus one to warm kernels
    n_seg = max(1, -(-n_tokens // tgt_len))
    elapsed = 0.0
    segments = stream_segments(
        model, stream[0, : (warm + n_seg) * tgt_len + 1], max_segments=warm + n_seg,
        lengths=Lengths.of(model.config, tgt_len=tgt_len, mem_len=attn_len, same_length=True),
    )  # fmt: skip
    with contextlib.closing(segments):
        for s in range(warm + n_seg):
            _sync(device)
            t0 = time.perf_counter()
            seg = next(segments)
            seg.out.loss.item()  # forces the work (and a device sync) like a real evaluation
            _sync(device)
            if s >= warm:
                elapsed += time.perf_counter() - t0
    return elapsed / (n_seg * tgt_len), n_seg * tgt_len


@torch.inference_mode()
def time_vanilla(
    model: TransformerXL, stream: Tensor, attn_len: int, positions: Sequence[int]
) -> tuple[float, int]:
    """Per-token seconds of the sliding-window evaluation at the given target positions.

    For target position p (predicting stream[p]) the input is the window stream[p-A : p]; all A
    positions are recomputed and only the last is scored. One forward per position. Returns
    (seconds per token, forwards run).
    """
    device = stream.device
    # one untimed forward so lazy initialisation and allocator warm-up are not counted
    model.transform(stream[:, positions[0] - attn_len : positions[0]])
    elapsed = 0.0
    forwards = 0
    for p in positions:
        window = stream[:, p - attn_len : p]  # [1, A]
        _sync(device)
        t0 = time.perf_counter()
        hidden, _, _ = model.transform(window)
        loss = model.softmax.nll(hidden[:, -1], stream[:, p])
        loss.sum().item()
        _sync(device)
        elapsed += time.perf_counter() - t0
        forwards += 1
    return elapsed / len(positions), forwards


def measure_eval_speed(
    model: TransformerXL,
    attn_lens: Sequence[int],
    *,
    tgt_len: int = 128,
    xl_tokens: int = 1024,
    vanilla_positions: int = 16,
    vanilla: str = "alrfou",
    vanilla_model: TransformerXL | None = None,
    repeats: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> SpeedResult:
    """Table 9 for ``model``: per-token time of both evaluations at each attention length.

    vanilla: "alrfou" (a same-shape Al-Rfou model, the paper's baseline) or "same" (this
    model itself, evaluated window by window without memory). ``vanilla_model`` overrides both.
    """
    if not attn_lens or any(a < 1 for a in attn_lens):
        raise ConfigError(f"attention lengths must be positive, got {list(attn_lens)}")
    if min(tgt_len, xl_tokens, vanilla_positions, repeats) < 1:
        raise ConfigError("tgt_len, xl_tokens, vanilla_positions and repeats must be positive")
    if vanilla not in ("alrfou", "same"):
        raise ConfigError(f"vanilla must be 'alrfou' or 'same', got {vanilla!r}")
    with contextlib.ExitStack() as modes:
        modes.enter_context(evaluating(model))
        if vanilla_model is not None:  # the caller's, returned in its own mode too
            modes.enter_context(evaluating(vanilla_model))
        return _measure(
            model, attn_lens, tgt_len, xl_tokens, vanilla_positions, vanilla, vanilla_model,
            repeats, seed, progress,
        )  # fmt: skip


def _measure(
    model: TransformerXL,
    attn_lens: Sequence[int],
    tgt_len: int,
    xl_tokens: int,
    vanilla_positions: int,
    vanilla: str,
    vanilla_model: TransformerXL | None,
    repeats: int,
    seed: int,
    progress: Callable[[str], None] | None,
) -> SpeedResult:
    p = next(model.parameters())
    device = p.device
    max_a = max(attn_lens)
    if vanilla_model is None:
        vanilla_model = vanilla_model_for(model, max_a) if vanilla == "alrfou" else model

    # One synthetic stream long enough for the longest run; token identity does not change time.
    n_seg = -(-xl_tokens // tgt_len)
    need = max(max_a + 1 + vanilla_positions, (-(-max_a // tgt_len) + 1 + n_seg) * tgt_len + 1)
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, model.config.vocab_size, (1, need), generator=gen).to(device)

    rows = []
    # Untimed: the first forwards of a process pay for allocator and kernel warm-up.
    time_xl(model, stream, min(attn_lens), tgt_len, tgt_len)
    for a in attn_lens:
        # the sample: evenly spaced target positions, each with a full window before it
        lo, hi = a, need - 1
        step = max(1, (hi - lo) // vanilla_positions)
        positions = [min(lo + i * step, hi) for i in range(vanilla_positions)]
        # Interleaved rounds, median per side: the machine is shared, and a burst of
        # load in one round should not decide the ratio.
        xl_times, van_times, forwards = [], [], 0
        for k in range(repeats):
            if progress:
                progress(f"attention length {a}, round {k + 1}/{repeats}")
            xl_s, xl_n = time_xl(model, stream, a, tgt_len, xl_tokens)
            van_s, n_fwd = time_vanilla(vanilla_model, stream, a, positions)
            xl_times.append(xl_s)
            van_times.append(van_s)
            forwards += n_fwd
        xl_s, van_s = statistics.median(xl_times), statistics.median(van_times)
        rows.append(
            SpeedRow(
                attn_len=a,
                xl_ms_per_token=xl_s * 1e3,
                vanilla_ms_per_token=van_s * 1e3,
                slowdown=van_s / xl_s if xl_s > 0 else float("inf"),
                xl_tokens=xl_n,
                vanilla_positions=len(positions),
                vanilla_forwards=forwards,
                repeats=repeats,
                paper_slowdown=PAPER_TABLE9.get(a),
            )
        )

    c = model.config
    return SpeedResult(
        rows=rows,
        tgt_len=tgt_len,
        device=str(device),
        threads=torch.get_num_threads(),
        model=dict(
            n_layer=c.n_layer,
            d_model=c.d_model,
            n_head=c.n_head,
            d_head=c.d_head,
            d_inner=c.d_inner,
            vocab_size=c.vocab_size,
            params=model.num_parameters(),
        ),
        vanilla=vanilla,
        vanilla_sampled=True,
        note=(
            f"medians of {repeats} interleaved rounds; "
            f"vanilla side timed on a sample of {vanilla_positions} positions per length "
            "(one forward of A tokens each, last position scored); Transformer-XL on "
            f"{n_seg * tgt_len} tokens in segments of {tgt_len} after filling its memory"
        ),
    )


def format_table(result: SpeedResult) -> str:
    lines = [
        f"Evaluation speed (paper Table 9) on {result.device}, {result.threads} threads, "
        f"segment {result.tgt_len}, vanilla={result.vanilla}",
        f"{'attn len':>8}  {'XL ms/tok':>10}  {'vanilla ms/tok':>14}  {'slowdown':>9}  "
        f"{'paper':>7}",
    ]
    for r in result.rows:
        paper = f"{r.paper_slowdown:,.0f}x" if r.paper_slowdown else "-"
        lines.append(
            f"{r.attn_len:>8}  {r.xl_ms_per_token:>10.4f}  {r.vanilla_ms_per_token:>14.3f}  "
            f"{r.slowdown:>8.1f}x  {paper:>7}"
        )
    lines.append(f"note: {result.note}")
    return "\n".join(lines)


def plot_speed(result: SpeedResult, path) -> None:
    """Slowdown against attention length, with the paper's GPU figures for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r.attn_len for r in result.rows]
    ax.plot(xs, [r.slowdown for r in result.rows], "o-", label=f"measured ({result.device})")
    ax.plot(list(PAPER_TABLE9), list(PAPER_TABLE9.values()), "s--", label="paper (GPU)")
    ax.set_xlabel("attention length")
    ax.set_ylabel("vanilla / Transformer-XL time per token")
    ax.set_title("Evaluation slowdown of the vanilla Transformer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
