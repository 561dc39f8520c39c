"""The training loop: the paper's optimisation with memory carried across steps (Sec. 3.2, 4).

Legend: B global batch rows, b = B / W rows on each of W ranks, c = b / A rows per gradient
accumulation chunk, L segment length, M memory length, D model dim.

One step:
  1. the stream iterator yields this rank's b rows of the next segment (row i of step t+1
     continues row i of step t, so row i's memory is its true preceding text);
  2. the objective (``optim.loss``) picks the positions the loss counts; the rows are split
     into A chunks; each chunk runs forward with its rows' memory and backward on
     sum(token losses) * W / N,   N = counted tokens of the global batch,
     so DDP's gradient average is exactly the mean token loss of the global batch: one
     process with batch B and W processes with B / W rows each take the same step;
  3. gradients are clipped (``optim.clip``), the learning rate follows the schedule, Adam
     steps. The reported gradient norm is the one before clipping.
Memory is detached by the model and reset where the data says (a new epoch, or the
per-token document flags in doc_mode=reset).

A step (``step``: forward and backward, clipping, Adam) is queued on the device without
reading anything back (contract C37). The loop reads a step's numbers (one transfer) after
the next step is queued, so a GPU never waits for the host between steps; warnings, the
divergence stop, the stop votes of a DDP run and the logs come from those reads, one step
late. Before a checkpoint or validation the loop reads the step it has not read yet, so
``last`` always holds up-to-date counters.

The pieces: ``config`` (``TrainConfig``), ``build`` (the corpus, its stream of batches, the
optimizer), ``step`` (one optimisation step), ``schedule`` (learning rate), ``state`` (the
components with their own state: counters, memory, RNG; Adam's moments without pickle),
``checkpoint_manager`` (``last`` / ``best`` and resume, handed those components),
``evaluation`` (validation, the final evaluation and sample), ``metrics`` (JSONL,
TensorBoard, progress, ETA), ``objective`` (which positions count), ``precision`` (bf16
compute weights), ``signals`` (SIGINT/SIGTERM), ``determinism`` (``run.deterministic``,
scoped to the run's work).

Everything a step depends on is saved in ``last``: a run stopped after k steps and resumed
to N ends with the same weights, bit for bit, as one that ran N steps (CPU, fp32,
deterministic mode).

Every collective gets tensors on the training device: NCCL accepts no others.
"""

from __future__ import annotations

import os
import random
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from txlm import atomic, checkpoint, resources
from txlm import distributed as dist
from txlm.config import ModelConfig
from txlm.devices import check_precision, resolve_device
from txlm.errors import ConfigError, TrainingError
from txlm.model import TransformerXL, align
from txlm.training.build import build_optimizer, open_training_corpus, training_stream
from txlm.training.checkpoint_manager import CheckpointManager
from txlm.training.config import TrainConfig
from txlm.training.determinism import deterministic, threads
from txlm.training.evaluation import evaluate_split, final_evaluation
from txlm.training.metrics import MetricsLog, ProgressReport, TrainLog, eta
from txlm.training.objective import OBJECTIVES
from txlm.training.precision import ComputeCopy, denormals_flushed
from txlm.training.schedule import learning_rate
from txlm.training.signals import StopSignals
from txlm.training.state import RNG, Counters, Memory
from txlm.training.step import (
    StepStats,
    Update,
    compile_wanted,
    forward_backward,
    graphs_compiled,
    tail_buckets,
    token_scale,
)

__all__ = ["RESULTS_FILE", "StepStats", "Trainer", "compile_wanted", "graphs_compiled"]

RESULTS_FILE = "results.json"


