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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

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
    log_probs: Tensor, config: SamplingConfig, generator: torch.Generator | None = None
) -> Tensor:
    """Draw one token per row: [B, V] log-probabilities -> [B] ids."""
    if config.greedy:
        return log_probs.argmax(dim=-1)
    probs = filter_log_probs(log_probs, config).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


# -- prompts ----------------------------------------------------------------------------------
def _as_rows(prompts: PromptLike | Sequence[PromptLike]) -> tuple[list[list[int]], bool]:
    """Normalise to a list of id lists; also say whether a single prompt was given."""
    if isinstance(prompts, Tensor):
        if prompts.dim() == 1:
            return [prompts.tolist()], True
        if prompts.dim() == 2:
            return prompts.tolist(), False
        raise ConfigError(f"prompt ids must be [P] or [B, P], got shape {tuple(prompts.shape)}")
    rows = list(prompts)
    if not rows or all(isinstance(x, int) for x in rows):
        return [[int(x) for x in rows]], True
    out = []
    for r in rows:
        if isinstance(r, Tensor):
            r = r.tolist()
        if not all(isinstance(x, int) for x in r):
            raise ConfigError("prompt ids must be integers")
        out.append([int(x) for x in r])
    return out, False


def _check_ids(rows: list[list[int]], vocab_size: int) -> None:
    for r in rows:
        bad = [x for x in r if not 0 <= x < vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


# -- decoders ---------------------------------------------------------------------------------
class KVCache:
    """Keys and values of the memory positions of every layer, in one sliding buffer.

    ``k``, ``v``: [N, B, H, C, Dh]; the live window is columns [start, end), oldest first, at
    most mem_len wide. ``valid`` [B, C]: whether a real token of the current document may
    attend to that position (False for left padding). New positions are written at ``end``;
    when the buffer is full the window is copied back to column 0 (amortised O(D) per token,
    instead of a concatenation of the whole memory per token).
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
        shape = (n_layer, batch, n_head, capacity, d_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.start = self.end = 0

    @property
    def length(self) -> int:
        return self.end - self.start

    def reserve(self, n: int) -> None:
        """Make room for ``n`` new columns after ``end``."""
        capacity = self.k.size(3)
        if self.end + n <= capacity:
            return
        m = self.length
        if m + n > capacity:  # grow (only when a caller writes more than the slack at once)
            grow = m + n - capacity
            pad = (0, 0, 0, grow)
            self.k = F.pad(self.k, pad)
            self.v = F.pad(self.v, pad)
            self.valid = F.pad(self.valid, (0, grow))
        if self.start > 0:
            self.k[:, :, :, :m] = self.k[:, :, :, self.start : self.end].clone()
            self.v[:, :, :, :m] = self.v[:, :, :, self.start : self.end].clone()
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

    def _segment(self, ids: Tensor, reset: Tensor | None) -> Tensor:
        raise NotImplementedError

    def step(self, ids: Tensor) -> Tensor:
        """Feed one token per row ([B] ids); log-probabilities [B, V] of the next one."""
        raise NotImplementedError

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], *, start_id: int | None = None) -> Tensor:
        """Read the prompts (left-padded, end-aligned segments); [B, V] next-token log-probs."""
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
        for lo, hi in self._segments(width):
            hidden = self._segment(ids[:, lo:hi], starts[:, lo:hi] if padded else None)
        assert hidden is not None
        return self.model.softmax.log_prob(hidden[:, -1])

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

    def _segment(self, ids: Tensor, reset: Tensor | None) -> Tensor:
        hidden, self.mems, self.mem_mask = self.model.transform(
            ids, self.mems, reset, self.mem_mask
        )
        return hidden

    @torch.no_grad()
    def step(self, ids: Tensor) -> Tensor:
        hidden = self._segment(ids.view(-1, 1).to(self.device), None)
        return self.model.softmax.log_prob(hidden[:, -1])


class CachedDecoder(_Decoder):
    """Incremental decoder: per-layer memory keys/values cached, position keys precomputed.

    Every segment, the context's and each one-token step alike, runs ``_forward``: it projects
    only the new positions, appends their keys/values to the cache and attends over the cached
    window plus themselves. The mask is the model's (``attention_mask``: causal, same_length,
    document starts); the position keys are sliced from a per-layer table, so no step
    recomputes W_kR R. The layers' own weights and modules are used throughout.
    """

    def __init__(self, model: TransformerXL) -> None:
        super().__init__(model)
        c = self.config
        self.rel = c.attn_type in ("xl", "shaw")
        self.tables: list[Tensor] = []
        self.span = -1  # largest distance the tables cover
        if self.rel:
            self._build_tables(c.mem_len + c.tgt_len)

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
        self.tables = [layer.attn.position_keys(pos).to(self.dtype) for layer in self.model.layers]
        self.span = span

    def _begin(self, batch: int) -> None:
        c = self.config
        self.cache = KVCache(
            c.n_layer, batch, c.n_head, c.d_head, c.mem_len,
            slack=max(c.tgt_len, 256), device=self.device, dtype=self.dtype,
        )  # fmt: skip
        self.masked = False  # True once some memory position may be invisible (padding)

    def _segment(self, ids: Tensor, reset: Tensor | None) -> Tensor:
        return self._forward(ids, reset)

    @torch.no_grad()
    def step(self, ids: Tensor) -> Tensor:
        hidden = self._forward(ids.view(-1, 1).to(self.device), None)
        return self.model.softmax.log_prob(hidden[:, -1])

    @torch.no_grad()
    def _forward(self, ids: Tensor, reset: Tensor | None) -> Tensor:
        """ids [B, L] -> last layer's hidden states [B, L, D]; the cache takes the L positions."""
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
            cache.k[n, :, :, e : e + qlen] = k_new
            cache.v[n, :, :, e : e + qlen] = v_new
            keys = cache.k[n, :, :, s : e + qlen]  # [B, H, K, Dh]: memory, then these L
            values = cache.v[n, :, :, s : e + qlen]

            if c.attn_type == "xl":
                u = attn.u if hasattr(attn, "u") else u_shared
                v = attn.v if hasattr(attn, "v") else v_shared
            else:
                u = v = None
            qc = q if u is None else q + u[:, None, :]
            scores = qc @ keys.transpose(-1, -2)  # [B, H, L, K] content terms (a) + (c)
            if self.rel:
                rk = self.tables[n][:, -(klen + 1) :]  # [H, K + 1, Dh]: distances K-1 .. -1
                qp = q if v is None else q + v[:, None, :]
                scores = scores + rel_shift(qp @ rk.transpose(-1, -2))  # (b) + (d)
            scores = (scores * attn.scale).masked_fill(blocked, float("-inf"))
            probs = torch.softmax(
                scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)
            ).to(values.dtype)  # half precision normalised in float32, float64 kept
            out = attn.out((probs @ values).transpose(1, 2).flatten(2))  # [B, L, D]
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
) -> Iterator[Tensor]:
    """Yield the new tokens one step at a time: [B] ids per step, B = prompts x num_samples
    (prompt-major: the samples of prompt 0 first)."""
    sampling = sampling or SamplingConfig()
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"max-new-tokens must be a non-negative integer, got {max_new_tokens!r}")
    rows, _ = _as_rows(prompts)
    rows = _expand(rows, num_samples)
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
        log_probs = decoder.prefill(rows, start_id=start_id)
        for t in range(max_new_tokens):
            tokens = sample(log_probs, sampling, generator)
            yield tokens
            if t + 1 < max_new_tokens:
                log_probs = decoder.step(tokens)
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
) -> list[int] | list[list[int]]:
    """Sample continuations; returns the new ids only.

    ``prompts``: one prompt (a list of ids or a 1-D tensor) -> a list of new ids (with
    ``num_samples`` > 1: one list per sample); several prompts (a list of lists or a 2-D
    tensor) -> one list per row, prompt-major. Sampling options as in ``SamplingConfig``
    (``sampling`` overrides the keyword ones). The same ``seed`` gives the same ids.
    """
    if sampling is None:
        sampling = SamplingConfig(top_k=top_k, top_p=top_p, temperature=temperature, greedy=greedy)
    _, single = _as_rows(prompts)
    steps = list(
        stream(
            model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
            num_samples=num_samples, start_id=start_id, use_cache=use_cache,
        )
    )  # fmt: skip
    batch = (1 if single else len(_as_rows(prompts)[0])) * num_samples
    out = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in range(batch)]
    return out[0] if single and num_samples == 1 else out
