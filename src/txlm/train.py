"""Training: the paper's optimisation with memory carried across steps (Sec. 3.2, 4).

Legend: B global batch rows, b = B / W rows on each of W ranks, c = b / A rows per gradient
accumulation chunk, L segment length, M memory length, D model dim.

One step:
  1. the stream iterator yields this rank's b rows of the next segment (row i of step t+1
     continues row i of step t, so row i's memory is its true preceding text);
  2. the rows are split into A chunks; each chunk runs forward with its rows' memory and
     backward on   sum(token losses) * W / N,   N = non-ignored tokens of the global batch,
     so DDP's gradient average is exactly the mean token loss of the global batch: one
     process with batch B and W processes with B / W rows each take the same step;
  3. gradients are clipped (0.25), the learning rate follows the schedule, Adam steps.
Memory is detached by the model and reset where the data says (a new epoch, or the
per-token document flags in doc_mode=reset).

Everything a step depends on is saved in ``last``: weights, Adam's moments, the step (the
schedule is a pure function of it), the data position, every RNG and the memory. A run
stopped after k steps and resumed to N ends with the same weights, bit for bit, as one that
ran N steps (CPU, fp32, deterministic mode).
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from txlm import checkpoint
from txlm import distributed as dist
from txlm.config import ModelConfig
from txlm.errors import CheckpointError, ConfigError, TxlmError
from txlm.evaluate import autocast, evaluate_tokens
from txlm.model import TransformerXL
from txlm.prompts import encode_prompt, start_token
from txlm.train_config import TrainConfig

OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
MEMORY_FILE = "memory.safetensors"
METRICS_FILE = "metrics.jsonl"
RESULTS_FILE = "results.json"


class TrainingError(TxlmError):
    """The run cannot go on (diverged, or a resume that does not fit)."""


# -- learning-rate schedules ------------------------------------------------------------
def learning_rate(step: float, config: TrainConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear warm-up, then decay.

    ``step`` may be fractional: with a time budget the schedule runs on the step that the
    elapsed fraction of the budget corresponds to (``Trainer.schedule_step``).
    """
    o = config.optim
    if o.warmup_steps > 0 and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "inv_sqrt":
        # Continuous with the warm-up: lr at the last warm-up step, then ~ 1/sqrt(step).
        return o.lr * math.sqrt(max(o.warmup_steps, 1) / (step + 1))
    span = max(o.max_steps - o.warmup_steps, 1)
    progress = min(max(step - o.warmup_steps, 0) / span, 1.0)
    return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


# -- RNG, optimizer and memory state without pickle -------------------------------------
def _b64(t: Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": [np_state[0], np_state[1].tolist(), *[float(x) for x in np_state[2:]]],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), int(n[2]), int(n[3]), n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def save_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Adam's per-parameter tensors in safetensors, its hyper-parameters as JSON metadata."""
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, pstate in sd["state"].items():
        for key, value in pstate.items():
            if isinstance(value, Tensor):
                tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    meta = {"param_groups": json.dumps(sd["param_groups"]), "scalars": json.dumps(scalars)}
    save_file(tensors, str(path), metadata=meta)


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if "param_groups" not in meta:
        raise CheckpointError(f"{path} lacks the optimizer's param_groups metadata")
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    for idx, extra in json.loads(meta.get("scalars", "{}")).items():
        state.setdefault(int(idx), {}).update(extra)
    try:
        optimizer.load_state_dict(
            {"state": state, "param_groups": json.loads(meta["param_groups"])}
        )
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{path} does not fit this model's optimizer: {exc}") from None


@contextlib.contextmanager
def _reading(path: Path) -> Any:
    """Turn any failure to read or apply ``path`` into one CheckpointError naming it."""
    try:
        yield
    except TxlmError:
        raise
    except Exception as exc:  # SafetensorError, JSONDecodeError, UnicodeDecodeError, KeyError...
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"cannot resume from {path}: damaged or not a txlm file ({detail})"
        ) from None