class Trainer:
    """``Trainer(config, out_dir).fit()`` trains, validates, checkpoints and evaluates.

    ``resume``: a ``last`` checkpoint directory to continue from (exactly).
    """

    def __init__(
        self,
        config: TrainConfig,
        out_dir: str | Path,
        *,
        resume: str | Path | None = None,
        echo: bool = True,
    ) -> None:
        self.config = config
        self.out = Path(out_dir)
        r = config.run
        self.signals = StopSignals()

        # Process group, device. Deterministic kernels and the thread count (run.deterministic,
        # run.threads) hold only while the trainer works (training.determinism).
        probe = resolve_device(r.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        self.dist = dist.init(probe.type)
        self.device = resolve_device(r.device, local_rank=self.dist.local_rank)
        self.echo = echo and self.dist.is_main
        check_precision(r.precision, self.device)  # fp16's GradScaler: GPUs only
        world = self.dist.world_size
        if config.data.batch_size % (world * config.optim.grad_accum):
            raise ConfigError(
                f"data.batch_size ({config.data.batch_size}) must be divisible by processes x "
                f"optim.grad_accum ({world} x {config.optim.grad_accum})"
            )

        self.corpus = open_training_corpus(config, self.dist, echo=self.echo)
        self.vocab = self.corpus.vocab
        self.metric = self.corpus.metric
        self.model_config: ModelConfig = config.model_config(len(self.vocab))
        self.stream = training_stream(
            self.corpus, config, self.model_config, self.dist, self.device
        )
        self._batches: Any = iter(())  # started lazily, after a resume has set the position
        resources.check_training(self.model_config, self.device, config, world)
        self.objective = OBJECTIVES[config.optim.loss]

        # Model and optimizer. Every rank builds the same initial weights from the seed.
        torch.manual_seed(r.seed)
        np.random.seed(r.seed % 2**32)
        random.seed(r.seed)
        self.model = TransformerXL(self.model_config).to(self.device)
        if align.wanted(r.align_heads, self.device):
            align.pad_model(self.model)  # before the optimizer: its state takes these shapes
        self.model.train()
        self.optimizer = build_optimizer(self.model, config)
        self.scaler = torch.amp.GradScaler("cuda", enabled=r.precision == "fp16")
        self.counters = Counters()
        self.memory = Memory(
            config.data.batch_size // world,
            self.model_config.n_layer,
            self.model_config.d_model,
            width=self.model.layers[0].attn.qkv.in_features,  # D as stored (align)
        )
        self.time_up = False
        self.compile_seconds = 0.0
        # Dropout draws differ per rank (different rows), reproducibly.
        torch.manual_seed(r.seed + 1000003 * self.dist.rank)

        self.checkpoints = CheckpointManager(
            self.out,
            model=self.model,
            model_config=self.model_config,
            optimizer=self.optimizer,
            counters=self.counters,
            memory=self.memory,
            shared={"data": self.stream, "grad_scaler": self.scaler},
            per_rank={"rng": RNG()},
            vocab=self.vocab,
            run_info={
                "train": config.to_dict(),
                "vocab_fingerprint": self.vocab.fingerprint,
                "dataset": {
                    "name": config.data.dataset,
                    "prepared": self.corpus.meta.get("name"),
                    "level": self.corpus.level,
                    "metric": self.metric,
                },
            },
            dist_info=self.dist,
            device=self.device,
        )
        if resume is not None:
            self.checkpoints.load(Path(resume))

        self.compiled = compile_wanted(r.compile, self.device)
        rows = config.data.batch_size // self.dist.world_size // config.optim.grad_accum
        self.buckets = tail_buckets(
            self.model, self.corpus.split("train"), self.device, self.compiled,
            tokens=rows * self.model.config.tgt_len,
        )  # fmt: skip
        # bf16: forward and backward on a bf16 copy of the fp32 master weights (precision.py)
        self.compute = ComputeCopy(self.model, torch.bfloat16) if r.precision == "bf16" else None
        self.forward_model: Any = self.model if self.compute is None else self.compute.model
        if self.dist.enabled:
            self.forward_model = dist.data_parallel(self.forward_model, self.device)
        if self.compiled:
            self.forward_model = torch.compile(self.forward_model)
        self.update = Update(
            self.optimizer,
            self.scaler,
            config.optim.clip,
            device=self.device,
            compiled=self.compiled,
        )

    # -- the counters, by their established names ----------------------------------------------
    @property
    def step(self) -> int:
        return self.counters.step

    @property
    def bad_steps(self) -> int:
        return self.counters.bad_steps

    @property
    def best_valid(self) -> float | None:
        return self.counters.best_valid

    @property
    def train_seconds(self) -> float:
        return self.counters.train_seconds

    @property
    def tokens_seen(self) -> int:
        return self.counters.tokens_seen

    # -- one optimisation step ------------------------------------------------------------
    def _next_batch(self) -> Any:
        try:
            return next(self._batches)
        except StopIteration:
            self._batches = iter(self.stream)  # the iterator moves on to the next epoch
            return next(self._batches)

    def schedule_step(self) -> float:
        """The step the schedule is at: the step count, or further on if time runs short."""
        budget = self.config.run.time_budget_s
        if budget is None:
            return self.counters.step
        return max(
            self.counters.step,
            self.config.optim.max_steps * self.counters.train_seconds / budget,
        )

    def train_step(self) -> StepStats:
        """One optimisation step, queued on the device: no value is read back to the host
        (``account`` reads the returned numbers later)."""
        r = self.config.run
        with deterministic(r.deterministic), threads(r.threads), denormals_flushed(self.device):
            return self._train_step()

    def _train_step(self) -> StepStats:
        c = self.config
        batch = self._next_batch()
        if batch.index == 0:
            self.memory.clear()  # an epoch starts every row afresh
        lr = learning_rate(self.schedule_step(), c.optim)
        labels = self.objective(batch.labels)
        n_global, scale = token_scale(labels, self.device, self.dist.world_size)
        loss_sum, parts = forward_backward(
            self.forward_model, batch, labels, self.memory, scale=scale, scaler=self.scaler,
            grad_accum=c.optim.grad_accum, precision=c.run.precision, device=self.device,
            buckets=self.buckets,
        )  # fmt: skip
        if self.compute is not None:
            self.compute.gradients_to_master()
        loss_global = dist.all_reduce_sum(loss_sum.reshape(1))[0] / n_global.clamp(min=1.0)
        grad_norm, finite = self.update(lr, torch.isfinite(loss_global))
        if self.compute is not None:
            self.compute.refresh()
        self.memory.update(parts, keep=finite)  # non-finite states must not feed the next
        self.counters.step += 1
        return StepStats(self.counters.step, lr, loss_global, grad_norm, n_global, finite)

    def account(self, stats: StepStats) -> dict[str, float]:
        """Read a step's numbers (the one host transfer of the step) and count them: tokens
        seen, consecutive non-finite steps (a warning each; too many: ``TrainingError``)."""
        values = stats.read()
        c = self.config
        self.counters.tokens_seen += int(values["tokens"])
        if values["finite"]:
            self.counters.bad_steps = 0
            return values
        self.counters.bad_steps += 1
        warnings.warn(
            f"step {stats.step}: non-finite loss or gradient ({values['loss']}, grad norm "
            f"{values['grad_norm']}); step skipped ({self.counters.bad_steps}/"
            f"{c.optim.max_bad_steps} in a row)",
            RuntimeWarning,
            stacklevel=2,
        )
        if self.counters.bad_steps >= c.optim.max_bad_steps:
            raise TrainingError(
                f"training diverged: {self.counters.bad_steps} consecutive steps with a "
                f"non-finite loss or gradient (last at step {stats.step}); lower optim.lr, "
                "raise optim.warmup_steps or use run.precision=fp32"
            )
        return values

    def _stop_votes(self) -> tuple[int, bool]:
        """(signal received, time budget spent on rank 0), as this process sees them."""
        budget = self.config.run.time_budget_s
        late = self.dist.is_main and budget is not None and self.train_seconds >= budget
        return self.signals.received, late

    def _stop_flags(self) -> Tensor:
        """Every rank's stop votes, maxed by one collective on the device (queued, not
        read): read one step later, every rank then stops at the same step."""
        flags = torch.tensor(self._stop_votes(), dtype=torch.float64)
        if self.device.type == "cuda":  # a pageable copy would wait for the queued step
            flags = flags.pin_memory()
        return dist.all_reduce_max(flags.to(self.device, non_blocking=True))

    # -- validation -----------------------------------------------------------------------
    def validate(self, *, split: str = "valid", full: bool = False) -> dict[str, Any] | None:
        """Rank 0 streams ``split`` with the evaluation lengths; others get its result."""
        result = None
        if self.dist.is_main:
            result = self.evaluate_split(self.model, split, full=full)
        return dist.broadcast_object(result)

    def evaluate_split(self, model: TransformerXL, split: str, *, full: bool) -> dict[str, Any]:
        return evaluate_split(model, self.corpus, self.config, split, full=full, echo=self.echo)

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, kind: str) -> None:
        """Write ``out/last`` (everything needed to resume) or ``out/best``. Collective."""
        self.checkpoints.save(kind)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``optim.max_steps`` (or ``run.stop_at``, the time budget, a signal),
        validating and checkpointing on the way; returns the run's summary."""
        with deterministic(self.config.run.deterministic), threads(self.config.run.threads):
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        c = self.config
        r, o, e = c.run, c.optim, c.eval
        if self.dist.is_main:
            # Find an unwritable --out or a full disk now, not at the first save after
            # minutes of training. An atomic save holds the old and new `last` at once: 2x.
            checkpoint.ensure_writable(
                self.out, 2 * checkpoint.estimate_checkpoint_bytes(self.model)
            )
        log = MetricsLog(self.out, enabled=self.dist.is_main, tensorboard=r.tensorboard)
        log.truncate_after(self.step)
        if self.echo:
            n_params = self.model.num_parameters()
            print(
                f"txlm train: {c.preset} on {c.data.dataset} ({self.corpus.level} level, "
                f"{len(self.vocab)} symbols), {n_params / 1e6:.2f}M parameters, "
                f"{self.dist.world_size} process(es) on {self.device}, out {self.out}"
            )
            print("resolved configuration:\n" + _indent(c.to_yaml()))
            if self.step:
                print(f"resumed at step {self.step}")
        stop_at = min(o.max_steps, r.stop_at) if r.stop_at else o.max_steps
        report = ProgressReport(
            enabled=self.dist.is_main and r.progress,
            total=o.max_steps,
            initial=self.step,
            metric=self.metric,
            to_metric=lambda loss: self.corpus.metric_value(loss, "train"),
            interval=r.progress_interval,
        )
        train_log = TrainLog(
            log, report, metric=self.metric,
            to_metric=lambda loss: self.corpus.metric_value(loss, "train"),
            log_interval=r.log_interval, stop_at=stop_at,
        )  # fmt: skip
        budget = r.time_budget_s
        self.signals.install()
        stopped_by, late = 0, False
        pending: tuple[StepStats, float] | None = None  # queued, its numbers not read yet
        stop_flags: Tensor | None = None  # DDP: the last step's stop votes, not read yet
        session = [0, 0.0]  # steps and seconds of training in this process

        def settle() -> None:
            """Read and log the step whose numbers the host has not read yet."""
            nonlocal pending
            if pending is not None:
                stats, seconds = pending
                pending = None
                values = self.account(stats)
                budget_left = None if budget is None else budget - self.train_seconds
                train_log.step(
                    stats.step, values, seconds, tokens_seen=self.tokens_seen,
                    train_seconds=self.train_seconds,
                    eta_s=eta(stop_at - self.step, *session, budget_left),
                )  # fmt: skip

        try:
            while self.step < stop_at:
                graphs = graphs_compiled() if self.compiled else 0
                t0 = time.perf_counter()
                stats = self.train_step()
                # The previous step's numbers, read now that this step is queued behind it;
                # on a GPU the wait for them is this step's time in the steady state.
                settle()
                dt = time.perf_counter() - t0
                atomic.step_done(self.step)  # the tests' fault seam (txlm.atomic)
                if self.compiled and graphs_compiled() > graphs:
                    # A step that built a graph: compiling, not training, so it counts
                    # against neither the time budget nor tokens/s.
                    self.compile_seconds += dt
                    dt = 0.0
                else:
                    self.counters.train_seconds += dt
                    session[0] += 1
                    session[1] += dt
                pending = (stats, dt)
                if not self.dist.enabled:
                    stopped_by, late = self._stop_votes()
                else:  # this step's votes queued, the previous step's read
                    previous, stop_flags = stop_flags, self._stop_flags()
                    if previous is not None:
                        received, late_any = previous.tolist()
                        stopped_by, late = int(received), bool(late_any)
                if late:
                    settle()
                    if self.echo:
                        report.message(
                            f"time budget of {r.time_budget_s:.0f}s spent at step {self.step}"
                        )
                    self.time_up = True
                    break
                validate_now = e.eval_interval > 0 and self.step % e.eval_interval == 0
                save_now = r.save_interval and self.step % r.save_interval == 0
                if stopped_by or validate_now or save_now:
                    settle()  # checkpoints hold the counters up to this step
                if validate_now and self.step < o.max_steps and not stopped_by:
                    self._validate_and_save(log, report)
                elif save_now:
                    self.save("last")
                if stopped_by:
                    break
            settle()
            if stop_flags is not None and not stopped_by:  # votes of the last step
                stopped_by = int(stop_flags.tolist()[0])
        finally:  # also when a second signal (KeyboardInterrupt) or divergence ends the run
            report.close()
            self.signals.restore()

        if stopped_by:
            self.save("last")
            if self.echo:
                print(
                    f"stopped at step {self.step}: saved {self.out / 'last'}; resume with "
                    f"--resume {self.out / 'last'}"
                )
            log.close()
            dist.shutdown()
            return {"stopped": True, "step": self.step, "exit_code": 128 + stopped_by}

        summary: dict[str, Any] = {"step": self.step, "stopped": False}
        finished = self.step >= o.max_steps or self.time_up
        if finished:
            self._validate_and_save(log, report)  # the final validation decides `best` too
        else:
            self.save("last")  # run.stop_at: a resumable pause, schedule unchanged
        summary.update(
            train_seconds=self.train_seconds,
            compile_seconds=self.compile_seconds,
            train_tokens=self.tokens_seen,
            train_tokens_per_s=self.tokens_seen / max(self.train_seconds, 1e-9),
            best_valid_loss=self.best_valid,
        )
        if self.compiled and self.echo:
            print(
                f"compiling took {self.compile_seconds:.1f}s (not counted in the time budget "
                "or tokens/s)"
            )
        log.plot(self.out / "loss.png", self.metric)
        if finished and e.final_eval and self.dist.is_main:
            final = final_evaluation(
                self.model, self.corpus, c, self.out, self.device, echo=self.echo
            )
            summary.update(final)
        if self.dist.is_main:
            atomic.write_json(self.out / RESULTS_FILE, summary)
        log.close()
        dist.shutdown()
        return summary

    def _validate_and_save(self, log: MetricsLog, report: ProgressReport) -> None:
        result = self.validate()
        assert result is not None
        log.write(
            {
                "split": "valid",
                "step": self.step,
                "loss": result["loss"],
                self.metric: result[self.metric],
                "tokens": result["tokens"],
                "tokens_per_s": result["tokens_per_s"],
            }
        )
        if self.echo:
            report.message(
                f"step {self.step}: valid loss {result['loss']:.4f}, "
                f"{self.metric} {result[self.metric]:.4f}"
            )
        improved = self.best_valid is None or result["loss"] < self.best_valid
        if improved:
            self.counters.best_valid = result["loss"]
        self.save("last")
        if improved:
            self.save("best")


def _indent(text: str) -> str:
    return "".join("  " + line + "\n" for line in text.splitlines())
