"""The batcher: one thread that owns the model and decodes every running request in one batch.

Continuous batching. A request is a job of R rows (its prompts x n, prompt-major, as
``txlm generate`` orders them). Between two decoding steps the thread admits waiting jobs
while their rows fit ``max_batch``: each one's prompts are read by the decoder (or, for a
session, on top of the session's memory), its first tokens drawn, and its one-token cache rows
spliced into the batch's cache (``KVCache.splice``: each row keeps the keys it would have
alone, at the same distances). Then one ``Decoder.step`` feeds every row's last token, and each
job draws its rows' next tokens from the log-probabilities with its own settings and its own
generator: the same random numbers, in the same order, as ``txlm generate`` draws for that
request alone, so every row's ids equal the request run alone. A job leaves the batch when its
rows are done, or at the next step after its client went away.

Results go back to the request's asyncio queue on the server's event loop
(``call_soon_threadsafe``); nothing else crosses the two threads except the waiting queue,
under one condition variable.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from txlm.inference.compiled import StepCompile
from txlm.inference.decode import Decoder
from txlm.inference.sampling import SamplingConfig, draw_noise, mark_seen, sample, seen_tokens
from txlm.model.cache import KVCache
from txlm.serve.errors import APIError
from txlm.serve.sessions import Session, SessionStore, read_piece
from txlm.serve.text import RowText


@dataclass
class Token:
    """One generated token of one row: its text delta and, when asked, its log-probs."""

    row: int
    id: int
    text: str
    logprob: float | None = None
    top: dict[int, float] | None = None


class Outbox:
    """Events of one request, handed from the engine's thread to the event loop: posted
    during a step and delivered together after it (``deliver``), one wake-up of the loop
    per step rather than one per request and token (each wake-up hands the interpreter's
    lock to the loop's thread and back)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, kind: str, data: Any = None) -> None:
        """Deliver one event now."""
        deliver([(self, kind, data)])


def _hand_over(events: list[tuple[Outbox, str, Any]]) -> None:
    for outbox, kind, data in events:
        outbox.queue.put_nowait((kind, data))


def deliver(events: list[tuple[Outbox, str, Any]]) -> None:
    """Put ``events`` in their queues, one call into each event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for event in events:
        by_loop.setdefault(event[0].loop, []).append(event)
    for loop, mine in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            loop.call_soon_threadsafe(_hand_over, mine)


@dataclass(eq=False)
class Job:
    """One completions request: its prompts' ids, settings, and the state of its rows."""

    prompts: list[list[int]]
    n: int
    max_tokens: int
    sampling: SamplingConfig
    seed: int
    stop: tuple[str, ...]
    logprobs: int | None
    echo: bool
    outbox: Outbox
    session: Session | None = None
    cancelled: bool = False
    # filled by the engine
    texts: list[RowText] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    last: Tensor | None = None  # [R] the rows' last tokens
    generators: list[torch.Generator] = field(default_factory=list)  # one per row
    first: Tensor | None = None  # [R, V] the first tokens' log-probs, until they are drawn
    seen: Tensor | None = None  # [R, V] bool, with a repetition penalty (Engine._seen)
    cache: KVCache | None = None  # a session job's rows, until they join the batch
    steps: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    arrived: float = 0.0  # the event loop's clock (its timeout)

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)


@dataclass(eq=False)
class Call:
    """Work to run on the engine's thread between steps (scoring, classifying)."""

    fn: Callable[[], Any]
    outbox: Outbox
    cancelled: bool = False
    rows: int = 0


