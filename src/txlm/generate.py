"""Generation: the paper's sampling procedure (Appendix E), decoded incrementally from a cache.

Dimension legend
    B  rows (prompts x samples)     P  padded prompt length       L  segment length
    M  memory length (<= mem_len)   S  cache slots (mem_len + L; mem_len + 1 to decode)
    N  layers   H  heads   Dh head dim   D  model dim   V  vocabulary

Procedure (Appendix E): the context is read in segments of ``tgt_len`` with memory carried
from segment to segment, so the memory holds the newest ``mem_len`` states of every layer; the
last context token's distribution gives the first new token; then every new token is fed as a
one-token segment that attends to the memory plus itself, and the next one is sampled from the
renormalised top-k (k = 40 by default), optionally top-p, at a temperature.

Why a cache. Transformer-XL's memory stores each layer's *input* hidden states; a forward pass
re-projects all M of them to keys and values, O(M D^2) per layer and token. The projections
never change once made (inference: no dropout, fixed weights), so ``CachedDecoder`` keeps them
in the model's ``KVCache`` (txlm.model.cache) and runs the model's own forward over it: a step
projects one token and attends over the cached slots, O(M D) attention work per layer, and
the context segments fill the same cache, so no memory state is ever projected twice.

Sampling happens on the device (``sample``: top-k among k candidates, top-p, temperature,
greedy, exponential-race draws from the given generator): no step or draw reads a value back
to the host, and ``stream`` syncs once per token, to hand the ids out.

Segmentation of the context is aligned to its END (the last segment is full, the first holds
the remainder). Two reasons: the token that predicts the first new word sees the most context,
and prompts of different lengths, left-padded to a common length, are then split at the same
places as each would be alone. Pad positions are hidden from real tokens with the model's
document mask (each row's first real token starts a document), so every row of a batch equals
running it alone.

An empty prompt starts from ``start_id`` (the vocabulary's end-of-sequence symbol in the CLI):
in the paper's word-level corpora every line ends with it, so it is what precedes a new text.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from txlm.errors import ConfigError
from txlm.model.cache import KVCache
from txlm.model.one_token import OneTokenStep
from txlm.model.transformer import TransformerXL

PromptLike = Sequence[int] | Tensor


# -- sampling ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is drawn from a distribution.

    ``top_k``: keep the k most likely tokens (None: all). ``top_p``: then keep the smallest set
    of most likely tokens whose mass reaches p (nucleus sampling; None or 1.0: all).
    ``temperature`` divides the log-probabilities first. ``greedy`` takes the argmax and
    ignores the rest. The kept mass is renormalised before drawing.
    """

    top_k: int | None = 40
    top_p: float | None = None
    temperature: float = 1.0
    greedy: bool = False

    def __post_init__(self) -> None:
        k, p, t = self.top_k, self.top_p, self.temperature
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ConfigError(f"top-k must be an integer >= 1, got {k!r}")
        if p is not None and (not isinstance(p, int | float) or not 0.0 < p <= 1.0):
            raise ConfigError(f"top-p must be in (0, 1], got {p!r}")
        if not self.greedy and (not isinstance(t, int | float) or not t > 0.0 or math.isinf(t)):
            raise ConfigError(
                f"temperature must be a positive number (or use greedy decoding), got {t!r}"
            )


