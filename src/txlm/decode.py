"""Decoders: a model's next-token distributions over a growing context, one step at a time.

Dimension legend
    B  rows (prompts x samples)     P  padded prompt length       L  segment length
    M  memory length (<= mem_len)   S  cache slots (mem_len + L; mem_len + 1 to decode)
    N  layers   D  model dim   V  vocabulary

Procedure (Appendix E): the context is read in segments of ``tgt_len`` with memory carried
from segment to segment, so the memory holds the newest ``mem_len`` states of every layer;
the last context token's distribution gives the first new token; then every new token is fed
as a one-token segment that attends to the memory plus itself.

Why a cache. Transformer-XL's memory stores each layer's *input* hidden states; a forward pass
re-projects all M of them to keys and values, O(M D^2) per layer and token. The projections
never change once made (inference: no dropout, fixed weights), so ``CachedDecoder`` keeps them
in the model's ``KVCache`` (txlm.model.cache) and runs the model's own ``transform`` over it:
a step projects one token and attends over the cached slots (the layers' one forward, which
takes every query length), and the context segments fill the same cache, so no memory state is ever
projected twice. ``UncachedDecoder`` is the reference: the model's forward with the hidden-
state memory, re-projected every step.

Segmentation of the context is aligned to its END (the last segment is full, the first holds
the remainder). Two reasons: the token that predicts the first new word sees the most context,
and prompts of different lengths, left-padded to a common length, are then split at the same
places as each would be alone. Pad positions are hidden from real tokens with the model's
document mask (each row's first real token starts a document), so every row of a batch equals
running it alone.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from txlm.errors import ConfigError
from txlm.head import DecodingHead
from txlm.model.cache import KVCache
from txlm.model.lengths import Lengths
from txlm.model.modes import evaluating
from txlm.model.transformer import TransformerXL
from txlm.sampling import SamplingConfig, draw_noise, sample


def check_ids(rows: list[list[int]], vocab_size: int) -> None:
    for r in rows:
        bad = [x for x in r if not 0 <= x < vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


class _Reader:
    """Shared by the decoders: reading the prompts in end-aligned segments (``_segment``:
    one segment through the decoder's memory)."""

    def __init__(self, model: TransformerXL, lengths: Lengths | None) -> None:
        self.model = model
        self.lengths = model.lengths if lengths is None else lengths
        p = model.embed.layers[0].weight
        self.device, self.weight_dtype = p.device, p.dtype
        self.batch = 0

    def _begin(self, batch: int) -> None:
        raise NotImplementedError

    def _segment(self, ids: Tensor, reset: Tensor | None) -> Tensor:
        """Read one context segment; hidden states [B, L, D]."""
        raise NotImplementedError

    def _read(self, prompts: Sequence[Sequence[int]], start_id: int | None) -> Tensor:
        """Read the prompts; the last position's output [B, D]."""
        rows = [list(r) for r in prompts]
        if not rows:
            raise ConfigError("no prompts given")
        if any(not r for r in rows):
            if start_id is None:
                raise ConfigError("an empty prompt needs a start token (start_id)")
            rows = [r if r else [int(start_id)] for r in rows]
        check_ids(rows, self.model.config.vocab_size)
        batch, width = len(rows), max(len(r) for r in rows)
        self.batch = batch
        ids = torch.zeros(batch, width, dtype=torch.long)
        starts = torch.zeros(batch, width, dtype=torch.bool)
        for b, r in enumerate(rows):
            ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            starts[b, width - len(r)] = True
        ids, starts = ids.to(self.device), starts.to(self.device)
        padded = any(len(r) < width for r in rows)

        self._begin(batch)
        hidden = None
        for lo, hi in self._segments(width):
            hidden = self._segment(ids[:, lo:hi], starts[:, lo:hi] if padded else None)
        assert hidden is not None
        return hidden[:, -1]

    def _segments(self, width: int) -> list[tuple[int, int]]:
        """[lo, hi) bounds of the context segments: full tgt_len ones, the remainder first."""
        tgt = self.lengths.tgt_len
        first = width % tgt or tgt
        bounds = [(0, first)]
        while bounds[-1][1] < width:
            lo = bounds[-1][1]
            bounds.append((lo, lo + tgt))
        return bounds


class UncachedDecoder(_Reader):
    """Reference decoder: every step is the model's forward with the hidden-state memory,
    which the model re-projects to keys and values each time (how Transformer-XL's forward
    works). The same methods as ``CachedDecoder``."""

    def __init__(self, model: TransformerXL, *, lengths: Lengths | None = None) -> None:
        super().__init__(model, lengths)

    def _begin(self, batch: int) -> None:
        self.mems: list[Tensor] | None = None
        self.mem_mask: Tensor | None = None

    def _segment(self, ids: Tensor, reset: Tensor | None) -> Tensor:
        hidden, self.mems, self.mem_mask = self.model.transform(
            ids, self.mems, reset, self.mem_mask, lengths=self.lengths
        )
        return hidden

    def _call(self, fn: Callable[[], Tensor]) -> Tensor:
        """``fn()`` without autograd (its memory: ordinary tensors) in eval mode."""
        with evaluating(self.model), torch.no_grad():
            return fn()

    def prefill(self, prompts: Sequence[Sequence[int]], *, start_id: int | None = None) -> Tensor:
        return self._call(lambda: self.model.softmax.log_prob(self._read(prompts, start_id)))

    prefill_scores = prefill

    def step(self, ids: Tensor) -> Tensor:
        def run() -> Tensor:
            hidden = self._segment(ids.view(-1, 1).to(self.device), None)
            return self.model.softmax.log_prob(hidden[:, -1])

        return self._call(run)

    step_scores = step

    # what the generation loop calls: the next token per row, from the full distribution
    def prefill_tokens(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
        *,
        start_id: int | None = None,
        repeats: int = 1,
    ) -> Tensor:
        """Read the prompts; the first new token per row [B x repeats], drawn with
        ``sampling``. ``repeats``: rows per prompt (prompt-major), here each read again."""
        rows = [r for r in prompts for _ in range(repeats)]
        return sample(self.prefill_scores(rows, start_id=start_id), sampling, generator)

    def step_tokens(
        self, ids: Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
    ) -> Tensor:
        """Feed one token per row ([B] ids); the next token per row [B]."""
        return sample(self.step_scores(ids), sampling, generator)


class CachedDecoder(_Reader):
    """Incremental decoder over a ``KVCache``, eager or compiled/graphed.

    ``prefill(prompts)`` reads the prompts in segments of up to tgt_len through a cache of
    mem_len + tgt_len slots; then the cache is narrowed to mem_len + 1 slots and every new
    token is a one-token step over it (``step_fn``: the same layers' forward on weights laid
    out once for one-row products, see txlm.model.layout, and the output layer's
    ``DecodingHead``).

    Modes. Eager (the default on a CPU): the cache keeps its write position on the host too,
    so a step that needs no mask skips it. ``compile``: the step under
    ``torch.compile(fullgraph=True, dynamic=False)`` (a string names the backend, e.g.
    "aot_eager"); ``cuda_graph`` (the default on CUDA): the step captured in a CUDA graph and
    replayed per token. Both need the static cache: the same shapes and operations every
    step, no host synchronisation.

    Two step functions (C36): ``step_fn``, ids -> scores (``step``, ``step_scores``), and
    ``token_fn``, ids + the draw's random numbers -> the next ids (``step_tokens``, what
    generation calls): the draw inside the compiled or captured step, through the pruned
    adaptive softmax (txlm.head.select, branch-free: no host read) when compiled. The
    random numbers are drawn just before, outside it, from the caller's generator (one kernel),
    so a compiled step draws the tokens an eager one draws with the same generator.

    ``dtype``: the weight products' dtype, fixed here: autocast's when it is on for the
    model's device as the decoder is made (and the weights are float32), else the weights'.
    A half-precision decoder holds its own copies of the layers' projections and the output
    layer in that dtype (made once; the model is not copied or changed); on a CPU its cache
    and the attention over it stay float32 (half-precision matrix-vector products are
    slower there). The model runs in eval mode during each call and returns to its mode.
    """

    def __init__(
        self,
        model: TransformerXL,
        *,
        lengths: Lengths | None = None,
        compile: bool | str | Callable = False,
        cuda_graph: bool | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(model, lengths)
        if dtype is None:
            dtype = self.weight_dtype
            device = self.device.type
            if dtype == torch.float32 and torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
        self.dtype = dtype
        half = dtype in (torch.float16, torch.bfloat16)
        cpu_half = half and self.device.type == "cpu" and self.weight_dtype == torch.float32
        self.cache_dtype = torch.float32 if cpu_half else dtype
        self.compile = compile
        # A compiled step is captured too: inductor's own graphs ("reduce-overhead") refuse a
        # step that writes into the cache it is given, while a manual capture of the compiled
        # step replays its fused kernels as one launch.
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        self.static = bool(compile) or self.cuda_graph
        with torch.no_grad():
            self.weights = model.step_weights(dtype, self.cache_dtype)
            self.head = DecodingHead(model.softmax, dtype)
        self.score_dtype = torch.float32 if half else dtype  # the head's scores (upcast)
        self.cache: KVCache | None = None  # made per prefill
        # the step functions over this cache, per sampling setting (None: scores)
        self._steps: dict[SamplingConfig | None, Callable[..., Tensor]] = {}

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The prompt's segments run the modules: under autocast in the decoder's dtype when
        it differs from the weights', else with autocast off (whatever the caller's)."""
        device = self.device.type
        if self.dtype != self.weight_dtype:
            return torch.autocast(device, dtype=self.dtype)
        return torch.autocast(device, enabled=False)

    def _begin(self, batch: int) -> None:
        self.cache = self.model.new_cache(
            batch, lengths=self.lengths, dtype=self.cache_dtype, static=self.static
        )
        self._steps.clear()

    def _segment(self, ids: Tensor, reset: Tensor | None) -> Tensor:
        with self._autocast():
            hidden, _, _ = self.model.transform(ids, None, reset, None, cache=self.cache)
        return hidden

    def _call(self, fn: Callable[[], Tensor]) -> Tensor:
        """``fn()`` in inference mode (no autograd bookkeeping: version counters, views, which
        a few hundred small operations a step would feel; the cache is only ever written in
        this mode) with the model in eval mode (dropout off: the cache is exact only for a
        deterministic forward); the result copied out, an ordinary tensor."""
        with evaluating(self.model), torch.inference_mode():
            out = fn()
        return out.clone()

    # -- the prompt ---------------------------------------------------------------------
    def prefill(self, prompts: Sequence[Sequence[int]], *, start_id: int | None = None) -> Tensor:
        """Read the prompts (left-padded, end-aligned segments); [B, V] next-token log-probs."""
        return self._call(lambda: self.head.log_probs(self._read(prompts, start_id)))

    def prefill_scores(
        self, prompts: Sequence[Sequence[int]], *, start_id: int | None = None
    ) -> Tensor:
        """As ``prefill`` but sampling scores: log-probabilities up to a constant per row."""
        return self._call(lambda: self.head.scores(self._read(prompts, start_id)))

    # -- one token ----------------------------------------------------------------------
    def step_fn(self, ids: Tensor) -> Tensor:
        """One decoding step, ids [B] -> sampling scores [B, V]. Static shapes, no host
        synchronisation (static cache): compiled or captured as it is."""
        return self.head.scores(self.hidden_step(ids))

    def token_fn(self, ids: Tensor, noise: Tensor | None, sampling: SamplingConfig) -> Tensor:
        """One decoding step and its draw, ids [B] + the draw's random numbers (``noise``,
        txlm.sampling.draw_noise; None for greedy) -> the next ids [B]: a pure function of
        them, the function that is compiled or captured, sampling included. Through the
        pruned head where it can skip clusters (``_prunes``)."""
        hidden = self.hidden_step(ids)
        if self._prunes(sampling):
            return self.head.select(hidden, sampling, noise=noise, host_branch=not self.compile)
        return sample(self.head.scores(hidden), sampling, noise=noise)

    def hidden_step(self, ids: Tensor) -> Tensor:
        """ids [B] -> the last layer's output [B, D] for them, over the cache."""
        hidden, _, _ = self.model.transform(ids.view(-1, 1), cache=self.cache, weights=self.weights)
        return hidden[:, -1]

    def _prunes(self, sampling: SamplingConfig) -> bool:
        """Whether a step's draw goes through the pruned head (txlm.head.select): in a compiled
        step (branch-free, chosen on the device: one graph, capturable, a skipped cluster's
        product fused into a read of one column) or an eager one on a CPU (a host branch per
        cluster, free there); not in an eager step on a GPU (the branch would wait for the
        device) or one replayed from a CUDA graph (eagerly, the branch-free form would copy
        the weight it means not to read)."""
        if not self.head.prunes(sampling):
            return False
        return bool(self.compile) or (not self.static and self.device.type == "cpu")

    def prefill_tokens(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
        *,
        start_id: int | None = None,
        repeats: int = 1,
    ) -> Tensor:
        """Read the prompts; the first new token per row [B x repeats]. ``repeats``: each
        prompt is read once and its cache rows repeated (rows prompt-major: prompt b's
        copies are rows b * repeats ..), the same as reading it ``repeats`` times."""

        def run() -> Tensor:
            hidden = self._read(prompts, start_id)  # [B, D]
            if repeats > 1:
                self._narrow()  # (the smaller cache: mem_len + 1 slots)
                assert self.cache is not None
                self.cache.repeat_rows(repeats)
                hidden = hidden.repeat_interleave(repeats, dim=0)
            if self.device.type == "cpu" and self.head.prunes(sampling):
                return self.head.select(hidden, sampling, generator)
            return sample(self.head.scores(hidden), sampling, generator)

        return self._call(run)

    def step_tokens(
        self, ids: Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
    ) -> Tensor:
        """Feed one token per row ([B] ids); the next token per row [B], drawn with
        ``sampling``. The draw's random numbers are drawn first, outside the step (one
        kernel), so the step itself is the same function every token."""
        ids = ids.view(-1).to(self.device)
        step = self._stepper(sampling)

        def run() -> Tensor:
            noise = draw_noise(sampling, ids.size(0), self.head.vocab_size, generator,
                               self.device, self.score_dtype)  # fmt: skip
            return step(ids, noise)

        return self._call(run)

    def step_scores(self, ids: Tensor) -> Tensor:
        """Feed one token per row ([B] ids); sampling scores [B, V] of the next one."""
        return self._call(lambda: self._stepper(None)(ids.view(-1).to(self.device)))

    def step(self, ids: Tensor) -> Tensor:
        """Feed one token per row ([B] ids); log-probabilities [B, V] of the next one."""
        return self.head.normalise(self.step_scores(ids))

    def _narrow(self) -> None:
        """After the prompt the cache of one-token steps has mem_len + 1 slots."""
        assert self.cache is not None, "prefill first"
        if self.cache.max_len != 1:
            self.cache = self.cache.resized(1)
            self._steps.clear()

    def _stepper(self, sampling: SamplingConfig | None = None) -> Callable[..., Tensor]:
        """The step to call, plain, compiled, or replayed from a CUDA graph: ids -> scores
        (``sampling`` None: ``step_fn``) or ids, noise -> next ids (``token_fn``). One per
        sampling setting (a compiled step holds it as a constant)."""
        self._narrow()
        fn = self._steps.get(sampling)
        if fn is None:
            if sampling is None:
                fn = self.step_fn
            else:
                fn = functools.partial(self.token_fn, sampling=sampling)
            fn = self._autocast_off(fn)
            if self.compile:  # True: inductor; a string (or a callable) names another backend
                backend = "inductor" if self.compile is True else self.compile
                fn = step_code(fn, sampling)
                fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
            if self.cuda_graph:
                fn = GraphedStep(fn)
            self._steps[sampling] = fn
        return fn

    def _autocast_off(self, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """The one-token step casts explicitly (its weights are in the decoder's dtype):
        autocast off, whatever the caller's."""
        device = self.device.type

        def run(*inputs: Tensor | None) -> Tensor:
            if not torch.is_autocast_enabled(device):  # (entering the context costs a step)
                return fn(*inputs)
            with torch.autocast(device, enabled=False):
                return fn(*inputs)

        return run


# one code object per sampling setting (None: the scores step), see ``step_code``
_STEP_CODE: dict[SamplingConfig | None, types.CodeType] = {}


def step_code(fn: Callable[..., Tensor], sampling: SamplingConfig | None) -> Callable[..., Tensor]:
    """``fn`` behind a function whose code object is the one for ``sampling``. Dynamo keeps
    the graphs it compiles per code object, at most ``recompile_limit`` (8), and a step with
    ``fullgraph=True`` fails past them. Every step would otherwise share one code object
    (``_autocast_off``'s), so the ninth sampling setting compiled in a process would fail;
    with one per setting, decoders of the same setting still reuse each other's graphs (the
    guards pass for the same model and shapes) and each setting has its own eight."""

    def run(*inputs: Tensor | None) -> Tensor:
        return fn(*inputs)

    code = _STEP_CODE.setdefault(sampling, run.__code__.replace())  # equal, distinct
    return types.FunctionType(code, run.__globals__, run.__name__, None, run.__closure__)


class GraphedStep:
    """A decoding step captured in a CUDA graph on its second call and replayed after: one
    launch per token instead of one per operation. The first call runs eagerly (it warms up
    the kernels and, being a real step, leaves the cache as it should be); capturing records
    without running, so the capturing call then replays once. Inputs (the ids, and the
    draw's random numbers for a token step; None stays None) are copied into static buffers
    of the shapes the graph was captured with; the output is the graph's own buffer,
    overwritten by the next replay. One graph per step function, so per batch size and
    sampling setting."""

    def __init__(self, fn: Callable[..., Tensor]) -> None:
        self.fn = fn
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[Tensor | None] = []

    def __call__(self, *inputs: Tensor | None) -> Tensor:
        self.calls += 1
        if self.calls == 1:
            return self.fn(*inputs)
        if self.graph is None:
            self.inputs = [None if x is None else x.clone() for x in inputs]
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.fn(*self.inputs)
        else:
            for buffer, x in zip(self.inputs, inputs, strict=True):
                if buffer is not None:
                    buffer.copy_(x)
        self.graph.replay()
        return self.out
