"""Generation: the paper's sampling procedure (Appendix E), decoded incrementally from a cache.

Dimension legend
    B  rows (prompts x samples)     P  padded prompt length       L  segment length
    M  memory length (<= mem_len)   K  keys = M + L (M + 1 for a one-token step)
    N  layers   H  heads   Dh head dim   D  model dim   V  vocabulary   C  cache capacity

Procedure (Appendix E): the context is read in segments of ``tgt_len`` with memory carried
from segment to segment, so the memory holds the newest ``mem_len`` states of every layer; the
last context token's distribution gives the first new token; then every new token is fed as a
one-token segment that attends to the memory plus itself, and the next one is sampled from the
renormalised top-k (k = 40 by default), optionally top-p, at a temperature.

Why a cache. Transformer-XL's memory stores each layer's *input* hidden states; a forward pass
re-projects all M of them to keys and values, O(M D^2) per layer and token. The projections
never change once made (inference: no dropout, fixed weights), so ``CachedDecoder`` keeps them:
per layer the keys and values of the memory positions (for pre-LN, of the normalised states),
trimmed to ``mem_len`` exactly as the memory is. A step then projects one token and attends
over M + 1 cached keys: O(M D) attention work per layer. The context segments use the same
cache, so no memory state is ever projected twice. The relative position keys W_kR R_d depend
only on the distance d, and a segment with K keys needs exactly the distances K-1 .. 0 (and the
masked -1), so they are computed once per layer for d up to mem_len + tgt_len (clamped as the
model clamps) and sliced: exact however the window slides.

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

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txlm.errors import ConfigError
from txlm.model.attention import rel_shift
from txlm.model.mask import attention_mask
from txlm.model.positional import sinusoid
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
        kth = scores.topk(config.top_k, dim=-1).values[:, -1:]  # [B, 1] k-th largest
        # Ties with the k-th value are kept: no arbitrary choice between equal tokens.
        scores = scores.masked_fill(scores < kth, float("-inf"))
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
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def top_k_candidates(scores: Tensor, config: SamplingConfig) -> tuple[Tensor, Tensor] | None:
    """[B, V] scores -> (probabilities [B, k], their token ids [B, k]), or None.

    The distribution of ``filter_log_probs`` restricted to the k tokens it can keep: one
    ``topk`` and a softmax over k values instead of masking and normalising the whole
    vocabulary, and a draw over k candidates (``multinomial`` validates its input and draws
    an exponential per candidate: ~0.5 ms for 10k). None when there is no top-k cut, or when
    the k-th largest score ties with the next (that rule then keeps more than k tokens).
    """
    k, vocab = config.top_k, scores.size(-1)
    if k is None or k >= vocab:
        return None
    vals, ids = _upcast(scores).topk(k + 1, dim=-1)  # [B, k + 1], largest first
    if bool((vals[:, k] == vals[:, k - 1]).any()):
        return None
    kept = vals[:, :k] / config.temperature
    if config.top_p is not None and config.top_p < 1.0:
        probs = kept.softmax(dim=-1)  # already sorted: the nucleus rule of filter_log_probs
        before = probs.cumsum(dim=-1) - probs
        kept = kept.masked_fill(before >= config.top_p, float("-inf"))
    return kept.softmax(dim=-1), ids[:, :k]


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
class KVCache:
    """Keys and values of the memory positions of every layer, in one sliding buffer.

    ``kv``: [N, 2, B, H, C, Dh] (keys, then values); ``k`` and ``v`` are its [N, B, H, C, Dh]
    halves. The live window is columns [start, end), oldest first, at most mem_len wide.
    ``valid`` [B, C]: whether a real token of the current document may attend to that
    position (False for left padding). New positions are written at ``end``; when the buffer
    is full the window is copied back to column 0 (amortised O(D) per token, instead of a
    concatenation of the whole memory per token). Keys and values share one tensor so that a
    decoding step stores both with a single copy per layer.
    """

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_head: int,
        d_head: int,
        mem_len: int,
        *,
        slack: int = 256,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.mem_len = mem_len
        capacity = mem_len + max(slack, 1)
        # Uninitialised: only columns [start, end), all written before, are ever read.
        self.kv = torch.empty(
            (n_layer, 2, batch, n_head, capacity, d_head), device=device, dtype=dtype
        )
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.start = self.end = 0
        self._views: tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]] | None = None

    def layer_views(self) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Per layer: ``kv[n]`` [2, B, H, C, Dh], and keys and values [B H, C, Dh] (heads
        folded into the batch, for ``bmm``); views, made again only if ``kv`` is replaced."""
        if self._views is None or self._views[0] is not self.kv:
            n_layer, _, batch, n_head, capacity, d_head = self.kv.shape
            flat = self.kv.view(n_layer, 2, batch * n_head, capacity, d_head)
            self._views = (
                self.kv,
                list(self.kv.unbind(0)),
                [f[0] for f in flat.unbind(0)],
                [f[1] for f in flat.unbind(0)],
            )
        return self._views[1], self._views[2], self._views[3]

    @property
    def k(self) -> Tensor:
        return self.kv[:, 0]

    @property
    def v(self) -> Tensor:
        return self.kv[:, 1]

    @property
    def length(self) -> int:
        return self.end - self.start

    def reserve(self, n: int) -> None:
        """Make room for ``n`` new columns after ``end``."""
        capacity = self.kv.size(4)
        if self.end + n <= capacity:
            return
        m = self.length
        if m + n > capacity:  # grow (only when a caller writes more than the slack at once)
            grow = m + n - capacity
            self.kv = F.pad(self.kv, (0, 0, 0, grow))
            self.valid = F.pad(self.valid, (0, grow))
        if self.start > 0:
            self.kv[..., :m, :] = self.kv[..., self.start : self.end, :].clone()
            self.valid[:, :m] = self.valid[:, self.start : self.end].clone()
        self.start, self.end = 0, m

    def advance(self, n: int) -> None:
        """Columns [end, end + n) are now filled: take them in, trim to mem_len (Tail_M)."""
        self.end += n
        self.start = max(self.start, self.end - self.mem_len)


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