def filter_log_probs(log_probs: Tensor, config: SamplingConfig) -> Tensor:
    """[B, V] log-probabilities -> [B, V] scores with the excluded tokens at -inf.

    The result is unnormalised; softmax of it is the renormalised sampling distribution.
    """
    scores = log_probs.float() / config.temperature
    vocab = scores.size(-1)
    if config.top_k is not None and config.top_k < vocab:
        # exactly the k largest (a tie at the k-th score is broken by ``topk``'s order: a
        # rule that needs no look at the values on the host)
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep.scatter_(-1, scores.topk(config.top_k, dim=-1).indices, True)
        scores = scores.masked_fill(~keep, float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # Mass strictly before each token: a token is kept while the mass before it is < p,
        # so the most likely token always stays and the kept set's mass is >= p.
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample(
    scores: Tensor, config: SamplingConfig, generator: torch.Generator | None = None
) -> Tensor:
    """Draw one token per row: [B, V] scores -> [B] ids.

    ``scores`` are log-probabilities or raw logits: only their differences within a row
    matter (the kept mass is renormalised), so the decoder can skip the log-softmax.
    """
    if config.greedy:
        return scores.argmax(dim=-1)
    top = top_k_candidates(scores, config)
    if top is not None:
        probs, ids = top
        return ids.gather(1, _draw(probs, generator)).squeeze(1)
    probs = filter_log_probs(scores, config).softmax(dim=-1)
    return _draw(probs, generator).squeeze(1)


def top_k_candidates(scores: Tensor, config: SamplingConfig) -> tuple[Tensor, Tensor] | None:
    """[B, V] scores -> (probabilities [B, k], their token ids [B, k]), or None.

    The distribution of ``filter_log_probs`` restricted to the k tokens it keeps: one
    ``topk`` and a softmax over k values instead of masking and normalising the whole
    vocabulary, and a draw over k candidates (an exponential per candidate, see ``_draw``).
    None when there is no top-k cut. Device work only: no value is read on the host.
    """
    k, vocab = config.top_k, scores.size(-1)
    if k is None or k >= vocab:
        return None
    vals, ids = _upcast(scores).topk(k, dim=-1)  # [B, k], largest first
    kept = vals / config.temperature
    if config.top_p is not None and config.top_p < 1.0:
        probs = kept.softmax(dim=-1)  # already sorted: the nucleus rule of filter_log_probs
        before = probs.cumsum(dim=-1) - probs
        kept = kept.masked_fill(before >= config.top_p, float("-inf"))
    return kept.softmax(dim=-1), ids


def _draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row of [B, k] probabilities -> [B, 1]: ``torch.multinomial(probs, 1)``
    without its input checks (a dozen small operations; softmax output needs none).

    It is the same computation (ATen draws a single sample as argmax p_i / E_i with E_i
    exponential, one per candidate), so the same generator state gives the same index.
    """
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1, keepdim=True)


def _upcast(x: Tensor) -> Tensor:
    """Half-precision scores are compared and normalised in float32; others stay."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


# -- prompts ----------------------------------------------------------------------------------
def _as_rows(prompts: PromptLike | Sequence[PromptLike]) -> list[list[int]]:
    """Normalise to a list of id lists (one prompt becomes one row)."""
    if isinstance(prompts, Tensor):
        if prompts.dim() == 1:
            return [prompts.tolist()]
        if prompts.dim() == 2:
            return prompts.tolist()
        raise ConfigError(f"prompt ids must be [P] or [B, P], got shape {tuple(prompts.shape)}")
    rows = list(prompts)
    if not rows or all(isinstance(x, int) for x in rows):
        return [[int(x) for x in rows]]
    out = []
    for r in rows:
        if isinstance(r, Tensor):
            r = r.tolist()
        if not all(isinstance(x, int) for x in r):
            raise ConfigError("prompt ids must be integers")
        out.append([int(x) for x in r])
    return out


def _check_ids(rows: list[list[int]], vocab_size: int) -> None:
    for r in rows:
        bad = [x for x in r if not 0 <= x < vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


# -- decoders ---------------------------------------------------------------------------------
class _Decoder:
    """Shared by the cached and uncached decoders: reading the context."""

    def __init__(self, model: TransformerXL) -> None:
        self.model = model
        c = model.config
        self.config = c
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.batch = 0

    # The subclasses keep their state from these hooks.
    def _begin(self, batch: int) -> None:
        raise NotImplementedError

    def _segment(self, ids: Tensor, reset: Tensor | None, *, last: bool = False) -> Tensor:
        """Read one context segment; hidden states [B, L, D] (with ``last``, the prompt's
        final segment, [B, >= 1, D]: only the final position's is used)."""
        raise NotImplementedError

    def _step_hidden(self, ids: Tensor) -> Tensor:
        """Feed one token per row ([B] ids); the last layer's output [B, D] for it."""
        raise NotImplementedError

    def scores(self, hidden: Tensor) -> Tensor:
        """[B, D] -> [B, V] sampling scores: log-probabilities up to a constant per row."""
        return self.log_probs(hidden)

    def log_probs(self, hidden: Tensor) -> Tensor:
        """[B, D] -> [B, V] next-token log-probabilities."""
        return self.model.softmax.log_prob(hidden)

    def _run(self, fn: Callable[[], Tensor]) -> Tensor:
        """Run a decoder computation without autograd."""
        with torch.no_grad():
            return fn()

    def step(self, ids: Tensor) -> Tensor:
        """Feed one token per row ([B] ids); log-probabilities [B, V] of the next one."""
        return self._run(lambda: self.log_probs(self._step_hidden(ids)))

    def step_scores(self, ids: Tensor) -> Tensor:
        """As ``step`` but unnormalised (``scores``): what ``sample`` needs, and cheaper."""
        return self._run(lambda: self.scores(self._step_hidden(ids)))

    def prefill(self, prompts: Sequence[Sequence[int]], *, start_id: int | None = None) -> Tensor:
        """Read the prompts (left-padded, end-aligned segments); [B, V] next-token log-probs."""
        return self._run(lambda: self.log_probs(self._read(prompts, start_id)))

    def prefill_scores(
        self, prompts: Sequence[Sequence[int]], *, start_id: int | None = None
    ) -> Tensor:
        """As ``prefill`` but unnormalised (``scores``)."""
        return self._run(lambda: self.scores(self._read(prompts, start_id)))

    def _read(self, prompts: Sequence[Sequence[int]], start_id: int | None) -> Tensor:
        """Read the prompts; the last position's output [B, D]."""
        rows = [list(r) for r in prompts]
        if not rows:
            raise ConfigError("no prompts given")
        if any(not r for r in rows):
            if start_id is None:
                raise ConfigError("an empty prompt needs a start token (start_id)")
            rows = [r if r else [int(start_id)] for r in rows]
        _check_ids(rows, self.config.vocab_size)
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
        bounds = self._segments(width)
        for i, (lo, hi) in enumerate(bounds):
            reset = starts[:, lo:hi] if padded else None
            hidden = self._segment(ids[:, lo:hi], reset, last=i == len(bounds) - 1)
        assert hidden is not None
        return hidden[:, -1]

    def _segments(self, width: int) -> list[tuple[int, int]]:
        """[lo, hi) bounds of the context segments: full tgt_len ones, the remainder first."""
        tgt = self.config.tgt_len
        first = width % tgt or tgt
        bounds = [(0, first)]
        while bounds[-1][1] < width:
            lo = bounds[-1][1]
            bounds.append((lo, lo + tgt))
        return bounds


class UncachedDecoder(_Decoder):
    """Reference decoder: every step is ``model(...)`` with the hidden-state memory, which the
    model re-projects to keys and values each time (how Transformer-XL's forward works)."""

    def _begin(self, batch: int) -> None:
        self.mems: list[Tensor] | None = None
        self.mem_mask: Tensor | None = None

    def _segment(self, ids: Tensor, reset: Tensor | None, *, last: bool = False) -> Tensor:
        hidden, self.mems, self.mem_mask = self.model.transform(
            ids, self.mems, reset, self.mem_mask
        )
        return hidden

    def _step_hidden(self, ids: Tensor) -> Tensor:
        return self._segment(ids.view(-1, 1).to(self.device), None)[:, -1]


class CachedDecoder(_Decoder):
    """Incremental decoder: the model's own forward (``TransformerXL.transform``) with a
    ``KVCache`` (txlm.model.cache), so no memory state is ever projected twice.

    The prompt is read in segments of up to tgt_len through a cache of mem_len + tgt_len
    slots; then the cache is narrowed to mem_len + 1 slots and every new token is a one-token
    segment over it (``step_fn``): static shapes and no host synchronisation, so on CUDA the
    step is captured once in a CUDA graph and replayed per token (``cuda_graph``), and it
    can be compiled (``compile``: ``torch.compile(fullgraph=True, dynamic=False)``; a string
    names the backend, e.g. "aot_eager").

    Eager steps on a CPU (no compile, no graph) use the cache's unmasked one-token steps and,
    where it is the same computation, the one-token step of txlm.model.one_token over the same
    cache (``one_token=False``: the modules for every step): at batch 1 a CPU step is bound by
    per-call overhead, and that step makes fewer calls than the modules.

    Under autocast with float32 weights the decoder runs a copy of the model held in the
    autocast dtype (made once, not a cast of every weight every token); on a CPU the cache
    and the one-query attention stay float32 (bf16 matrix-vector products are slower there).
    """

    def __init__(
        self,
        model: TransformerXL,
        *,
        compile: bool | str = False,
        cuda_graph: bool | None = None,
        one_token: bool = True,
    ) -> None:
        super().__init__(model)
        self.compile = compile
        self.one_token = one_token  # the CPU one-token step where it applies (eager steps)
        # A compiled step is captured too: inductor's own graphs ("reduce-overhead") refuse a
        # step that writes into the cache it is given (measured on an H200: 111 tok/s, below
        # the eager step's 169), while a manual capture of the compiled step replays its fused
        # kernels as one launch.
        if cuda_graph is None:
            cuda_graph = self.device.type == "cuda"
        self.cuda_graph = cuda_graph
        self.cache: KVCache | None = None  # made per prefill, by _begin
        self._prepare(self._autocast_dtype())

    def _autocast_dtype(self) -> torch.dtype:
        """The matmuls' dtype: autocast's when it is on for the model's device (and the
        weights are float32), else the weights' own."""
        device = self.device.type
        if self.dtype == torch.float32 and torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
        return self.dtype

    def _prepare(self, dtype: torch.dtype) -> None:
        """Run on a copy of the model in ``dtype`` (weights cast once, tied ones stay tied)."""
        self.compute_dtype = dtype
        self.net: TransformerXL = self.model
        if dtype != self.dtype or self.device.type == "cpu":
            self.net = copy.deepcopy(self.model).to(dtype).eval()
        self._one: OneTokenStep | None = None
        if self.device.type == "cpu":
            _inference_layout(self.net)
            self._one = OneTokenStep(self.net)
        self._step: Callable[[Tensor], Tensor] | None = None

    def _cache_dtype(self) -> torch.dtype:
        half = self.compute_dtype in (torch.float16, torch.bfloat16)
        if half and self.device.type == "cpu" and self.dtype == torch.float32:
            return torch.float32
        return self.compute_dtype

    def _begin(self, batch: int) -> None:
        dtype = self._autocast_dtype()
        if dtype != self.compute_dtype:
            self._prepare(dtype)
        # a compiled or captured step needs the static one; an eager step skips the mask
        static = bool(self.compile) or self.cuda_graph
        self.cache = self.net.new_cache(batch, dtype=self._cache_dtype(), static=static)
        self._step = None

    def _segment(self, ids: Tensor, reset: Tensor | None, *, last: bool = False) -> Tensor:
        hidden, _, _ = self.net.transform(ids, None, reset, None, cache=self.cache)
        return hidden

    def _run(self, fn: Callable[[], Tensor]) -> Tensor:
        """Run a decoder computation in inference mode: no autograd bookkeeping at all
        (version counters, views), measurable at a few hundred small operations a step. The
        cache is only ever written in this mode; the result is copied out so that callers
        get an ordinary tensor."""
        with torch.inference_mode():
            out = fn()
        return out.clone()

    def log_probs(self, hidden: Tensor) -> Tensor:
        return self.net.softmax.log_prob(hidden)

    def step_fn(self, ids: Tensor) -> Tensor:
        """One decoding step, ids [B] -> next-token log-probabilities [B, V]: the function
        that is compiled or captured. Static shapes, no host synchronisation."""
        hidden, _, _ = self.net.transform(ids.view(-1, 1), cache=self.cache)
        return self.net.softmax.log_prob(hidden[:, -1])

    def _step_hidden(self, ids: Tensor) -> Tensor:  # the same step, for the hidden state
        self._narrow()
        hidden, _, _ = self.net.transform(ids.view(-1, 1).to(self.device), cache=self.cache)
        return hidden[:, -1]

    def _narrow(self) -> None:
        """After the prompt: the cache of one-token steps has mem_len + 1 slots."""
        assert self.cache is not None, "prefill first"
        if self.cache.max_len != 1:
            self.cache = self.cache.resized(1)
            self._step = None

    def _eager_step(self, ids: Tensor) -> Tensor:
        """``step_fn`` with the CPU one-token step (txlm.model.one_token) for the steps it
        covers: unmasked ones (``KVCache.unmasked``; it leaves out the slot same_length hides
        itself); the others run through the modules."""
        assert self.cache is not None and self._one is not None
        if self.cache.unmasked(1, None, same_length=False):
            return self.net.softmax.log_prob(self._one(ids, self.cache))
        return self.step_fn(ids)

    def step(self, ids: Tensor) -> Tensor:
        return self._run(lambda: self._stepper()(ids.view(-1).to(self.device)))

    def step_scores(self, ids: Tensor) -> Tensor:
        return self.step(ids)

    def _stepper(self) -> Callable[[Tensor], Tensor]:
        """The step to call: plain, compiled, or replayed from a CUDA graph."""
        self._narrow()
        assert self.cache is not None
        if self._autocast_dtype() != self.compute_dtype:  # autocast switched since prefill
            self._prepare(self._autocast_dtype())
            self.cache.cast(self._cache_dtype())
        if self._step is None:
            fn: Callable[[Tensor], Tensor] = self.step_fn
            one = self._one is not None and self.one_token and not self.cuda_graph
            if one and not self.compile and OneTokenStep.applies(self.net, self.cache):
                fn = self._eager_step
            if self.compile:  # True: inductor; a string names another backend
                backend = self.compile if isinstance(self.compile, str) else "inductor"
                fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
            if self.cuda_graph:
                fn = _GraphedStep(fn)
            self._step = fn
        return self._step


@torch.no_grad()
def _inference_layout(model: nn.Module) -> None:
    """Turn a decoding copy's parameters into plain tensors laid out for one-row products on
    a CPU. Same values and shapes; the model's code is unchanged.

    A step multiplies one row per sequence by each weight [out, in], a few dozen small calls
    per token, so per-call costs show. Each parameter becomes a buffer holding a plain tensor:
    an ``nn.Parameter`` is a tensor subclass, and every call that takes one goes through
    torch's subclass dispatch (a few microseconds per call, ~10% of a step of a small model).
    And MKL streams such a product 2-3x faster from a contiguous [in, out] buffer when
    out > in (the 10k x 256 output layer: ~0.2-0.35 ms instead of ~0.3-1.1 ms); for
    in >= out the weight as it is runs as fast. So those weights become the transposed view
    of a contiguous [in, out] copy. Tied weights stay tied (each is converted once).
    """
    done: dict[int, Tensor] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in done:
                t = p.detach()
                if name == "weight" and t.dim() == 2 and t.size(0) > t.size(1):
                    t = t.t().contiguous().t()
                done[id(p)] = t
            delattr(module, name)
            module.register_buffer(name, done[id(p)])


class _GraphedStep:
    """A decoding step captured in a CUDA graph on its second call and replayed after: one
    launch per token instead of one per operation. The first call runs eagerly (it warms up
    the kernels and, being a real step, leaves the cache as it should be); capturing records
    without running, so the capturing call then replays once. Inputs go through a static
    buffer; the output is the graph's own buffer, overwritten by the next replay."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        self.fn = fn
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, ids: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 1:
            return self.fn(ids)
        if self.graph is None:
            self.ids = ids.clone()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.fn(self.ids)
        else:
            self.ids.copy_(ids)
        self.graph.replay()
        return self.out


# -- the generation loop ----------------------------------------------------------------------
def _expand(rows: list[list[int]], num_samples: int) -> list[list[int]]:
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ConfigError(f"num-samples must be an integer >= 1, got {num_samples!r}")
    return [r for r in rows for _ in range(num_samples)]


def stream(
    model: TransformerXL,
    prompts: PromptLike | Sequence[PromptLike],
    *,
    max_new_tokens: int = 100,
    sampling: SamplingConfig | None = None,
    seed: int | None = None,
    num_samples: int = 1,
    start_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    stop_id: int | None = None,
    compile: bool | str = False,
) -> Iterator[Tensor]:
    """Yield the new tokens one step at a time: [B] ids per step, B = prompts x num_samples
    (prompt-major: the samples of prompt 0 first).

    ``stop_id``: a row that has drawn it is finished; from then on it yields ``stop_id``
    again (padding) and the stream ends once every row is finished. The ids come back on
    the CPU; the next step is already queued on the device when they are read.
    ``compile``: run the decoding step under ``torch.compile`` (see ``CachedDecoder``).
    """
    sampling = sampling or SamplingConfig()
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"max-new-tokens must be a non-negative integer, got {max_new_tokens!r}")
    rows = _as_rows(prompts)
    rows = _expand(rows, num_samples)
    if stop_id is not None and not 0 <= stop_id < model.config.vocab_size:
        raise ConfigError(
            f"stop id {stop_id} is outside the vocabulary (size {model.config.vocab_size})"
        )
    was_training = model.training
    model.eval()  # dropout off: the cache is only exact for a deterministic forward
    try:
        decoder: _Decoder = (
            CachedDecoder(model, compile=compile) if use_cache else UncachedDecoder(model)
        )
        if generator is None:
            generator = torch.Generator(device=decoder.device)
            if seed is None:
                generator.seed()  # nondeterministic, and leaves the global RNG alone
            else:
                generator.manual_seed(seed)
        if max_new_tokens == 0:
            return
        scores = decoder.prefill_scores(rows, start_id=start_id)
        finished = torch.zeros(len(rows), dtype=torch.bool, device=decoder.device)
        for t in range(max_new_tokens):
            tokens = sample(scores, sampling, generator)
            if stop_id is not None:
                tokens = tokens.masked_fill(finished, stop_id)
                finished |= tokens == stop_id
            if t + 1 < max_new_tokens:  # queued on the device before the host waits below
                scores = decoder.step_scores(tokens)
            host = tokens.cpu()  # the one host synchronisation per token
            yield host
            if stop_id is not None and bool((host == stop_id).all()):
                return
    finally:
        model.train(was_training)


def generate(
    model: TransformerXL,
    prompts: PromptLike | Sequence[PromptLike],
    *,
    max_new_tokens: int = 100,
    sampling: SamplingConfig | None = None,
    top_k: int | None = 40,
    top_p: float | None = None,
    temperature: float = 1.0,
    greedy: bool = False,
    seed: int | None = None,
    num_samples: int = 1,
    start_id: int | None = None,
    use_cache: bool = True,
    stop_id: int | None = None,
    compile: bool | str = False,
) -> list[list[int]]:
    """Sample continuations; returns the new ids only, one list per row: prompts x samples,
    prompt-major (the samples of prompt 0 first). One prompt (a list of ids or a 1-D tensor)
    is one row, so ``generate(model, ids)[0]`` is its continuation.

    Sampling options as in ``SamplingConfig`` (``sampling`` overrides the keyword ones). The
    same ``seed`` gives the same ids. ``stop_id`` (e.g. the vocabulary's ``<eos>``): each row
    ends with the first one it draws.
    """
    if sampling is None:
        sampling = SamplingConfig(top_k=top_k, top_p=top_p, temperature=temperature, greedy=greedy)
    steps = list(
        stream(
            model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
            num_samples=num_samples, start_id=start_id, use_cache=use_cache, stop_id=stop_id,
            compile=compile,
        )
    )  # fmt: skip
    batch = len(_as_rows(prompts)) * num_samples
    out = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in range(batch)]
    if stop_id is not None:  # drop the padding after each row's stop
        out = [r[: r.index(stop_id) + 1] if stop_id in r else r for r in out]
    return out
