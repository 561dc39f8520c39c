"""The decoder: a model's next-token distributions over a growing context, one step at a time.

Dimension legend
    B  rows (prompts x samples)     P  padded prompt length       L  segment length
    M  memory length (<= mem_len)   S  cache slots (mem_len + L; mem_len + 1 to decode)
    N  layers   D  model dim   V  vocabulary   E  the head's embedding dim   C  tail clusters

Procedure (Appendix E): the context is read in segments of ``tgt_len`` with memory carried
from segment to segment, so the memory holds the newest ``mem_len`` states of every layer;
the last context token's distribution gives the first new token; then every new token is fed
as a one-token segment that attends to the memory plus itself.

Two calls: ``prefill(prompts)`` reads the prompts, ``step(ids)`` feeds one token per row;
each gives the next-token log-probabilities [B, V], or, given a ``SamplingConfig``, the next
token per row [B], drawn inside the step.

Why a cache. Transformer-XL's memory stores each layer's *input* hidden states; a forward pass
re-projects all M of them to keys and values, O(M D^2) per layer and token. The projections
never change once made (inference: no dropout, fixed weights), so the decoder keeps them in
the model's ``KVCache`` (txlm.model.cache) and runs the model's own ``transform`` over it: a
step projects one token and attends over the cached slots (the layers' one forward, which
takes every query length), and the context segments fill the same cache, so no memory state
is ever projected twice. ``cache=False`` is the reference: the model's forward with the
hidden-state memory, re-projected every step, drawing from the full distribution.

Segmentation of the context is aligned to its END (the last segment is full, the first holds
the remainder). Two reasons: the token that predicts the first new word sees the most context,
and prompts of different lengths, left-padded to a common length, are then split at the same
places as each would be alone. Pad positions are hidden from real tokens with the model's
document mask (each row's first real token starts a document), so every row of a batch equals
running it alone.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from txlm.errors import ConfigError
from txlm.inference.compiled import PACKAGE, StepCompile, bucket, pad, step_compile
from txlm.inference.packaged import (
    Source,
    kept,
    kept_for,
    model_key,
    packaged,
    weights_as_reductions,
)
from txlm.inference.precision import narrow_linear, narrowed
from txlm.inference.reductions import products_as_reductions
from txlm.inference.sampling import SamplingConfig, clusters_needed, draw_noise, sample
from txlm.model.cache import KVCache
from txlm.model.lengths import Lengths
from txlm.model.modes import evaluating
from txlm.model.transformer import TransformerXL


def check_ids(rows: list[list[int]], vocab_size: int) -> None:
    for r in rows:
        bad = [x for x in r if not 0 <= x < vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


class Decoder:
    """Incremental decoder: ``prefill(prompts)``, then ``step(ids)`` per token.

    ``prefill`` reads the prompts in segments of up to tgt_len through a cache of mem_len +
    tgt_len slots; then the cache is narrowed to mem_len + 1 slots and every new token is a
    one-token step over it: the model's own forward (its layers called as modules, so their
    hooks fire), then the model's adaptive softmax.

    Modes. Eager (the default on a CPU): the cache keeps its write position on the host too,
    so a step that needs no mask skips it. ``compile``: the step under
    ``torch.compile(fullgraph=True, dynamic=False)`` (txlm.inference.compiled: "auto", where
    some package of the model is kept as the decoder is made, the packaged step for a
    sampling setting with a package kept, decided at the setting's first prefill (the eager
    step for a bucket with none), else none; True is
    inductor as it measured best on the device, a string names the backend, e.g.
    "aot_eager", "package" a step exported and compiled ahead of time, kept on disk
    (txlm.inference.packaged), a ``StepCompile`` says all), made for the batch's bucket: B
    rows run the bucket K >= B over a cache padded to K rows, the padding's outputs dropped,
    so rows that join or leave within a bucket compile nothing; ``cuda_graph`` (the default
    on CUDA): the step captured in a CUDA graph and replayed per token. Both need the static
    cache: the same shapes and operations every step, no host synchronisation.
    ``cache=False``: no cache, the model's forward over the hidden-state memory every step
    (the reference; ``compile`` and ``cuda_graph`` are the cached step's and do not apply).

    A drawing step (C36) is ids + the draw's random numbers -> the next ids: the random
    numbers are drawn just before, outside it, from the caller's generator (one kernel), so
    the step itself is a pure function, compiled or captured with its draw, and a compiled
    step draws the tokens an eager one draws with the same generator. Where the draw goes
    through the pruned softmax is decided in one place, ``_output``.

    ``dtype``: the weight products' dtype, fixed here: autocast's when it is on for the
    model's device as the decoder is made (and the weights are float32), else the weights'.
    A bf16 decoder runs ``txlm.inference.precision.narrowed(model, "bf16")``, the model with
    its layers' projections held in bf16 (made once; the model is not copied or changed), and
    its own copy of the output layer in that dtype; its cache and the attention over it are
    bf16 too, except for an eager step on a CPU, where they stay float32 (the library's bf16
    attention products are slower there). ``int8``: the layers' and the head's weights in
    int8 (weight-only), their products on bf16 inputs; a packaged int8 step keeps its cache
    in bf16 as a bf16 one does. The model runs in eval mode during each call and returns to
    its mode.
    """

    def __init__(
        self,
        model: TransformerXL,
        *,
        lengths: Lengths | None = None,
        cache: bool = True,
        compile: bool | str | Callable = False,
        cuda_graph: bool | None = None,
        dtype: torch.dtype | None = None,
        int8: bool = False,
    ) -> None:
        self.model = model
        self.lengths = model.lengths if lengths is None else lengths
        p = model.embed.layers[0].weight
        self.device, self.weight_dtype = p.device, p.dtype
        self.cached = cache
        if dtype is None:
            dtype = self.weight_dtype
            device = self.device.type
            if cache and dtype == torch.float32 and torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
        self.dtype = dtype
        half = dtype in (torch.float16, torch.bfloat16)
        cpu_f32 = self.device.type == "cpu" and self.weight_dtype == torch.float32
        # a packaged step on a CPU reads its cache in bf16 for int8 weights too (their
        # products take bf16 inputs); an eager half or int8 step's stays float32, below
        self.cache_dtype = torch.bfloat16 if int8 and cpu_f32 else dtype
        auto = compile == "auto"  # (decided below, once the decoder's weights are made)
        self.compile = step_compile(False if auto else compile, self.device) if cache else None
        if self.compile == PACKAGE and self.device.type != "cpu":
            raise ConfigError("a packaged decoding step (compile='package') runs on a CPU")
        # A compiled step is captured too: inductor's own graphs ("reduce-overhead") refuse a
        # step that writes into the cache it is given, while a manual capture of the compiled
        # step replays its fused kernels as one launch.
        graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        self.cuda_graph = cache and graph
        self.score_dtype = torch.float32 if half else dtype  # the output layer's (upcast)
        # what the cached calls run: the model, or it with its projections in bf16 or int8
        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        if int8:
            if dtype != torch.float32 or not cache:
                raise ConfigError("an int8 decoder runs a float32 model with its cache")
            precision = "int8"
        self.precision = precision
        self.net = narrowed(model, precision) if cache else model  # (for one decoder's life)
        softmax = model.softmax
        with torch.no_grad():
            if dtype != self.weight_dtype:  # the output layer's own copy in the decoder's dtype
                softmax = copy.deepcopy(softmax).to(dtype)
            self.softmax = softmax
            # the head's weight joined with its cluster rows once: one product a step
            weight, bias, _ = softmax._weights(0)
            if softmax.n_clusters:
                weight = torch.cat([weight, softmax.cluster_weight])
                bias = torch.cat([bias, softmax.cluster_bias])
            head = nn.Linear(weight.size(1), weight.size(0), device=self.device, dtype=dtype)
            head.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
            head.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
            self.head = narrow_linear(head, precision)
        # the name of the decoder's packages (txlm.inference.packaged), where it runs them
        self.package_key: str | None = None
        if self.compile == PACKAGE:
            self.package_key = model_key(self._source())
        elif auto and cache and self.device.type == "cpu":
            self.package_key = kept(self._source())  # (None: no package of this model)
        self.auto = auto and self.package_key is not None  # (then decided per setting)
        self._kept_for: dict[SamplingConfig | None, bool] = {}  # auto's choice per setting
        # the cache's dtype: a packaged step's kernels read a half cache faster (half the
        # bytes); the library's half products over a cache measured slower than float32
        # ones on a CPU, so an eager or torch.compile'd step's is float32 there
        eager = torch.float32 if cpu_f32 and (half or int8) else self.cache_dtype
        self._cache_dtypes = (eager, self.cache_dtype)  # (an eager step's, a packaged one's)
        self._choose(None)
        # how a compiled step skips a tail cluster no row needs (AdaptiveLogSoftmax.log_prob):
        # a CPU takes a branch in its compiled code; a GPU's step reads nothing back
        self.traced_branch = "graph" if self.device.type == "cpu" else "none"
        self.cache: KVCache | None = None  # made per prefill
        self.mems: list[Tensor] | None = None  # the hidden-state memory (cache=False)
        self.mem_mask: Tensor | None = None
        # the step functions over this cache, per sampling setting (None: log-probabilities)
        self._steps: dict[SamplingConfig | None, Callable[..., Tensor]] = {}

    def _choose(self, sampling: SamplingConfig | None) -> None:
        """The step the next cache is made for: with ``compile="auto"``, the packaged one
        where a package of ``sampling``'s step is kept (any bucket), else the eager one,
        decided once per setting in a decoder's life (a server's caches, spliced into one
        batch, are then all of one kind whatever is packaged meanwhile)."""
        if self.auto:
            assert self.package_key is not None
            if sampling not in self._kept_for:
                self._kept_for[sampling] = kept_for(self.package_key, sampling)
            self.compile = PACKAGE if self._kept_for[sampling] else None
        self.cache_dtype = self._cache_dtypes[self.compile == PACKAGE]
        self.static = self.compile is not None or self.cuda_graph

    # -- the two calls ------------------------------------------------------------------
    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        start_id: int | None = None,
        repeats: int = 1,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Read the prompts (left-padded, end-aligned segments); [B, V] next-token
        log-probabilities, or with ``sampling`` the first new token per row [B], drawn from
        ``generator``. ``start_id``: the token an empty prompt starts from. ``repeats``:
        rows per prompt (prompt-major: prompt b's copies are rows b * repeats ..), each
        prompt read once and its cache rows repeated, the same as reading it ``repeats``
        times."""
        rows = [list(r) for r in prompts]
        if not self.cached:  # (no cache to repeat rows of: read again)
            rows, repeats = [r for r in rows for _ in range(repeats)], 1

        def run() -> Tensor:
            if self.auto:  # (the cache _read makes is the one for this setting's step)
                self._choose(sampling)
            hidden = self._read(rows, start_id)  # [B, D]
            if repeats > 1:
                self._narrow()  # (the smaller cache: mem_len + 1 slots)
                assert self.cache is not None
                self.cache.repeat_rows(repeats)
                hidden = hidden.repeat_interleave(repeats, dim=0)
            noise = self._noise(sampling, generator, hidden.size(0))
            return self._output(hidden, sampling, noise)

        return self._call(run)

    def step(
        self,
        ids: Tensor,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Feed one token per row ([B] ids); [B, V] log-probabilities of the next one, or
        with ``sampling`` the next token per row [B]. The draw's random numbers are drawn
        first, outside the step (one kernel), so the step is the same function every token."""
        ids = ids.view(-1).to(self.device)

        def run() -> Tensor:
            # (inside the call: the cache narrowed by the first step is an inference tensor too)
            noise = self._noise(sampling, generator, ids.size(0))
            if not self.cached:
                return self._token(ids, noise, sampling)
            step = self._stepper(sampling)
            if self.compile is None:
                return step(ids, noise)
            # the bucket's batch (txlm.inference.compiled): padding rows, their outputs dropped
            assert self.cache is not None
            rows = ids.size(0)
            if rows != self.cache.rows:
                raise ValueError(f"{rows} ids for a cache of {self.cache.rows} rows")
            self.cache.pad_rows(bucket(rows))
            return step(pad(ids, self.cache.batch), pad(noise, self.cache.batch))[:rows]

        return self._call(run)

    # -- reading the prompts ------------------------------------------------------------
    def _read(self, rows: list[list[int]], start_id: int | None) -> Tensor:
        """Read the prompts; the last position's output [B, D]."""
        if not rows:
            raise ConfigError("no prompts given")
        if any(not r for r in rows):
            if start_id is None:
                raise ConfigError("an empty prompt needs a start token (start_id)")
            rows = [r if r else [int(start_id)] for r in rows]
        check_ids(rows, self.model.config.vocab_size)
        batch, width = len(rows), max(len(r) for r in rows)
        ids = torch.zeros(batch, width, dtype=torch.long)
        starts = torch.zeros(batch, width, dtype=torch.bool)
        for b, r in enumerate(rows):
            ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            starts[b, width - len(r)] = True
        ids, starts = ids.to(self.device), starts.to(self.device)
        padded = any(len(r) < width for r in rows)

        self.mems, self.mem_mask = None, None
        if self.cached:
            self.cache = self.net.new_cache(
                batch, lengths=self.lengths, dtype=self.cache_dtype, static=self.static
            )
            self._steps.clear()
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

    def _segment(self, ids: Tensor, reset: Tensor | None) -> Tensor:
        """Read one segment [B, L] through the memory; hidden states [B, L, D]."""
        if not self.cached:
            hidden, self.mems, self.mem_mask = self.model.transform(
                ids, self.mems, reset, self.mem_mask, lengths=self.lengths
            )
            return hidden
        hidden, _, _ = self.net.transform(ids, None, reset, None, cache=self.cache)
        return hidden

    # -- the output layer ---------------------------------------------------------------
    def log_probs(self, hidden: Tensor) -> Tensor:
        """The decoder's output layer (its head in its precision) on hidden states [N, D]:
        log-probabilities [N, V], float32 at least. What a step gives; a server reads a
        prompt's own log-probabilities through it too."""
        hidden = hidden if hidden.dtype == self.dtype else hidden.to(self.dtype)
        return self.softmax.log_prob(hidden, head=self.head)

    # -- one token ----------------------------------------------------------------------
    def _output(
        self, hidden: Tensor, sampling: SamplingConfig | None, noise: Tensor | None
    ) -> Tensor:
        """The output layer on the last positions [B, D]: log-probabilities [B, V]
        (``sampling`` None), or the next token per row [B] drawn with ``noise``.

        Where a draw skips the tail clusters that cannot hold it (txlm.inference.sampling.
        clusters_needed): in a compiled step, by ``traced_branch`` (a CPU: a branch in the
        graph, ``torch.cond``, so a skipped cluster's product is not run; a GPU:
        branch-free, each cluster chosen on the device, one graph a CUDA graph captures, a
        skipped cluster's product for one row fused into a read of one row of its weight),
        and eagerly on a CPU (a host branch per cluster, free there); not in an eager step
        on a GPU (the branch would wait for the device)
        or one replayed from a CUDA graph (eagerly, the branch-free form would copy the
        weight it means not to read), nor without a cache (the reference draws from the
        full distribution)."""
        hidden = hidden if hidden.dtype == self.dtype else hidden.to(self.dtype)
        if sampling is None:
            return self.log_probs(hidden)
        traced = torch.compiler.is_compiling()
        need = None
        if self.cached and (traced or self.device.type == "cpu"):
            need = clusters_needed(sampling, self.softmax.shortlist, noise)
        branch = self.traced_branch if traced else "host"
        scores = self.softmax.log_prob(hidden, need, head=self.head, branch=branch, normalise=False)
        return sample(scores, sampling, noise=noise)

    def _noise(self, sampling: SamplingConfig | None, generator, batch: int) -> Tensor | None:
        """The random numbers of a draw over ``batch`` rows (txlm.inference.sampling.draw_noise);
        None for no draw."""
        if sampling is None:
            return None
        vocab = self.model.config.vocab_size
        return draw_noise(sampling, batch, vocab, generator, self.device, self.score_dtype)

    def _token(self, ids: Tensor, noise: Tensor | None, sampling: SamplingConfig | None) -> Tensor:
        """One token per row, ids [B] (+ the draw's noise) -> log-probs [B, V] or the next
        ids [B]. Over a static cache: static shapes, no host synchronisation, so it is
        compiled or captured as it is."""
        if not self.cached:
            hidden = self._segment(ids.view(-1, 1), None)
        else:
            # traced for one row: products as reductions the compiler fuses; exported for a
            # package, the weights' too where the package says so (txlm.inference.packaged)
            products = contextlib.nullcontext()
            if torch.compiler.is_compiling() and ids.numel() == 1:
                exporting = torch.compiler.is_exporting()
                weights = not exporting or weights_as_reductions(self.precision)
                products = products_as_reductions(weights=weights, frozen=exporting)
            with products:
                hidden, _, _ = self.net.transform(ids.view(-1, 1), cache=self.cache)
        return self._output(hidden[:, -1], sampling, noise)

    def _call(self, fn: Callable[[], Tensor]) -> Tensor:
        """``fn()`` with the model in eval mode (dropout off: the cache is exact only for a
        deterministic forward). Cached: in inference mode (no autograd bookkeeping: version
        counters, views, which a few hundred small operations a step would feel; the cache
        is only ever written in this mode) and with autocast off, the decoder casting
        explicitly, the result copied out, an ordinary tensor; without a cache under no_grad
        (its memory: ordinary tensors) and the caller's autocast."""
        if not self.cached:
            with evaluating(self.net), torch.no_grad():
                return fn()
        device = self.device.type
        off = contextlib.nullcontext()
        if torch.is_autocast_enabled(device):  # (making the context costs a step)
            off = torch.autocast(device, enabled=False)
        with evaluating(self.net), torch.inference_mode(), off:
            out = fn()
        return out.clone()

    def _source(self) -> Source:
        """What a packaged step of this decoder is made of (txlm.inference.packaged)."""
        return Source(
            token=self._token, cache=lambda: self.cache, modules=(self.net, self.head),
            precision=self.precision, setting=(self.lengths, self.cache_dtype),
        )  # fmt: skip

    def _narrow(self) -> None:
        """After the prompt the cache of one-token steps has mem_len + 1 slots."""
        assert self.cache is not None, "prefill first"
        if self.cache.max_len != 1:
            self.cache = self.cache.resized(1)
            self._steps.clear()

    def _stepper(self, sampling: SamplingConfig | None = None) -> Callable[..., Tensor]:
        """The cached step to call, plain, compiled, or replayed from a CUDA graph: ids
        (+ the draw's noise) -> log-probs, or the next ids with ``sampling`` (``_token``).
        One per sampling setting (a compiled step holds it as a constant)."""
        self._narrow()
        fn = self._steps.get(sampling)
        if fn is None:

            def fn(ids: Tensor, noise: Tensor | None = None) -> Tensor:
                return self._token(ids, noise, sampling)

            if self.compile == PACKAGE:  # exported and compiled ahead of time, kept on disk
                assert self.package_key is not None
                # (auto runs the packages kept, never makes one)
                fn = packaged(self._source(), self.package_key, sampling, make=not self.auto)
            elif self.compile is not None:
                fn = self.compile(own_code(fn, (sampling, self.compile)))
            if self.cuda_graph:
                fn = graphed(fn)
            self._steps[sampling] = fn
        return fn


# one code object per sampling setting (None: the log-probabilities step) and way of
# compiling, see ``own_code``
_STEP_CODE: dict[tuple[SamplingConfig | None, StepCompile], types.CodeType] = {}


def own_code(
    fn: Callable[..., Tensor], key: tuple[SamplingConfig | None, StepCompile]
) -> Callable[..., Tensor]:
    """``fn`` with the code object kept for ``key``, a sampling setting and a way of
    compiling: what ``torch.compile`` is given.
    Dynamo keeps the graphs it compiles per code object, at most ``recompile_limit`` (8),
    and a ``fullgraph`` step fails past them. Every step function is a closure of one
    function, so it shares its code object with every other setting's (a distinct closure
    or ``functools.partial`` per setting shares it too), and the ninth setting compiled in a
    process would fail; with one per setting, decoders of the same setting still reuse each
    other's graphs (the guards pass for the same model and shapes) and each setting has its
    own eight. Raising the limit instead would be a global setting of torch's."""
    code = _STEP_CODE.setdefault(key, fn.__code__.replace())  # equal, distinct
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def graphed(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` captured in a CUDA graph on its second call and replayed after: one launch per
    token instead of one per operation. The first call runs eagerly (it warms up the
    kernels and, being a real step, leaves the cache as it should be); capturing records
    without running, so the capturing call then replays once. Inputs (the ids, and the
    draw's random numbers; None stays None) are copied into static buffers of the shapes
    the graph was captured with; the output is the graph's own buffer, overwritten by the
    next replay (the decoder hands out a copy). One graph per step function, so per batch
    size and sampling setting."""
    graph: torch.cuda.CUDAGraph | None = None
    buffers: list[Tensor | None] = []
    out: Tensor | None = None
    calls = 0

    def run(*inputs: Tensor | None) -> Tensor:
        nonlocal graph, buffers, out, calls
        calls += 1
        if calls == 1:
            return fn(*inputs)
        if graph is None:
            buffers = [None if x is None else x.clone() for x in inputs]
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn(*buffers)
        else:
            for buffer, x in zip(buffers, inputs, strict=True):
                if buffer is not None:
                    buffer.copy_(x)
        graph.replay()
        assert out is not None
        return out

    return run