class Engine:
    def __init__(
        self,
        model,
        vocab,
        lengths,
        *,
        max_batch: int,
        max_queue: int,
        sessions: SessionStore,
        metrics,
        start_id: int | None,
        precision_context: Callable[[], contextlib.AbstractContextManager],
        int8: bool = False,
        compile: bool | str | StepCompile = "auto",
        decoder: bool = True,
    ) -> None:
        self.model, self.vocab, self.lengths = model, vocab, lengths
        self.max_batch, self.max_queue = max_batch, max_queue
        self.sessions, self.metrics, self.start_id = sessions, metrics, start_id
        self.precision_context = precision_context
        self.decoder: Decoder | None = None
        if decoder:  # (a classifier's engine only runs calls)
            with precision_context():
                # no CUDA graph: the batch changes between steps (rows join and leave); a
                # compiled step runs the batch's bucket (txlm.inference.compiled), so rows
                # that join or leave within it compile nothing
                self.decoder = Decoder(model, lengths=lengths, cuda_graph=False, int8=int8,
                                       compile=compile)  # fmt: skip
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.batch: KVCache | None = None
        self.active: list[Job] = []
        self.pending: deque[Job | Call] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.step_hook: Callable[[Engine], None] | None = None  # tests: called before a step
        # tests: cleared, the engine admits nothing (requests queue up) until it is set again
        self.admitting = threading.Event()
        self.admitting.set()
        self._mail: list[tuple[Outbox, str, Any]] = []  # this step's events (``_post``)
        self.thread = threading.Thread(target=self._run, name="txlm-serve-engine", daemon=True)

    # -- the event loop's side ----------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, work: Job | Call) -> None:
        with self.cond:
            if self.stopping:
                raise APIError(503, "the server is shutting down")
            if len(self.pending) >= self.max_queue:
                raise APIError(
                    429, f"the queue is full ({self.max_queue} requests wait, --max-queue)",
                    headers={"Retry-After": "1"},
                )  # fmt: skip
            self.pending.append(work)
            self.metrics.queue_depth.set(len(self.pending))
            self.cond.notify_all()

    def cancel(self, work: Job | Call) -> None:
        """The client is gone: its rows leave the batch at the next step."""
        with self.cond:
            work.cancelled = True
            self.cond.notify_all()

    def stop(self) -> None:
        """End every request (a final event each) and the thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.admitting.set()

    def join(self, timeout: float | None = None) -> None:
        if self.thread.is_alive():
            self.thread.join(timeout)

    # -- the engine's thread ------------------------------------------------------------
    def _post(self, outbox: Outbox, kind: str, data: Any = None) -> None:
        self._mail.append((outbox, kind, data))

    def _send(self) -> None:
        mail, self._mail = self._mail, []
        if mail:
            deliver(mail)

    def _run(self) -> None:
        with torch.inference_mode(), self.precision_context():
            while True:
                admit = self._wait()
                if admit is None:
                    break
                try:
                    self._admit(admit)
                except Exception as exc:  # a bug: the jobs it started are told, none hangs
                    started = [w for w in admit if isinstance(w, Job) and w not in self.active]
                    self._fail([j for j in started if not j.done], exc)
                self._leave()
                self._send()
                if self.active:
                    if self.step_hook is not None:
                        self.step_hook(self)
                    try:
                        self._step()
                    except Exception as exc:  # a bug: every running request is told, none hangs
                        self._fail_all(exc)
                    self._send()
        shutdown = APIError(503, "the server is shutting down")
        for job in [*self.active, *self.pending]:
            self._release(job)
            self._post(job.outbox, "error", shutdown)
        self.active.clear()
        self.pending.clear()
        self._send()

    def _wait(self) -> list[Job | Call] | None:
        """Wait for work; take the waiting jobs that fit the batch, first come first."""
        with self.cond:
            while not self.stopping and not self.active and not self.pending:
                self.cond.wait()
        self.admitting.wait()
        with self.cond:
            if self.stopping:
                return None
            rows = sum(j.rows for j in self.active)
            admit: list[Job | Call] = []
            while self.pending and rows + self.pending[0].rows <= self.max_batch:
                work = self.pending.popleft()
                rows += work.rows
                admit.append(work)
            self.metrics.queue_depth.set(len(self.pending))
            return admit

    def _admit(self, admitted: list[Job | Call]) -> None:
        """Start the admitted work: calls run, jobs' prompts are read (the fresh ones in one
        prefill), their first tokens drawn, their rows spliced into the batch."""
        jobs: list[Job] = []
        for work in admitted:
            if work.cancelled:
                self._release(work)
            elif isinstance(work, Call):
                self._guard([work], lambda work=work: self._post(work.outbox, "result", work.fn()))
            elif self._guard([work], lambda work=work: self._open(work)):
                jobs.append(work)
        fresh = [j for j in jobs if j.session is None and j.max_tokens > 0]
        shared: KVCache | None = None
        if fresh:
            try:
                shared = self._read_fresh(fresh)
            except Exception as exc:
                self._fail(fresh, exc)
                jobs = [j for j in jobs if j not in fresh]
                fresh = []
        for job in [j for j in jobs if j.max_tokens == 0]:
            job.finish = ["length"] * job.rows
            self._finish(job)
        live = [j for j in jobs if j.max_tokens > 0]
        if not live:
            return
        self._draw(live, torch.cat([j.first for j in live]))
        now = time.perf_counter()
        for job in live:
            job.first = None
            self.metrics.ttft.observe(now - job.submitted)
        # the rows that go on, in the batch's order: the fresh ones' shared cache, then each
        # session's own
        joining = [j for j in fresh if not j.done]
        caches = []
        if shared is not None and joining:
            if len(joining) < len(fresh):
                keep, at = [], 0
                for job in fresh:
                    if not job.done:
                        keep.extend(range(at, at + job.rows))
                    at += job.rows
                shared.keep_rows(torch.tensor(keep, dtype=torch.long))
            caches.append(shared)
        for job in live:
            if job.session is not None and not job.done:
                joining.append(job)
                caches.append(job.cache)
            job.cache = None
        for cache in caches:
            if self.batch is None or self.batch.batch == 0:
                self.batch = cache
            else:
                self.batch.splice(cache)
        with self.cond:  # (tests wait for rows to join)
            self.active.extend(joining)
            self.cond.notify_all()
        for job in live:
            if job.done:
                self._finish(job)

    def _guard(self, works: list, fn: Callable[[], Any]) -> bool:
        """``fn()``; a refusal or a failure goes to ``works``' clients, not to the others."""
        try:
            fn()
            return True
        except Exception as exc:
            self._fail(works, exc)
            return False

    def _fail(self, works: list, exc: Exception) -> None:
        if not isinstance(exc, APIError):
            traceback.print_exc(file=sys.stderr)
            exc = APIError(500, f"internal error: {type(exc).__name__}")
        for work in works:
            self._release(work)
            self._post(work.outbox, "error", exc)

    def _open(self, job: Job) -> None:
        """A job's rows, generators and echoed prompt; a session's piece read on its
        memory (its first log-probs and cache kept for ``_admit``)."""
        top = job.logprobs or 0
        # row r (prompt-major) draws from its own generator, seeded seed + r, as txlm
        # generate's rows: its prompt alone with seed + r draws the same sample
        job.generators = [
            torch.Generator(device=self.device).manual_seed(job.seed + r) for r in range(job.rows)
        ]
        echoed: list[tuple[list[float | None], list[dict[int, float] | None]]] = []
        if job.session is not None:
            reading = read_piece(self.decoder, job.session, job.prompts[0], top, self.start_id)
            echoed.append((reading.chosen, reading.tops))
            job.first, job.cache = reading.next_log_probs, reading.cache
            self.metrics.session_bytes.set(self.sessions.total_bytes)
        elif job.echo:  # the prompts' own log-probs, read as txlm.score reads a text
            for prompt in job.prompts:
                r = read_piece(self.decoder, Session("echo"), prompt, top, self.start_id)
                echoed.append((r.chosen, r.tops))
        job.texts = [RowText(self.vocab, p, job.stop) for p in job.prompts for _ in range(job.n)]
        job.finish = [None] * job.rows
        self._post(job.outbox, "prompt", echoed)
        self.metrics.prompt_tokens.inc(sum(len(p) for p in job.prompts))

    def _read_fresh(self, jobs: list[Job]) -> KVCache:
        """Read the prompts of jobs without a session in one prefill (left-padded, each row
        as alone: the decoder's document mask); each job's first log-probs, and one
        one-token cache of all their rows (each prompt's repeated for its samples)."""
        held = self.decoder.cache
        prompts = [p for job in jobs for p in job.prompts]
        log_probs = self.decoder.prefill(prompts, start_id=self.start_id)
        cache = self.decoder.cache
        self.decoder.cache = held
        assert cache is not None
        if cache.max_len != 1:
            cache = cache.resized(1)
        index, at = [], 0
        for job in jobs:
            for i in range(len(job.prompts)):
                index += [at + i] * job.n
            at += len(job.prompts)
        rows = torch.tensor(index, dtype=torch.long)
        if len(index) != len(prompts):
            cache.keep_rows(rows)
        log_probs = log_probs[rows.to(log_probs.device)]
        at = 0
        for job in jobs:
            job.first = log_probs[at : at + job.rows]
            at += job.rows
        return cache

    def _draw(self, jobs: list[Job], log_probs: Tensor) -> None:
        """The next token of every row of ``jobs`` from their log-probabilities [B, V]: each
        row with its job's settings and its own generator (one draw per setting)."""
        groups: dict[SamplingConfig, list[tuple[Job, int]]] = {}
        at = 0
        for job in jobs:
            groups.setdefault(job.sampling, []).append((job, at))
            at += job.rows
        tokens = torch.empty(at, dtype=torch.long, device=log_probs.device)
        for config, members in groups.items():
            rows = [r for job, start in members for r in range(start, start + job.rows)]
            noise = seen = None
            if not config.greedy:  # each row's numbers from its own generator, as alone
                noise = torch.cat([draw_noise(config, 1, self.vocab_size, g, self.device)
                                   for job, _ in members for g in job.generators])  # fmt: skip
            if config.penalised:
                seen = torch.cat([self._seen(job) for job, _ in members])
            index = torch.tensor(rows, device=log_probs.device)
            tokens[index] = sample(log_probs[index], config, noise=noise, seen=seen)
        at = 0
        for job in jobs:
            mine = tokens[at : at + job.rows]
            if job.seen is not None:
                mark_seen(job.seen, mine)
            self._emit(job, mine, log_probs[at : at + job.rows])
            at += job.rows

    def _seen(self, job: Job) -> Tensor:
        """bool [R, V]: the tokens each row of ``job`` holds, its prompt's and what it drew
        (a repetition penalty's history, as ``txlm generate`` keeps it)."""
        if job.seen is None:
            rows = [p for p in job.prompts for _ in range(job.n)]
            job.seen = seen_tokens(rows, self.vocab_size, self.device)
        return job.seen

    def _emit(self, job: Job, tokens: Tensor, log_probs: Tensor) -> None:
        """Hand a job's new tokens out (text, log-probs); rows that end are marked."""
        job.last = tokens
        job.steps += 1
        ids = tokens.tolist()
        chosen = tops = None
        if job.logprobs is not None:
            chosen = log_probs.gather(1, tokens[:, None])[:, 0].tolist()
            if job.logprobs:
                vals, idx = log_probs.topk(min(job.logprobs, self.vocab_size), dim=-1)
                tops = [dict(zip(i, v, strict=True))
                        for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]  # fmt: skip
        out = []
        final = job.steps == job.max_tokens
        for r, tid in enumerate(ids):
            if job.finish[r] is not None:
                continue
            text = job.texts[r]
            delta = text.push(tid, final=final)
            out.append(Token(r, tid, delta, None if chosen is None else chosen[r],
                             None if tops is None else tops[r]))  # fmt: skip
            if text.stopped:
                job.finish[r] = "stop"
            elif final:
                job.finish[r] = "length"
        self.metrics.generated_tokens.inc(len(out))
        self._post(job.outbox, "tokens", out)

    def _step(self) -> None:
        """One decoding step of every row in the batch."""
        began = time.perf_counter()
        ids = torch.cat([job.last for job in self.active])
        self.decoder.cache = self.batch
        log_probs = self.decoder.step(ids)
        self.batch = self.decoder.cache
        self.metrics.batch_size.set(ids.numel())
        self._draw(self.active, log_probs)
        self.metrics.token_latency.observe(time.perf_counter() - began)
        for job in self.active:
            if job.done:
                self._finish(job)
        self._leave()

    def _leave(self) -> None:
        """Jobs that are done or whose client went away leave the batch."""
        staying, keep, at = [], [], 0
        for job in self.active:
            if job.done or job.cancelled:
                if job.cancelled and not job.done:
                    self._release(job)
            else:
                staying.append(job)
                keep.extend(range(at, at + job.rows))
            at += job.rows
        if len(staying) == len(self.active):
            return
        with self.cond:  # (tests wait for rows to leave)
            self.active = staying
            self.cond.notify_all()
        if not keep:
            self.batch = None
        else:
            assert self.batch is not None
            self.batch.keep_rows(torch.tensor(keep, dtype=torch.long))
        self.metrics.batch_size.set(len(keep))

    def _finish(self, job: Job) -> None:
        if job.session is not None:  # what the request wrote is the session's text too
            written = job.texts[0].kept_ids() if job.texts else []
            job.session.tail += written
            job.session.tokens += len(written)
        self._release(job)
        self._post(job.outbox, "done", job.finish)

    def _release(self, work: Job | Call) -> None:
        session = getattr(work, "session", None)
        if session is not None and session.busy:
            self.sessions.release(session)

    def _fail_all(self, exc: Exception) -> None:
        traceback.print_exc(file=sys.stderr)
        error = APIError(500, f"internal error: {type(exc).__name__}")
        for job in self.active:
            self._release(job)
            self._post(job.outbox, "error", error)
        self.active, self.batch = [], None