# -- memory of the training streams -------------------------------------------------------
@dataclass
class Memory:
    """The per-row memory of this rank's training streams (None: empty)."""

    mems: list[Tensor] | None = None  # n_layer x [b, M, D]
    mask: Tensor | None = None  # [b, M] bool or None (all valid)

    def chunk(self, rows: slice) -> tuple[list[Tensor] | None, Tensor | None]:
        if self.mems is None:
            return None, None
        mask = None if self.mask is None else self.mask[rows]
        return [m[rows] for m in self.mems], mask


def _join_masks(masks: list[Tensor | None], mems: list[Tensor], rows: list[int]) -> Tensor | None:
    """Concatenate the chunks' memory masks; a chunk without one has all positions valid."""
    if all(m is None for m in masks):
        return None
    size = mems[0].size(1)
    filled = [
        torch.ones(n, size, dtype=torch.bool, device=mems[0].device) if m is None else m
        for m, n in zip(masks, rows, strict=True)
    ]
    return torch.cat(filled, dim=0)


# -- the sampler used at the end of a run -------------------------------------------------
def sample_text(
    model: TransformerXL,
    vocab: Any,
    prompt: str,
    n_tokens: int,
    *,
    top_k: int = 40,
    seed: int = 0,
    mem_len: int | None = None,
) -> str:
    """Top-k sampling (paper App. E) from the generation engine (``txlm.generate``), which
    reads the prompt in segments and carries memory; ``mem_len`` overrides the model's."""
    from txlm.generate import generate

    try:  # read as `txlm generate` reads a prompt, so the same seed gives the same text there
        ids = encode_prompt(vocab, prompt)[0] if prompt else []
    except TxlmError:  # a prompt the vocabulary cannot spell: sample unconditioned
        ids, prompt = [], ""
    saved = model.config
    model.set_lengths(mem_len=mem_len)
    try:
        start = start_token(vocab)
        start_id = None if ids else (start if start is not None else 0)
        new = generate(
            model, ids, max_new_tokens=n_tokens, top_k=top_k, seed=seed, start_id=start_id
        )[0]
    finally:
        model.config = saved
    return vocab.decode(ids + list(new))


