"""What a run reports: metrics.jsonl, TensorBoard, loss.png, and progress on stderr.

``MetricsLog`` records (rank 0 only): one JSON object per line in ``metrics.jsonl``, the same
scalars under ``tensorboard/`` (``train/loss``, ``train/bpc``, ``train/lr``,
``train/tokens_per_s``, ``valid/loss``, ...), and a loss curve at the end.

``ProgressReport`` is for the person watching: a tqdm bar when stderr is a terminal; otherwise
(a log file, ``make run > log``, CI) a plain line every ``run.progress_interval`` steps, so
the log reads as text instead of thousands of carriage-return frames.
"""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from txlm import atomic
from txlm.inference.evaluate import metric_value

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """metrics.jsonl (one JSON object per line), TensorBoard when installed, loss.png."""

    def __init__(self, out: Path, *, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.path = out / METRICS_FILE
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # the tensorboard package is not installed: JSONL only
                pass
            else:
                self.tb = SummaryWriter(str(out / TENSORBOARD_DIR))

    def truncate_after(self, step: int) -> None:
        """On resume, drop records a crashed run wrote after its last checkpoint."""
        if not self.enabled or not self.path.exists():
            return
        keep = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        atomic.write_text(self.path, "".join(line + "\n" for line in keep))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self.tb.add_scalar(f"{record['split']}/{key}", value, record["step"])

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]

    def plot(self, path: Path, metric: str) -> None:
        if not self.enabled:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        fig, ax = plt.subplots(figsize=(7, 4))
        for split, style in (("train", "-"), ("valid", "o-")):
            pts = [(r["step"], r[metric]) for r in records if r.get("split") == split]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=split, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=100)
        plt.close(fig)
        atomic.write_bytes(path, png.getvalue())

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class ProgressReport:
    """Training progress on stderr: a bar on a terminal, plain lines elsewhere.

    ``update`` takes each step's numbers as the loop already has them (host floats), so it
    adds no device synchronisation; lines average over the steps since the previous line.
    """

    def __init__(
        self,
        *,
        enabled: bool,
        total: int,
        initial: int,
        metric: str,
        interval: int,
        to_metric: Callable[[float], float] | None = None,
        stream: TextIO | None = None,
        unit: str = "tok",
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.unit = unit  # what a step's count counts: tokens, or a classifier's documents
        self.enabled = enabled
        self.metric = metric
        # loss (nats per token) -> the metric; bits per byte need the corpus's bytes per token
        self.to_metric = to_metric or (lambda loss: metric_value(loss, metric))
        self.interval = interval
        self.total = total
        self.bar = None
        self._reset()
        if enabled and _is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc="train", dynamic_ncols=True, file=self.stream
            )

    @property
    def interactive(self) -> bool:
        return self.bar is not None

    def _reset(self) -> None:
        self.loss_sum, self.tokens, self.seconds = 0.0, 0.0, 0.0

    def update(
        self, step: int, *, loss: float, tokens: float, lr: float, seconds: float, eta_s: float
    ) -> None:
        """Step ``step`` is done: its mean loss over ``tokens`` tokens, in ``seconds``."""
        if not self.enabled:
            return
        self.loss_sum += loss * tokens
        self.tokens += tokens
        self.seconds += seconds
        mean = self.loss_sum / max(self.tokens, 1.0)
        tok_s = self.tokens / max(self.seconds, 1e-9)
        value = self.to_metric(mean) if math.isfinite(mean) else mean
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                loss=f"{mean:.3f}",
                **{self.metric: f"{value:.3f}"},
                lr=f"{lr:.2e}",
                **{f"{self.unit}_s": f"{tok_s:.0f}"},
                refresh=False,
            )
            if step % self.interval == 0:
                self._reset()
            return
        if step % self.interval and step != self.total:
            return
        self.stream.write(
            f"step {step}/{self.total}  loss {mean:.4f}  {self.metric} {value:.4f}  "
            f"lr {lr:.3g}  {tok_s:.0f} {self.unit}/s  ETA {_duration(eta_s)}\n"
        )
        self.stream.flush()
        self._reset()

    def message(self, text: str) -> None:
        """A line for stdout that must not tear the bar (validation results, notes)."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    seconds = max(round(seconds), 0)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class TrainLog:
    """The training rows of ``metrics.jsonl`` (every ``log_interval`` steps, averaged over
    the steps since the previous row, weighted by tokens) and the progress report, from each
    step's numbers as the loop reads them (host floats, one step late)."""

    def __init__(
        self,
        log: MetricsLog,
        report: ProgressReport,
        *,
        metric: str,
        to_metric: Callable[[float], float],
        log_interval: int,
        stop_at: int,
    ) -> None:
        self.log, self.report = log, report
        self.metric, self.to_metric = metric, to_metric
        self.log_interval, self.stop_at = log_interval, stop_at
        self._reset()

    def _reset(self) -> None:
        self.loss_sum, self.tokens, self.seconds = 0.0, 0.0, 0.0

    def step(
        self,
        step: int,
        values: dict[str, float],
        seconds: float,
        *,
        tokens_seen: int,
        train_seconds: float,
        eta_s: float,
    ) -> None:
        self.loss_sum += values["loss"] * values["tokens"]
        self.tokens += values["tokens"]
        self.seconds += seconds
        if step % self.log_interval == 0 or step == self.stop_at:
            loss = self.loss_sum / max(self.tokens, 1.0)
            self.log.write(
                {
                    "split": "train",
                    "step": step,
                    "loss": loss,
                    self.metric: self.to_metric(loss),
                    "lr": values["lr"],
                    "grad_norm": values["grad_norm"],
                    "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
                    "tokens_seen": tokens_seen,
                    "train_seconds": train_seconds,
                }
            )
            self._reset()
        self.report.update(
            step,
            loss=values["loss"],
            tokens=values["tokens"],
            lr=values["lr"],
            seconds=seconds,
            eta_s=eta_s,
        )


def eta(steps_left: int, steps: int, seconds: float, budget_left: float | None) -> float:
    """Seconds of training left: ``steps_left`` at the pace of ``steps`` in ``seconds`` (this
    session's), or what is left of the time budget when that comes first."""
    left = steps_left * seconds / max(steps, 1)
    return left if budget_left is None else min(left, max(budget_left, 0.0))
