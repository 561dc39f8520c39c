"""The training loop: the paper's optimisation with memory carried across steps (Sec. 3.2, 4).

Legend: B global batch rows, b = B / W rows on each of W ranks, c = b / A rows per gradient
accumulation chunk, L segment length, M memory length, D model dim.

What the run learns is its task (``training.tasks``: language modelling, ``lm``, or
document classification, ``classify``): the data and its batches, the model, the loss of a
chunk, the evaluation of a split, the final evaluation, what the checkpoints record. The
trainer owns the rest and never asks which task it runs. One step:
  1. the task's batches yield this rank's b rows (a language model's: the next segment of
     every row, row i of step t+1 continuing row i of step t, so row i's memory is its true
     preceding text), and the task's labels say what the loss counts;
  2. the rows are split into A chunks; each chunk runs forward with its rows' memory and
     backward on sum(losses) * W / N,   N = counted labels of the global batch,
     so DDP's gradient average is exactly the mean loss of the global batch: one process
     with batch B and W processes with B / W rows each take the same step;
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

The pieces: ``config`` (``TrainConfig``), ``tasks`` (what the run learns), ``build`` (the
corpus, its stream of batches, the optimizer), ``step`` (one optimisation step),
``schedule`` (learning rate), ``state`` (the components with their own state: counters,
memory, RNG; Adam's moments without pickle), ``checkpoint_manager`` (``last`` / ``best``
and resume, handed those components), ``evaluation`` (a language model's validation, final
evaluation and sample), ``metrics`` (JSONL, TensorBoard, progress, ETA), ``objective``
(which positions count), ``precision`` (bf16 compute weights), ``signals`` (SIGINT/SIGTERM),
``determinism`` (``run.deterministic``, scoped to the run's work), ``init`` (a run that
starts from a checkpoint's model and vocabulary: fine-tuning).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from txlm import atomic, resources
from txlm.checkpoints import checkpoint
from txlm.checkpoints.checkpoint import Checkpoint
from txlm.checkpoints.convert import text_options
from txlm.config import ModelConfig
from txlm.data.vocab import Vocab
from txlm.devices import check_precision, resolve_device, wanted
from txlm.errors import ConfigError, TrainingError
from txlm.model import TransformerXL
from txlm.model.align import Stored
from txlm.training import distributed as dist
from txlm.training.averaging import WeightAverage, averaged
from txlm.training.build import build_optimizer, frozen_parameters
from txlm.training.checkpoint_manager import CheckpointManager
from txlm.training.config import TrainConfig
from txlm.training.determinism import deterministic, threads
from txlm.training.init import check_same_model, init_record, load_init_weights, open_init
from txlm.training.metrics import MetricsLog, ProgressReport, TrainLog, eta
from txlm.training.precision import ComputeCopy, denormals_flushed
from txlm.training.schedule import learning_rate
from txlm.training.signals import StopSignals
from txlm.training.state import RNG, Counters, Memory
from txlm.training.step import StepStats, Update, forward_backward, graphs_compiled, token_scale
from txlm.training.tasks import TASKS, Task

__all__ = ["RESULTS_FILE", "StepStats", "Trainer", "graphs_compiled"]

RESULTS_FILE = "results.json"


class Trainer:
    """``Trainer(config, out_dir).fit()`` trains, validates, checkpoints and evaluates.

    ``resume``: a ``last`` checkpoint directory to continue from (exactly).
    ``config.init`` (``txlm.training.init``): the run starts from that checkpoint's weights,
    its corpus encoded with the checkpoint's vocabulary; before the first step the model is
    evaluated on the valid split (``init_valid``).
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

        self.init: dict[str, Any] | None = None  # a run started from a checkpoint: its record
        given_vocab, init_model = self._start_from(resume, world)
        # what the run learns (training.tasks): its data, batches, model, loss and evaluation
        self.task: Task = TASKS[config.task](
            config, given_vocab, self.dist, echo=self.echo,
            lower_case=bool(self.init and self.init.get("text", {}).get("lower_case")),
        )  # fmt: skip
        self.vocab, self.unknown, self.metric = self.task.vocab, self.task.unknown, self.task.metric
        self.model_config: ModelConfig = config.model_config(len(self.vocab))
        self.stream = self.task.batches(self.model_config, self.dist, self.device)
        self._batches: Any = iter(())  # started lazily, after a resume has set the position
        self._check_resources(self.model_config, world)

        # Model and optimizer. Every rank builds the same initial weights from the seed.
        torch.manual_seed(r.seed)
        np.random.seed(r.seed % 2**32)
        random.seed(r.seed)
        # stored padded where that pays, from the unpadded model: the same initial weights
        stored = Stored.aligned(self.model_config) if wanted(r.align_heads, self.device) else None
        self.model: Any = self.task.build_model(self.model_config, stored)
        body = self.task.body(self.model)
        if init_model is not None:
            load_init_weights(body, init_model)
            del init_model
        self.model = self.model.to(self.device)
        self.model.train()
        for p in frozen_parameters(self.model, config.optim.freeze):
            p.requires_grad_(False)  # no gradient, so Adam neither keeps state nor steps it
        self.optimizer = build_optimizer(self.model, config)
        # optim.average: validation, `best` and the final evaluation read the average
        self.average = WeightAverage.of(self.model, config.optim)
        self.scaler = torch.amp.GradScaler("cuda", enabled=r.precision == "fp16")
        self.counters = Counters()
        self.memory = Memory(
            config.data.batch_size // world,
            self.model_config.n_layer,
            self.model_config.d_model,
            width=body.stored.d_model,
        )
        self.time_up = False
        self.compile_seconds = 0.0
        self._session = _Session()
        self._schedule_start = 0.0  # the schedule's step when this invocation began
        self._pending: tuple[StepStats, float] | None = None  # queued, its numbers not read yet
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
            tensors={} if self.average is None else {"average": self.average},
            vocab=self.vocab,
            run_info={
                "train": config.to_dict(),
                "vocab_fingerprint": self.vocab.fingerprint,
                **self.task.run_info(self.model),  # its data; a classifier's labels
                **({} if self.init is None else {"init": self.init}),
            },
            dist_info=self.dist,
            device=self.device,
        )
        if resume is not None:
            self.checkpoints.load(Path(resume))

        self.compiled = wanted(r.compile, self.device) and self.task.compiles
        self.task.start(self.model, self.device, compiled=self.compiled)
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

    def _start_from(
        self, resume: str | Path | None, world: int
    ) -> tuple[Vocab | None, TransformerXL | None]:
        """A run started from a checkpoint (``config.init``): the vocabulary its corpus is
        encoded with and, for a new run, the checkpoint's model. Its record (path, weights'
        sha256, text options, init_valid once measured) travels in every checkpoint's
        config.json, so a resumed run reads it, and the vocabulary, from the one it resumes.
        """
        if self.config.init is None:
            return None, None
        if resume is not None:
            resumed = Checkpoint.open(resume)
            self.init = dict(resumed.data.get("init") or {})
            return resumed.vocab(), None
        ckpt = open_init(self.config.init)
        self.init = {**init_record(ckpt), "text": text_options(ckpt.data)}
        vocab = ckpt.vocab()
        check_same_model(ckpt, self.config.model_config(len(vocab)))
        # Its size checked before its weights are read, and its weights read before the
        # corpus is prepared: a refused --init leaves nothing behind.
        self._check_resources(self.config.model_config(len(vocab)), world)
        return vocab, ckpt.load_model(device="cpu", align_heads=False, task="lm")

    def _check_resources(self, model_config: ModelConfig, world: int) -> None:
        """Refuse a run whose step cannot fit, before its model is allocated: the frozen
        parameters counted on a model on the meta device (no memory)."""
        frozen = 0
        if self.config.optim.freeze:
            with torch.device("meta"):
                shape = TASKS[self.config.task].shaped(TransformerXL(model_config))
            frozen = sum(p.numel() for p in frozen_parameters(shape, self.config.optim.freeze))
        resources.check_training(model_config, self.device, self.config, world, frozen=frozen)

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
        """The step the schedule is at: the step count, or further on if time runs short.

        Under ``run.time_budget_s`` (seconds of training in this invocation) the schedule
        covers what is left of it, from where it stood when this invocation began, to
        ``optim.max_steps`` in the budget: a resumed run picks the schedule up where it was.
        """
        budget = self.config.run.time_budget_s
        if budget is None:
            return self.counters.step
        start = self._schedule_start
        left = self.config.optim.max_steps - start
        return max(self.counters.step, start + left * self._session.seconds / budget)

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
        self.counters.schedule_step = self.schedule_step()
        lr = learning_rate(self.counters.schedule_step, c.optim)
        labels = self.task.labels(batch)
        # N: the global batch's counted labels (a language model's tokens, a classifier's
        # documents)
        n_global, scale = token_scale(labels, self.device, self.dist.world_size)
        loss_sum, parts = forward_backward(
            self.forward_model, self.task.loss, batch, labels, self.memory, scale=scale,
            scaler=self.scaler, grad_accum=c.optim.grad_accum, precision=c.run.precision,
            device=self.device,
        )  # fmt: skip
        if self.compute is not None:
            self.compute.gradients_to_master()
        loss_global = dist.all_reduce_sum(loss_sum.reshape(1))[0] / n_global.clamp(min=1.0)
        grad_norm, finite = self.update(lr, torch.isfinite(loss_global))
        if self.compute is not None:
            self.compute.refresh()
        self.memory.update(parts, keep=finite)  # non-finite states must not feed the next
        self.counters.step += 1
        if self.average is not None:
            self.average.update(self.counters.step)
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
        """(signal received, this invocation's time budget spent on rank 0), as this
        process sees them."""
        budget = self.config.run.time_budget_s
        late = self.dist.is_main and budget is not None and self._session.seconds >= budget
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
            with averaged(self.average):
                result = self.evaluate_split(self.model, split, full=full)
        return dist.broadcast_object(result)

    def evaluate_split(self, model: Any, split: str, *, full: bool) -> dict[str, Any]:
        return self.task.evaluate_split(model, split, full=full)

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
        r, o = c.run, c.optim
        if self.dist.is_main:
            # Find an unwritable --out or a full disk now, not at the first save after
            # minutes of training. An atomic save holds the old and new `last` at once: 2x.
            checkpoint.ensure_writable(
                self.out, 2 * checkpoint.estimate_checkpoint_bytes(self.model)
            )
        log = MetricsLog(self.out, enabled=self.dist.is_main, tensorboard=r.tensorboard)
        log.truncate_after(self.step)
        self._announce()
        self._evaluate_init(log)
        stop_at = min(o.max_steps, r.stop_at) if r.stop_at else o.max_steps
        report = ProgressReport(
            enabled=self.dist.is_main and r.progress,
            total=o.max_steps,
            initial=self.step,
            metric=self.metric,
            to_metric=self.task.metric_value,
            interval=r.progress_interval,
            unit=self.task.unit,  # what a step counts: tokens, a classifier's documents
        )
        train_log = TrainLog(
            log, report, metric=self.metric,
            to_metric=self.task.metric_value,
            log_interval=r.log_interval, stop_at=stop_at,
        )  # fmt: skip
        self.signals.install()
        try:  # also when a second signal (KeyboardInterrupt) or divergence ends the run
            stopped_by = self._train(stop_at, log, report, train_log)
        finally:
            report.close()
            self.signals.restore()
        if stopped_by:
            return self._pause(stopped_by, log)
        return self._finish(log, report)

    def _announce(self) -> None:
        if not self.echo:
            return
        c = self.config
        n_params = self.model.num_parameters()
        unique = {id(p): p for p in self.model.parameters()}.values()  # tied tensors once
        trainable = sum(p.numel() for p in unique if p.requires_grad)
        count = f"{n_params / 1e6:.2f}M parameters"
        if trainable != n_params:  # optim.freeze
            count += f" ({trainable:,} of {n_params:,} trainable)"
        # a fine-tune's model is its --init checkpoint's, whatever preset the other sections
        # came from
        model = c.preset if self.init is None else f"--init {self.init['path']}"
        print(
            f"txlm train: {model} on {c.data.dataset} "
            f"({self.task.level} level, "
            f"{len(self.vocab)} symbols), {count}, "
            f"{self.dist.world_size} process(es) on {self.device}, out {self.out}"
        )
        print("resolved configuration:\n" + _indent(c.to_yaml()))
        o = c.optim
        if 0 < o.max_steps < o.warmup_steps:
            peak = learning_rate(o.max_steps - 1, o)
            print(
                f"note: optim.max_steps={o.max_steps} ends inside the warm-up "
                f"(optim.warmup_steps={o.warmup_steps}): the learning rate rises to {peak:.3g} "
                f"only, never to optim.lr={o.lr:g}; set optim.warmup_steps below max_steps"
            )
        if self.init is not None:
            print(
                f"started from {self.init['path']} (weights sha256 {self.init['weights_sha256']})"
            )
        if self.unknown is not None:
            shares = ", ".join(f"{k} {v:.2%}" for k, v in self.unknown.items())
            print(f"unknown symbols ({self.vocab.unk}) in the corpus: {shares}")
        if self.step:
            print(f"resumed at step {self.step}")

    def _evaluate_init(self, log: MetricsLog) -> None:
        """The init model on the valid split, measured as the final ``valid`` is (before the
        first step: the before of a before and after)."""
        if self.init is None or "valid" in self.init or self.step:
            return
        result = None
        if self.dist.is_main:
            result = self.task.evaluate_split(self.model, "valid", full=True, desc="init valid")
        result = dist.broadcast_object(result)
        self.init["valid"] = result
        log.write(
            {
                "split": "init_valid",
                "step": 0,
                "loss": result["loss"],
                self.metric: result[self.metric],
                "tokens": result["tokens"],
            }
        )
        if self.echo:
            more = "".join(f", {name} {result[name]:.4f}" for name in self.task.reported)
            print(
                f"init valid: loss {result['loss']:.4f}, {self.metric} "
                f"{result[self.metric]:.4f}{more} over {result[self.task.counted]} "
                f"{self.task.counted}"
            )

    def _train(
        self, stop_at: int, log: MetricsLog, report: ProgressReport, train_log: TrainLog
    ) -> int:
        """Steps until ``stop_at``, the time budget or a signal; the signal number (0: none).

        A step's numbers are read once the next step is queued behind it (``_settle``); on a
        GPU the wait for them is that step's time in the steady state.
        """
        e, r = self.config.eval, self.config.run
        self._session = _Session()
        self._schedule_start = self.counters.schedule_step
        stopped_by, late = 0, False
        stop_flags: Tensor | None = None  # DDP: the last step's stop votes, not read yet
        while self.step < stop_at:
            graphs = graphs_compiled() if self.compiled else 0
            t0 = time.perf_counter()
            stats = self.train_step()
            self._settle(train_log, stop_at)
            dt = time.perf_counter() - t0
            atomic.step_done(self.step)  # the tests' fault seam (txlm.atomic)
            if self.compiled and graphs_compiled() > graphs:
                # A step that built a graph: compiling, not training, so it counts against
                # neither the time budget nor tokens/s.
                self.compile_seconds += dt
                dt = 0.0
            else:
                self.counters.train_seconds += dt
                self._session.steps += 1
                self._session.seconds += dt
            self._pending = (stats, dt)
            if not self.dist.enabled:
                stopped_by, late = self._stop_votes()
            else:  # this step's votes queued, the previous step's read
                previous, stop_flags = stop_flags, self._stop_flags()
                if previous is not None:
                    received, late_any = previous.tolist()
                    stopped_by, late = int(received), bool(late_any)
            if late:
                self._settle(train_log, stop_at)
                if self.echo:
                    report.message(
                        f"time budget of {r.time_budget_s:.0f}s spent at step {self.step}"
                    )
                self.time_up = True
                return 0
            validate_now = e.eval_interval > 0 and self.step % e.eval_interval == 0
            save_now = r.save_interval and self.step % r.save_interval == 0
            if stopped_by or validate_now or save_now:
                self._settle(train_log, stop_at)  # checkpoints hold the counters up to here
            if stopped_by:
                return stopped_by
            if validate_now and self.step < self.config.optim.max_steps:
                self._validate_and_save(log, report)
            elif save_now:
                self.save("last")
        self._settle(train_log, stop_at)
        if stop_flags is not None:  # the votes of the last step
            stopped_by = int(stop_flags.tolist()[0])
        return stopped_by

    def _settle(self, train_log: TrainLog, stop_at: int) -> None:
        """Read and log the step whose numbers the host has not read yet."""
        if self._pending is None:
            return
        (stats, seconds), self._pending = self._pending, None
        values = self.account(stats)
        budget = self.config.run.time_budget_s
        budget_left = None if budget is None else budget - self._session.seconds
        train_log.step(
            stats.step, values, seconds, tokens_seen=self.tokens_seen,
            train_seconds=self.train_seconds,
            eta_s=eta(stop_at - self.step, self._session.steps, self._session.seconds,
                      budget_left),
        )  # fmt: skip

    def _pause(self, signal: int, log: MetricsLog) -> dict[str, Any]:
        """A signal stopped the run: save ``last`` to resume from."""
        self.save("last")
        if self.echo:
            print(
                f"stopped at step {self.step}: saved {self.out / 'last'}; resume with "
                f"--resume {self.out / 'last'}"
            )
        log.close()
        self._leave_group()
        return {"stopped": True, "step": self.step, "exit_code": 128 + signal}

    def _finish(self, log: MetricsLog, report: ProgressReport) -> dict[str, Any]:
        """The last validation and checkpoints, the final evaluation, results.json."""
        c = self.config
        summary: dict[str, Any] = {"step": self.step, "stopped": False}
        finished = self.step >= c.optim.max_steps or self.time_up
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
        if self.init is not None:
            summary["init"] = {k: v for k, v in self.init.items() if k != "valid"}
            summary["init_valid"] = self.init.get("valid")
        if self.unknown is not None:
            summary["unknown_share"] = self.unknown
        if self.compiled and self.echo:
            print(
                f"compiling took {self.compile_seconds:.1f}s (not counted in the time budget "
                "or tokens/s)"
            )
        log.plot(self.out / "loss.png", self.metric)
        if finished and c.eval.final_eval and self.dist.is_main:
            summary.update(
                self.task.final_evaluation(self.model, self.out, self.device, echo=self.echo)
            )
            if self.average is not None:
                summary["average"] = self._average_summary()
        if self.dist.is_main:
            atomic.write_json(self.out / RESULTS_FILE, summary)
        log.close()
        self._leave_group()
        return summary

    def _leave_group(self) -> None:
        """Drop the DDP wrapper, then leave the process group. DDP's reducer holds the group
        (with gloo, its worker threads): released here, the group is torn down in
        ``destroy_process_group`` right after the ranks' last barrier, not whenever the trainer
        happens to be freed, perhaps while another rank is still exiting. The run is over:
        nothing steps through ``forward_model`` again."""
        self.forward_model = self.model if self.compute is None else self.compute.model
        dist.shutdown()

    def _average_summary(self) -> dict[str, Any]:
        """The weight average, and the final valid split (whole, as the final evaluation
        reads it) of both the averaged weights (``valid``) and the weights as trained
        (``valid_unaveraged``)."""
        a = self.average
        assert a is not None
        record: dict[str, Any] = {"mode": a.mode, "start": a.start, "count": a.count}
        if a.mode == "ema":
            record["decay"] = a.decay
        if not a.active:
            return record
        with a.swapped():
            record["valid"] = self.evaluate_split(self.model, "valid", full=True)
        record["valid_unaveraged"] = self.evaluate_split(self.model, "valid", full=True)
        if self.echo:
            m = self.metric
            print(
                f"valid with the {a.mode} average of {a.count} steps' weights: "
                f"{m} {record['valid'][m]:.4f}; with the weights as trained: "
                f"{m} {record['valid_unaveraged'][m]:.4f}"
            )
        return record

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
                **{name: result[name] for name in self.task.reported},
            }
        )
        if self.echo:
            more = "".join(f", {name} {result[name]:.4f}" for name in self.task.reported)
            report.message(
                f"step {self.step}: valid loss {result['loss']:.4f}, "
                f"{self.metric} {result[self.metric]:.4f}{more}"
            )
        improved = self.best_valid is None or result["loss"] < self.best_valid
        if improved:
            self.counters.best_valid = result["loss"]
        self.save("last")
        if improved:
            with averaged(self.average):
                self.save("best")


@dataclass
class _Session:
    """The steps and seconds of training in this process (the ETA's pace)."""

    steps: int = 0
    seconds: float = 0.0


def _indent(text: str) -> str:
    return "".join("  " + line + "\n" for line in text.splitlines())