def _t(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """W^T [in, out] of an nn.Linear weight [out, in], for ``x @ W^T`` with one row x.

    With one row the product is matrix-vector, bound by reading the weight, and on CPU (one
    thread, MKL) its speed depends on the layout: when out > in a contiguous [in, out] copy
    is 2-3x faster (10k x 256 output layer: ~0.17-0.35 ms instead of ~0.3-1.1 ms; 1024 x 256:
    ~50 us instead of ~120 us); when in > out (the second feed-forward layer) the weight as it
    is, viewed transposed, is faster; square ones run alike. The copy is made once per decoder
    (again only if the autocast dtype changes, see ``CachedDecoder._prepare``).
    """
    weight = weight.detach().to(dtype)
    return weight.t().contiguous() if weight.size(0) > weight.size(1) else weight.t()


@dataclass
class _StepLayer:
    """One decoder layer's parameters, laid out for ``CachedDecoder._one_token``.

    Read once per decoder (generation runs the model unchanged): transposed weights (``_t``)
    and LayerNorm (weight, bias, eps) triples, so a step makes functional calls only.
    """

    qkv_t: Tensor  # [D, 3 H Dh]: queries, keys, values
    out_t: Tensor  # [H Dh, D]
    fc1_t: Tensor  # [D, d_inner]
    fc1_b: Tensor
    fc2_t: Tensor  # [d_inner, D]
    fc2_b: Tensor
    norm1: tuple  # attention LayerNorm: (weight, bias, eps)
    norm2: tuple  # feed-forward LayerNorm
    u: Tensor | None  # [H, Dh] content bias ("xl")
    v: Tensor | None  # [H, 1, Dh] position bias ("xl"), shaped for queries [H, B, Dh]
    scale: float
    pos_emb: Tensor | None  # [D] absolute embedding of position 0 ("alrfou")

    @classmethod
    def of(
        cls, layer: nn.Module, model: TransformerXL, dtype: torch.dtype, attn_dtype: torch.dtype
    ) -> _StepLayer:
        """Weights and biases held in ``dtype``, the weight products' (autocast's, when on),
        u and v in ``attn_dtype``, the attention's, so no step casts a parameter; LayerNorm
        parameters stay as they are (LayerNorm runs in float32 under autocast)."""
        attn, ff = layer.attn, layer.ff
        u = v = None
        if attn.attn_type == "xl":  # per-layer biases (untie_r) or the model's shared ones
            u = getattr(attn, "u", None)
            v = getattr(attn, "v", None)
            u = model.u if u is None else u
            v = model.v if v is None else v
        return cls(
            qkv_t=_t(attn.qkv.weight, dtype),
            out_t=_t(attn.out.weight, dtype),
            fc1_t=_t(ff.fc1.weight, dtype),
            fc1_b=ff.fc1.bias.detach().to(dtype),
            fc2_t=_t(ff.fc2.weight, dtype),
            fc2_b=ff.fc2.bias.detach().to(dtype),
            norm1=(attn.norm.weight.detach(), attn.norm.bias.detach(), attn.norm.eps),
            norm2=(ff.norm.weight.detach(), ff.norm.bias.detach(), ff.norm.eps),
            u=None if u is None else u.detach().to(attn_dtype),
            v=None if v is None else v.detach().to(attn_dtype)[:, None],
            scale=attn.scale,
            pos_emb=layer.pos_emb[0].detach() if hasattr(layer, "pos_emb") else None,
        )


class _OutputLayer:
    """The model's (adaptive) softmax laid out for one row per sequence (``_t``).

    ``scores`` gives raw logits for a full softmax (the log-softmax only shifts each row and
    ``sample`` renormalises) and, with cutoffs, the log-probabilities that
    ``AdaptiveLogSoftmax.log_prob`` computes, by the same formula: head log-softmax over the
    shortlist and one logit per tail cluster, plus each cluster's own log-softmax.
    """

    def __init__(self, softmax: nn.Module, dtype: torch.dtype) -> None:
        self.n_clusters, self.shortlist, self.bounds = (
            softmax.n_clusters, softmax.shortlist, softmax.bounds,
        )  # fmt: skip
        self.clusters: list[tuple[Tensor | None, Tensor, Tensor]] = []  # (proj, W^T, bias)
        for i in range(len(self.bounds)):
            weight, bias, proj = softmax._weights(i)
            if i == 0 and self.n_clusters:  # the head also scores the tail clusters
                weight = torch.cat([weight, softmax.cluster_weight], dim=0)
                bias = torch.cat([bias, softmax.cluster_bias], dim=0)
            proj = None if proj is None else proj.detach().to(dtype)
            self.clusters.append((proj, _t(weight, dtype), bias.detach().to(dtype)))

    def _logits(self, i: int, hidden: Tensor) -> Tensor:
        proj, weight_t, bias = self.clusters[i]
        hidden = hidden.to(weight_t.dtype)  # explicit: also right where autocast is off
        if proj is not None:
            hidden = hidden @ proj  # [B, P] @ [P, E_i]
        return torch.addmm(bias, hidden, weight_t)

    def log_probs(self, hidden: Tensor) -> Tensor:
        """hidden [B, D] -> log-probabilities [B, V] (float32 at least)."""
        if self.n_clusters:
            return self.scores(hidden)
        return F.log_softmax(_upcast(self._logits(0, hidden)), dim=-1)

    def scores(self, hidden: Tensor) -> Tensor:
        """hidden [B, D] -> [B, V]."""
        head = self._logits(0, hidden)
        if not self.n_clusters:
            return head
        head = F.log_softmax(_upcast(head), dim=-1)
        out = head.new_empty(hidden.size(0), self.bounds[-1][1])
        out[:, : self.shortlist] = head[:, : self.shortlist]
        for i in range(1, self.n_clusters + 1):
            lo, hi = self.bounds[i]
            tail = F.log_softmax(_upcast(self._logits(i, hidden)), dim=-1)
            out[:, lo:hi] = head[:, self.shortlist + i - 1, None] + tail
        return out


class CachedDecoder(_Decoder):
    """Incremental decoder: per-layer memory keys/values cached, position keys precomputed.

    Every context segment runs ``_forward``: it projects only the new positions, appends their
    keys/values to the cache and attends over the cached window plus themselves. The mask is
    the model's (``attention_mask``: causal, same_length, document starts); the position keys
    are sliced from a per-layer table, so no step recomputes W_kR R. Each generated token runs
    ``_one_token``, the same computation specialised to a single query.

    Speed at batch 1 (small model, one CPU thread): a step is a chain of matrix-vector
    products bound by reading the weights (~24 MB for 4 x 256 layers and a 10k softmax), plus
    per-operation overhead. So the step reads each weight once in the layout that a one-row
    product streams fastest (``_t``), issues ~30 operations per layer and no mask, and
    sampling draws among the top-k candidates only (``top_k_candidates``, ``_draw``).
    """

    def __init__(self, model: TransformerXL) -> None:
        super().__init__(model)
        c = self.config
        self.rel = c.attn_type in ("xl", "shaw")
        self.pre_lnorm = c.pre_lnorm
        emb = model.embed
        plain = emb.div_val == 1 and not len(emb.projs)
        self.embed_weight = emb.layers[0].weight.detach() if plain else None
        self.compute_dtype: torch.dtype | None = None  # set by _prepare
        self.cache: KVCache | None = None  # made per prefill, by _begin
        self._prepare(self._autocast_dtype())

    def _autocast_dtype(self) -> torch.dtype:
        """The matmuls' dtype: autocast's when it is on for the model's device (and the
        weights are float32), else the weights' own."""
        device = self.device.type
        if self.dtype == torch.float32 and torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
        return self.dtype

    @torch.no_grad()
    def _prepare(self, dtype: torch.dtype) -> None:
        """Hold the step's weight copies in ``dtype`` (the weight products'), and the position
        keys and cache in ``attn_dtype`` (the same, except float32 on a CPU under autocast).

        Under autocast a weight that is not a parameter (these are copies) would be cast on
        every call, ~all the weights read twice per token, and a float32 cache would be cast
        window by window: preparing in the autocast dtype once makes bf16 decoding cheaper
        than float32 instead of ~2x dearer (benchmarks/compare.py, generate).
        """
        c = self.config
        self.compute_dtype = dtype
        half = dtype in (torch.float16, torch.bfloat16)
        # The one-query attention over the cache is a matrix-vector product per head. On a
        # CPU, bf16 ones are 3-5x slower than float32 (and need contiguous copies of the
        # transposed keys), so there the cache, the position keys and that product stay in
        # the weights' float32; autocast's dtype is kept for the weight products.
        cpu_autocast = half and self.device.type == "cpu" and self.dtype == torch.float32
        self.attn_dtype = torch.float32 if cpu_autocast else dtype
        # float16/bfloat16 attention is normalised in float32 (as the model does)
        self.softmax_dtype = torch.float32 if self.attn_dtype != torch.float32 else None
        self.abs_pos = None
        if c.attn_type == "vaswani":
            # added to the residual stream, which keeps the weights' dtype
            self.abs_pos = sinusoid(torch.zeros(1, device=self.device), c.d_model).to(self.dtype)
        self.layers = [
            _StepLayer.of(layer, self.model, dtype, self.attn_dtype) for layer in self.model.layers
        ]
        self.head = _OutputLayer(self.model.softmax, dtype)
        self.tables: list[Tensor] = []
        self.span = -1  # largest distance the tables cover
        if self.rel:
            self._build_tables(c.mem_len + c.tgt_len)
        if self.cache is not None and self.cache.kv.dtype != self.attn_dtype:
            self.cache.kv = self.cache.kv.to(self.attn_dtype)  # autocast switched between calls

    @torch.no_grad()
    def _build_tables(self, span: int) -> None:
        """Per layer [H, span + 2, Dh]: position keys for distances span, ..., 1, 0, -1.

        Column c holds distance span - c: the model's layout (positional.relative_distances),
        so the last K + 1 columns are exactly what a segment with K keys needs, clamped as the
        model clamps. Distance -1 only ever lands on masked pairs (see rel_shift).
        """
        c = self.config
        dist = torch.arange(span, -2, -1, device=self.device, dtype=torch.float32)
        if c.attn_type == "xl":
            if c.clamp_len > 0:
                dist = dist.clamp(max=c.clamp_len)
            pos = sinusoid(dist, c.d_model).to(self.dtype)  # R [span + 2, D]
        else:  # shaw: learned rows, clipped into the table like TransformerXL.transform
            limit = min(c.clamp_len, c.n_positions - 1) if c.clamp_len > 0 else c.n_positions - 1
            pos = dist.clamp(max=limit)
        # contiguous [H, span + 2, Dh]: a slice is then one dense block per head. Computed in
        # the weights' dtype (not autocast's), then held in the attention's.
        with torch.autocast(self.device.type, enabled=False):
            self.tables = [
                layer.attn.position_keys(pos).to(self.attn_dtype).contiguous()
                for layer in self.model.layers
            ]
        self.span = span

    def _begin(self, batch: int) -> None:
        c = self.config
        self.cache = KVCache(
            c.n_layer, batch, c.n_head, c.d_head, c.mem_len,
            slack=max(c.tgt_len, 256), device=self.device, dtype=self.attn_dtype,
        )  # fmt: skip
        self.masked = False  # True once some memory position may be invisible (padding)

    def _segment(self, ids: Tensor, reset: Tensor | None, *, last: bool = False) -> Tensor:
        return self._forward(ids, reset, last_only=last)

    def _run(self, fn: Callable[[], Tensor]) -> Tensor:
        """Run a decoder computation in inference mode: no autograd bookkeeping at all
        (version counters, views), which at ~150 small operations a step is measurable
        (~5-10% of a step of the small model). The cache is built and only ever written in
        this mode; the result is copied out so that callers get an ordinary tensor."""
        dtype = self._autocast_dtype()
        if dtype != self.compute_dtype:
            self._prepare(dtype)
        with torch.inference_mode():
            out = fn()
        return out.clone()

    def scores(self, hidden: Tensor) -> Tensor:
        """Raw logits for a full softmax, log-probabilities for an adaptive one (see
        ``_OutputLayer``): what ``sample`` needs, without a log-softmax over the vocabulary."""
        return self.head.scores(hidden)

    def log_probs(self, hidden: Tensor) -> Tensor:
        return self.head.log_probs(hidden)

    def _step_hidden(self, ids: Tensor) -> Tensor:
        c = self.config
        if c.same_length and c.mem_len < 1:  # nothing visible: the model's NaNs, not ours
            return self._forward(ids.view(-1, 1).to(self.device), None)[:, -1]
        return self._one_token(ids.view(-1).to(self.device))

    def _one_token(self, ids: Tensor) -> Tensor:
        """ids [B] -> last layer's output [B, D]: ``_forward`` specialised to one token.

        Same arithmetic, fewer and cheaper operations (at batch 1 a step of a small model
        is a few MFLOP, so the time goes to per-operation overhead and to streaming the
        weights): no mask (a single query sees its whole window, see ``lo``), position keys
        sliced without the relative shift, heads folded into the batch of ``bmm``, the scale
        and the position term folded into one ``baddbmm``, functional calls on weights laid
        out for a one-row product (``_StepLayer``) instead of module calls.
        """
        c, cache = self.config, self.cache
        batch = ids.size(0)
        if self.embed_weight is not None:  # the module's arithmetic without its call overhead
            h = F.embedding(ids, self.embed_weight) * self.model.embed.scale  # [B, D]
        else:  # adaptive input embeddings
            h = self.model.embed(ids[:, None]).view(batch, -1)
        if self.abs_pos is not None:  # "vaswani": the one token is at position 0
            h = h + self.abs_pos

        cache.reserve(1)
        s, e = cache.start, cache.end
        # Keys this query may see: the cached window and itself; with same_length only the
        # mem_len newest of those (attention_mask's rule for query index M). The others are
        # left out of the product rather than masked: the same softmax, exactly.
        lo = max(s, e + 1 - c.mem_len) if c.same_length else s
        nk = e + 1 - lo
        if self.rel and nk - 1 > self.span:
            self._build_tables(nk - 1)
        cache.valid[:, e] = True
        blocked = None
        if self.masked:  # left padding somewhere: hide it (the query's own key is valid)
            blocked = ~cache.valid[:, None, lo : e + 1]  # [B, 1, K] over heads

        kv, keys_of, values_of = cache.layer_views()
        args = (h, kv, keys_of, values_of, e, lo, nk, blocked)
        if self.compute_dtype == self.attn_dtype == h.dtype:  # one dtype: no casts at all
            h = self._layers_one_token(*args, None, None)
        else:  # explicit dtypes, autocast off (see _layers_one_token)
            with torch.autocast(self.device.type, enabled=False):
                h = self._layers_one_token(*args, self.compute_dtype, self.attn_dtype)
        cache.advance(1)
        return h

    def _layers_one_token(
        self,
        h: Tensor,
        kv: list[Tensor],
        keys_of: list[Tensor],
        values_of: list[Tensor],
        e: int,
        lo: int,
        nk: int,
        blocked: Tensor | None,
        wd: torch.dtype | None,
        ad: torch.dtype | None,
    ) -> Tensor:
        """The layers of ``_one_token`` for h [B, D]: the query at cache column ``e`` attends
        to columns [lo, lo + nk).

        With mixed precision, ``wd`` is the weight products' dtype and ``ad`` the attention's;
        the residual stream and LayerNorm keep h's (as under autocast). ``None``: everything
        is in h's dtype already, and the step skips the casts (a step is ~150 small calls).
        """
        c = self.config
        batch, n_head, d_head = h.size(0), c.n_head, c.d_head
        bh = batch * n_head
        dim = (c.d_model,)  # LayerNorm's normalised shape
        for n, w in enumerate(self.layers):
            if w.pos_emb is not None:  # "alrfou"
                h = h + w.pos_emb
            x = torch.layer_norm(h, dim, *w.norm1) if self.pre_lnorm else h
            qkv = torch.mm(x if wd is None else x.to(wd), w.qkv_t).view(batch, 3, n_head, d_head)
            kv[n].select(3, e).copy_(qkv[:, 1:].transpose(0, 1))  # this token's key, value
            q = qkv[:, 0] if ad is None else qkv[:, 0].to(ad)  # [B, H, Dh]
            keys = keys_of[n].narrow(1, lo, nk)  # [B H, K, Dh]
            values = values_of[n].narrow(1, lo, nk)
            qc = (q if w.u is None else q + w.u).reshape(bh, 1, d_head)
            if self.rel:
                # (b) + (d): one query at key index e, so key j is at distance e - j; the
                # table's columns span - (nk - 1) .. span hold distances nk - 1 .. 0.
                rk = self.tables[n].narrow(1, self.span + 1 - nk, nk)  # [H, K, Dh]
                qp = q.transpose(0, 1)  # [H, B, Dh]
                if w.v is not None:
                    qp = qp + w.v
                pos = torch.bmm(qp, rk.transpose(1, 2)).transpose(0, 1).reshape(bh, 1, nk)
                # scale * ((a) + (c)) + scale * ((b) + (d)) in one call
                scores = torch.baddbmm(
                    pos, qc, keys.transpose(1, 2), beta=w.scale, alpha=w.scale
                )  # [B H, 1, K]
            else:
                scores = torch.bmm(qc, keys.transpose(1, 2)) * w.scale
            if blocked is not None:
                scores = scores.view(batch, n_head, nk).masked_fill(blocked, float("-inf"))
                scores = scores.view(bh, 1, nk)
            if self.softmax_dtype is None:
                probs = torch.softmax(scores, dim=-1)
            else:  # half precision normalised in float32, as the model does
                probs = torch.softmax(scores, dim=-1, dtype=self.softmax_dtype).to(values.dtype)
            attn = torch.bmm(probs, values).view(batch, n_head * d_head)
            out = torch.mm(attn if wd is None else attn.to(wd), w.out_t)
            if self.pre_lnorm:
                h = h + out
                x = torch.layer_norm(h, dim, *w.norm2)
            else:
                h = x = torch.layer_norm(h + out, dim, *w.norm1)
            x = x if wd is None else x.to(wd)
            f = torch.addmm(w.fc2_b, torch.addmm(w.fc1_b, x, w.fc1_t).relu_(), w.fc2_t)
            h = h + f if self.pre_lnorm else torch.layer_norm(h + f, dim, *w.norm2)
        return h

    def _forward(self, ids: Tensor, reset: Tensor | None, *, last_only: bool = False) -> Tensor:
        """ids [B, L] -> last layer's hidden states [B, L, D]; the cache takes the L positions.

        ``last_only``: only the final position's output is wanted (the prompt's last segment):
        the top layer, whose output no cache holds, then attends and runs its feed-forward
        for that position alone ([B, 1, D]); its keys and values are still all cached.
        """
        c, model, cache = self.config, self.model, self.cache
        qlen = ids.size(1)
        h = model.embed(ids)  # [B, L, D]
        if c.attn_type == "vaswani":  # absolute position within the segment
            h = h + sinusoid(torch.arange(qlen, device=self.device), c.d_model).to(h.dtype)

        cache.reserve(qlen)
        s, e = cache.start, cache.end
        mlen = e - s
        klen = mlen + qlen
        self.masked = self.masked or reset is not None
        mask, next_valid = attention_mask(
            qlen, mlen, mem_len=c.mem_len, same_length=c.same_length, reset=reset,
            mem_valid=cache.valid[:, s:e] if self.masked else None, device=self.device,
        )  # fmt: skip  # mask [L, K] or [B, 1, L, K]
        blocked = ~mask
        if self.rel and klen - 1 > self.span:
            self._build_tables(klen - 1)
        u_shared, v_shared = getattr(model, "u", None), getattr(model, "v", None)
        abs_pos = torch.arange(qlen, device=self.device).clamp(max=c.n_positions - 1)

        for n, layer in enumerate(model.layers):
            attn = layer.attn
            if c.attn_type == "alrfou":
                h = h + layer.pos_emb[abs_pos].to(h.dtype)
            x = attn.norm(h) if attn.pre_lnorm else h
            qkv = F.linear(x, attn.qkv.weight).chunk(3, dim=-1)  # rows: queries, keys, values
            q, k_new, v_new = (attn._heads(t) for t in qkv)  # [B, H, L, Dh] each
            cache.kv[n, 0, :, :, e : e + qlen] = k_new
            cache.kv[n, 1, :, :, e : e + qlen] = v_new
            keys = cache.kv[n, 0, :, :, s : e + qlen]  # [B, H, K, Dh]: memory, then these L
            values = cache.kv[n, 1, :, :, s : e + qlen]

            if c.attn_type == "xl":
                u = attn.u if hasattr(attn, "u") else u_shared
                v = attn.v if hasattr(attn, "v") else v_shared
            else:
                u = v = None
            # Fused attention (as the model's default attn_impl "sdpa"): the [B, H, L, K]
            # probabilities of a context segment are never materialised.
            qc = q if u is None else q + u[:, None, :]  # content terms (a) + (c)
            bias: Tensor = mask
            if self.rel:
                rk = self.tables[n][:, -(klen + 1) :]  # [H, K + 1, Dh]: distances K-1 .. -1
                qp = q if v is None else q + v[:, None, :]
                bias = rel_shift(qp @ rk.transpose(-1, -2)) * attn.scale  # (b) + (d)
                bias = bias.masked_fill(blocked, float("-inf"))
            if last_only and n == c.n_layer - 1:
                qc, bias, h = qc[:, :, -1:], bias[..., -1:, :], h[:, -1:]
            ctx = F.scaled_dot_product_attention(qc, keys, values, attn_mask=bias, scale=attn.scale)
            out = attn.out(ctx.transpose(1, 2).flatten(2))  # [B, L, D]
            h = h + out if attn.pre_lnorm else attn.norm(h + out)
            h = layer.ff(h)

        cache.valid[:, e : e + qlen] = True
        cache.advance(qlen)
        if next_valid is not None:  # the model's verdict on what stays visible
            cache.valid[:, cache.start : cache.end] = next_valid
        return h


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
) -> Iterator[Tensor]:
    """Yield the new tokens one step at a time: [B] ids per step, B = prompts x num_samples
    (prompt-major: the samples of prompt 0 first).

    ``stop_id``: a row that has drawn it is finished; from then on it yields ``stop_id``
    again (padding) and the stream ends once every row is finished.
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
        decoder: _Decoder = CachedDecoder(model) if use_cache else UncachedDecoder(model)
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
            yield tokens
            if stop_id is not None and bool(finished.all()):
                return
            if t + 1 < max_new_tokens:
                scores = decoder.step_scores(tokens)
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
        )
    )  # fmt: skip
    batch = len(_as_rows(prompts)) * num_samples
    out = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in range(batch)]
    if stop_id is not None:  # drop the padding after each row's stop
        out = [r[: r.index(stop_id) + 1] if stop_id in r else r for r in out]
    return out