# -- the trainer --------------------------------------------------------------------------
@dataclass
class _Signals:
    """SIGINT/SIGTERM: the first asks for a checkpoint and a clean exit, a second is abrupt."""

    received: int = 0  # signal number, 0: none
    old: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        if not _in_main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received:
            self.restore()
            raise KeyboardInterrupt
        self.received = signum
        sys.stderr.write(
            f"\ntxlm: {signal.Signals(signum).name} received: saving `last` after this step "
            "(again to stop at once)\n"
        )

    def restore(self) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)
        self.old.clear()


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _pick_device(config: TrainConfig, local_rank: int) -> torch.device:
    name = config.run.device
    if name == "auto":
        name = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and torch.cuda.is_available():
        name = f"cuda:{local_rank}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("run.device asks for CUDA but no GPU is available")
    return torch.device(name)


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
        from txlm.data import (
            SentenceStreamIterator,
            StreamIterator,
            default_data_dir,
            load_prepared,
            prepare_dataset,
        )

        self.config = config
        self.out = Path(out_dir)
        r = config.run
        self.signals = _Signals()

        # Process group, device, threads, determinism, seeds.
        probe = _pick_device(config, int(os.environ.get("LOCAL_RANK", "0")))
        self.dist = dist.init(probe.type)
        self.device = _pick_device(config, self.dist.local_rank)
        self.echo = echo and self.dist.is_main
        if r.precision == "fp16" and self.device.type != "cuda":
            raise ConfigError("run.precision=fp16 needs a GPU (GradScaler); use bf16 on CPU")
        if r.threads is not None:
            torch.set_num_threads(r.threads)
        if r.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            if self.device.type == "cuda":
                torch.backends.cudnn.benchmark = False
        world = self.dist.world_size
        if config.data.batch_size % (world * config.optim.grad_accum):
            raise ConfigError(
                f"data.batch_size ({config.data.batch_size}) must be divisible by processes x "
                f"optim.grad_accum ({world} x {config.optim.grad_accum})"
            )

        # Data: rank 0 prepares (downloads, tokenises), the others then read the same folder.
        data_dir = Path(config.data.data_dir) if config.data.data_dir else default_data_dir()
        if self.dist.is_main:
            path = prepare_dataset(
                config.data.dataset,
                data_dir,
                level=config.data.level,
                progress=self.echo and r.progress and sys.stderr.isatty(),
            )
        dist.barrier()
        if not self.dist.is_main:
            path = prepare_dataset(
                config.data.dataset, data_dir, level=config.data.level, progress=False
            )
        self.corpus = load_prepared(path)
        self.vocab = self.corpus.vocab
        self.metric = self.corpus.metric
        self.model_config: ModelConfig = config.model_config(len(self.vocab))
        tgt_len = self.model_config.tgt_len
        iterator = (
            SentenceStreamIterator if self.corpus.meta.get("dataset") == "lm1b" else StreamIterator
        )
        train_tokens = self.corpus.split("train")
        doc_starts = self.corpus.doc_starts("train")
        self.stream = iterator(
            train_tokens,
            config.data.batch_size,
            tgt_len,
            doc_starts=doc_starts if len(doc_starts) else None,
            doc_mode=config.data.doc_mode,
            rank=self.dist.rank,
            world_size=world,
            varlen=config.data.varlen,
            seed=r.seed,
            device=self.device,
        )
        self._batches = iter(())  # started lazily, after a resume has set the position

        # Model and optimizer. Every rank builds the same initial weights from the seed.
        torch.manual_seed(r.seed)
        np.random.seed(r.seed % 2**32)
        random.seed(r.seed)
        self.model = TransformerXL(self.model_config).to(self.device)
        self.model.train()
        params = list(self.model.parameters())  # tied tensors appear once
        o = config.optim
        opt_cls = torch.optim.AdamW if o.optimizer == "adamw" else torch.optim.Adam
        # fused: one kernel per step over all tensors instead of ~10 ops per tensor (2-3% of
        # a CPU step for the benchmark shapes; more on GPUs), on CPU and CUDA alike. Same
        # update rule. (A resumed checkpoint keeps the setting it was saved with.)
        self.optimizer = opt_cls(
            params,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=True,
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=r.precision == "fp16")
        self.step = 0
        self.best_valid: float | None = None
        self.bad_steps = 0
        self.memory = Memory()
        self.train_seconds = 0.0
        self.tokens_seen = 0
        self.time_up = False
        # Dropout draws differ per rank (different rows), reproducibly.
        torch.manual_seed(r.seed + 1000003 * self.dist.rank)

        if resume is not None:
            self._load_resume(Path(resume))

        self.forward_model: Any = self.model
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.forward_model = DDP(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False,
            )
        if r.compile:
            self.forward_model = torch.compile(self.forward_model)

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
            return self.step
        return max(self.step, self.config.optim.max_steps * self.train_seconds / budget)

    def out_of_time(self) -> bool:
        budget = self.config.run.time_budget_s
        # Every rank stops at the same step: rank 0's clock decides.
        late = torch.tensor([float(budget is not None and self.train_seconds >= budget)])
        return bool(dist.broadcast_tensor(late).item())

    def train_step(self) -> dict[str, float]:
        c = self.config
        batch = self._next_batch()
        if batch.index == 0:
            self.memory = Memory()  # an epoch starts every row afresh
        lr = learning_rate(self.schedule_step(), c)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        labels = batch.labels
        local_tokens = (labels != -100).sum()
        n_global = dist.all_reduce_sum(local_tokens.to(torch.float64).cpu()).item()
        scale = self.dist.world_size / max(n_global, 1.0)
        rows = labels.size(0)
        per = rows // c.optim.grad_accum
        loss_sum = torch.zeros((), dtype=torch.float64)
        new_mems: list[list[Tensor]] = []
        new_masks: list[Tensor | None] = []
        for i in range(c.optim.grad_accum):
            part = slice(i * per, (i + 1) * per)
            mems, mask = self.memory.chunk(part)
            reset = None if batch.reset is None else batch.reset[part]
            last = i == c.optim.grad_accum - 1
            sync = (
                self.forward_model.no_sync()
                if self.dist.enabled and not last and hasattr(self.forward_model, "no_sync")
                else contextlib.nullcontext()
            )
            with sync:
                with autocast(self.device, c.run.precision):
                    out = self.forward_model(
                        batch.input_ids[part],
                        mems=mems,
                        reset=reset,
                        labels=labels[part],
                        mem_mask=mask,
                    )
                    loss = out.losses.float().sum()
                self.scaler.scale(loss * scale).backward()
            loss_sum += loss.detach().double().cpu()
            new_mems.append(out.mems)
            new_masks.append(out.mem_mask)
        if c.optim.grad_accum == 1:
            self.memory = Memory(new_mems[0], new_masks[0])
        else:
            joined = [torch.cat(layer, dim=0) for layer in zip(*new_mems, strict=True)]
            self.memory = Memory(joined, _join_masks(new_masks, joined, [per] * len(new_masks)))

        loss_global = dist.all_reduce_sum(loss_sum).item() / max(n_global, 1.0)
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if c.optim.clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, c.optim.clip)
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params])
            )
        grad_norm_f = float(grad_norm)
        fp16 = c.run.precision == "fp16"
        bad = not math.isfinite(loss_global) or (not fp16 and not math.isfinite(grad_norm_f))
        if bad:
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()
            self.memory = Memory()  # non-finite states must not feed the next segment
            self.bad_steps += 1
            warnings.warn(
                f"step {self.step + 1}: non-finite loss or gradient ({loss_global}, "
                f"grad norm {grad_norm_f}); step skipped "
                f"({self.bad_steps}/{c.optim.max_bad_steps} in a row)",
                RuntimeWarning,
                stacklevel=2,
            )
            if self.bad_steps >= c.optim.max_bad_steps:
                raise TrainingError(
                    f"training diverged: {self.bad_steps} consecutive steps with a non-finite "
                    f"loss or gradient (last at step {self.step + 1}); lower optim.lr, raise "
                    "optim.warmup_steps or use run.precision=fp32"
                )
        else:
            self.bad_steps = 0
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += int(n_global)
        return {"loss": loss_global, "lr": lr, "grad_norm": grad_norm_f, "tokens": n_global}

    # -- validation -----------------------------------------------------------------------
    def validate(self, *, split: str = "valid", full: bool = False) -> dict[str, Any] | None:
        """Rank 0 streams ``split`` with the evaluation lengths; others get its result."""
        result = None
        if self.dist.is_main:
            result = self.evaluate_split(self.model, split, full=full)
        return dist.broadcast_object(result)

    def evaluate_split(
        self, model: TransformerXL, split: str, *, full: bool, **lengths: Any
    ) -> dict[str, Any]:
        e = self.config.eval
        kwargs = dict(
            tgt_len=e.eval_tgt_len,
            mem_len=e.eval_mem_len,
            clamp_len=e.eval_clamp_len,
            same_length=e.same_length,
        )
        kwargs.update({k: v for k, v in lengths.items() if v is not None})
        result = evaluate_tokens(
            model,
            self.corpus.split(split),
            batch_size=e.batch_size,
            max_steps=None if full else e.max_eval_steps,
            precision=self.config.run.precision,
            metric=self.metric,
            tokens_per_byte=self.corpus.tokens_per_byte(split),
            progress=self.echo and self.config.run.progress,
            desc=split,
            **kwargs,
        )
        result["split"] = split
        return result

    # -- checkpoints ----------------------------------------------------------------------
    def _extra_config(self, kind: str) -> dict[str, Any]:
        return {
            "train": self.config.to_dict(),
            "vocab_fingerprint": self.vocab.fingerprint,
            "dataset": {
                "name": self.config.data.dataset,
                "prepared": self.corpus.meta.get("name"),
                "level": self.corpus.level,
                "metric": self.metric,
            },
            "checkpoint": {"kind": kind, "step": self.step, "best_valid_loss": self.best_valid},
        }

    def save(self, kind: str) -> None:
        """Write ``out/last`` (everything needed to resume) or ``out/best`` (the model).

        Collective: every rank calls it (memory and RNG states are gathered to rank 0).
        """
        resume_state = None
        if kind == "last":
            resume_state = self._gather_resume_state()
        if not self.dist.is_main:
            return

        def fill(tmp: Path) -> None:
            if resume_state is None:
                return
            state, memory = resume_state
            save_optimizer(self.optimizer, tmp / OPTIMIZER_FILE)
            save_file(memory, str(tmp / MEMORY_FILE))
            checkpoint.write_json(tmp / STATE_FILE, state)

        checkpoint.save(
            self.model,
            self.out / kind,
            vocab=self.vocab,
            extra_config=self._extra_config(kind),
            extra_files=fill,
        )

    def _gather_resume_state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        rngs = dist.all_gather_object(rng_state())
        memory: dict[str, Tensor] = {}
        has_memory = self.memory.mems is not None
        if dist.all_gather_object(has_memory) != [has_memory] * self.dist.world_size:
            raise TrainingError("ranks disagree on whether memory exists (a bug)")
        has_mask = self.memory.mask is not None
        any_mask = any(dist.all_gather_object(has_mask))
        if has_memory:
            assert self.memory.mems is not None
            for n, m in enumerate(self.memory.mems):
                memory[f"mems.{n}"] = dist.all_gather_rows(m).cpu().contiguous()
            if any_mask:
                mask = self.memory.mask
                if mask is None:
                    b, size = self.memory.mems[0].shape[:2]
                    mask = torch.ones(b, size, dtype=torch.bool, device=self.device)
                memory["mem_mask"] = dist.all_gather_rows(mask).cpu().contiguous()
        state = {
            "step": self.step,
            "scheduler": {"schedule": self.config.optim.schedule, "step": self.step},
            "data": self.stream.state_dict(),
            "rng": rngs,
            "world_size": self.dist.world_size,
            "grad_scaler": self.scaler.state_dict(),
            "best_valid_loss": self.best_valid,
            "bad_steps": self.bad_steps,
            "train_seconds": self.train_seconds,
            "tokens_seen": self.tokens_seen,
            "has_memory": has_memory,
        }
        return state, memory

    def _load_resume(self, directory: Path) -> None:
        directory = checkpoint.resolve(directory)
        for name in (STATE_FILE, OPTIMIZER_FILE, MEMORY_FILE, checkpoint.WEIGHTS_FILE):
            if not (directory / name).is_file():
                raise CheckpointError(
                    f"{directory} has no {name}: only a `last` checkpoint can be resumed"
                )
        saved = checkpoint.read_config(directory)
        if saved.get("vocab_fingerprint") != self.vocab.fingerprint:
            raise CheckpointError(
                f"{directory} was trained on another vocabulary (fingerprint "
                f"{saved.get('vocab_fingerprint')}, the data has {self.vocab.fingerprint})"
            )
        if ModelConfig.from_dict(saved["model"]) != self.model_config:
            raise CheckpointError(f"{directory}: model.* settings differ from the checkpoint's")
        loaded = checkpoint.load(directory, device=self.device)
        self.model.load_state_dict(loaded.state_dict())
        self.model.train()
        # Each of the three resume-only files may be damaged or foreign (truncated, zero bytes,
        # a pickle under the name): whatever reading it raises becomes one CheckpointError that
        # names the file, never a traceback.
        with _reading(directory / OPTIMIZER_FILE):
            load_optimizer(self.optimizer, directory / OPTIMIZER_FILE)
        with _reading(directory / STATE_FILE):
            state = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
            if not isinstance(state, dict):
                raise ValueError("not a JSON object")
            world_size = state["world_size"]
        if world_size != self.dist.world_size:
            raise CheckpointError(
                f"{directory} was written by {world_size} processes; resume it with "
                f"the same number (now {self.dist.world_size}) to keep each row's memory"
            )
        with _reading(directory / STATE_FILE):
            self.step = int(state["step"])
            self.stream.load_state_dict(state["data"])
            self.scaler.load_state_dict(state["grad_scaler"])
            self.best_valid = state.get("best_valid_loss")
            self.bad_steps = int(state.get("bad_steps", 0))
            self.train_seconds = float(state.get("train_seconds", 0.0))
            self.tokens_seen = int(state.get("tokens_seen", 0))
            set_rng_state(state["rng"][self.dist.rank])
        if state.get("has_memory"):
            with _reading(directory / MEMORY_FILE):
                tensors = load_file(str(directory / MEMORY_FILE), device=str(self.device))
                per = self.config.data.batch_size // self.dist.world_size
                rows = slice(self.dist.rank * per, (self.dist.rank + 1) * per)
                mems = [tensors[f"mems.{n}"][rows] for n in range(self.model_config.n_layer)]
                mask = tensors["mem_mask"][rows] if "mem_mask" in tensors else None
                want = (per, self.model_config.mem_len, self.model_config.d_model)
                for n, m in enumerate(mems):
                    if m.dim() != 3 or m.size(0) != per or m.size(2) != want[2]:
                        raise ValueError(f"mems.{n} has shape {tuple(m.shape)}, expected {want}")
                self.memory = Memory(mems, mask)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        c = self.config
        r, o, e = c.run, c.optim, c.eval
        if self.dist.is_main:
            # Find an unwritable --out or a full disk now, not at the first save after
            # minutes of training. An atomic save holds the old and new `last` at once: 2x.
            checkpoint.ensure_writable(
                self.out, 2 * checkpoint.estimate_checkpoint_bytes(self.model)
            )
        log = _MetricsLog(self.out, enabled=self.dist.is_main, tensorboard=r.tensorboard)
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
        bar = None
        if self.echo and r.progress:
            from tqdm import tqdm

            bar = tqdm(total=o.max_steps, initial=self.step, desc="train", dynamic_ncols=True)
        self.signals.install()
        interval = {"loss": 0.0, "tokens": 0.0, "time": 0.0}
        stopped_by: int = 0
        try:
            while self.step < stop_at:
                t0 = time.perf_counter()
                stats = self.train_step()
                dt = time.perf_counter() - t0
                self.train_seconds += dt
                interval["loss"] += stats["loss"] * stats["tokens"]
                interval["tokens"] += stats["tokens"]
                interval["time"] += dt
                if bar is not None:
                    bar.update(1)
                if self.step % r.log_interval == 0 or self.step == stop_at:
                    loss = interval["loss"] / max(interval["tokens"], 1.0)
                    tok_s = interval["tokens"] / max(interval["time"], 1e-9)
                    record = {
                        "split": "train",
                        "step": self.step,
                        "loss": loss,
                        self.metric: self.corpus.metric_value(loss, "train"),
                        "lr": stats["lr"],
                        "grad_norm": stats["grad_norm"],
                        "tokens_per_s": tok_s,
                        "tokens_seen": self.tokens_seen,
                        "train_seconds": self.train_seconds,
                    }
                    log.write(record)
                    if bar is not None:
                        bar.set_postfix(
                            loss=f"{loss:.3f}",
                            **{self.metric: f"{record[self.metric]:.3f}"},
                            lr=f"{stats['lr']:.2e}",
                            tok_s=f"{tok_s:.0f}",
                        )
                    interval = {"loss": 0.0, "tokens": 0.0, "time": 0.0}
                flag = torch.tensor([float(self.signals.received)])
                stopped_by = int(dist.all_reduce_max(flag).item())
                if self.out_of_time():
                    if self.echo:
                        _tqdm_write(
                            f"time budget of {r.time_budget_s:.0f}s spent at step {self.step}"
                        )
                    self.time_up = True
                    break
                validate_now = e.eval_interval > 0 and self.step % e.eval_interval == 0
                if validate_now and self.step < o.max_steps and not stopped_by:
                    self._validate_and_save(log)
                elif r.save_interval and self.step % r.save_interval == 0:
                    self.save("last")
                if stopped_by:
                    break
        except KeyboardInterrupt:
            if bar is not None:
                bar.close()
            self.signals.restore()
            raise
        if bar is not None:
            bar.close()
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
            self._validate_and_save(log)  # the final validation decides `best` too
        else:
            self.save("last")  # run.stop_at: a resumable pause, schedule unchanged
        summary.update(
            train_seconds=self.train_seconds,
            train_tokens=self.tokens_seen,
            train_tokens_per_s=self.tokens_seen / max(self.train_seconds, 1e-9),
            best_valid_loss=self.best_valid,
        )
        if self.dist.is_main:
            log.plot(self.out / "loss.png", self.metric)
        if finished and e.final_eval and self.dist.is_main:
            summary.update(self._final_evaluation())
        if self.dist.is_main:
            checkpoint.write_json(self.out / RESULTS_FILE, summary)
        log.close()
        dist.shutdown()
        return summary

    def _validate_and_save(self, log: _MetricsLog) -> None:
        result = self.validate()
        assert result is not None
        record = {
            "split": "valid",
            "step": self.step,
            "loss": result["loss"],
            self.metric: result[self.metric],
            "tokens": result["tokens"],
            "tokens_per_s": result["tokens_per_s"],
        }
        log.write(record)
        if self.echo:
            msg = f"step {self.step}: valid loss {result['loss']:.4f}, "
            msg += f"{self.metric} {result[self.metric]:.4f}"
            (print if not self.config.run.progress else _tqdm_write)(msg)
        improved = self.best_valid is None or result["loss"] < self.best_valid
        if improved:
            self.best_valid = result["loss"]
        self.save("last")
        if improved:
            self.save("best")

    def _final_evaluation(self) -> dict[str, Any]:
        """Valid and test with the preset's evaluation lengths, on `best`; then a sample."""
        best_dir = self.out / "best"
        model = checkpoint.load(best_dir, device=self.device) if best_dir.exists() else self.model
        out: dict[str, Any] = {"metric": self.metric}
        for split in ("valid", "test"):
            result = self.evaluate_split(model, split, full=True)
            out[split] = result
            if self.echo:
                print(
                    f"{split}: loss {result['loss']:.4f}, {self.metric} "
                    f"{result[self.metric]:.4f} over {result['tokens']} tokens "
                    f"(tgt_len {result['tgt_len']}, mem_len {result['mem_len']}), "
                    f"{result['tokens_per_s']:.0f} tokens/s"
                )
        e = self.config.eval
        if e.sample_tokens > 0:
            t0 = time.perf_counter()
            text = sample_text(
                model,
                self.vocab,
                e.sample_prompt,
                e.sample_tokens,
                top_k=e.sample_top_k,
                seed=self.config.run.seed,
                # the checkpoint's own memory length, as `txlm generate CKPT` uses it (with
                # the prompt read as it reads it): the same seed then gives the same text
                # there (the evaluation memory, longer, changed the draws once the context
                # outgrew the training memory)
            )
            out["sample"] = text
            out["sample_seconds"] = time.perf_counter() - t0
            if self.echo:
                seed = self.config.run.seed
                print(f"sample (top-{e.sample_top_k}, {e.sample_tokens} tokens, seed {seed}):")
                print(text)
        return out


# -- metrics ------------------------------------------------------------------------------
class _MetricsLog:
    """metrics.jsonl (one JSON object per line), TensorBoard when installed, loss.png."""

    def __init__(self, out: Path, *, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.path = out / METRICS_FILE
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except Exception:  # tensorboard not installed: JSONL only
                self.tb = None

    def truncate_after(self, step: int) -> None:
        """On resume, drop records a crashed run wrote after its last checkpoint."""
        if not self.enabled or not self.path.exists():
            return
        keep = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        text = "".join(line + "\n" for line in keep)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)

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
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, path)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _indent(text: str) -> str:
    return "".join("  " + line + "\n" for line in text.splitlines())


def _tqdm_write(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg)
