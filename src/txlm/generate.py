"""Generation: the paper's sampling procedure (Appendix E), decoded incrementally from a cache.

Dimension legend
    B  rows (prompts x samples)     P  padded prompt length       L  segment length
    M  memory length (<= mem_len)   K  keys of one decoding step = M + 1
    N  layers   H  heads   Dh head dim   D  model dim   V  vocabulary   C  cache capacity
    T  distances a step can need = mem_len + 1 (0 .. mem_len)

Procedure (Appendix E): the context is read in segments of ``tgt_len`` with memory carried
from segment to segment, so the memory holds the newest ``mem_len`` states of every layer; the
last context token's distribution gives the first new token; then every new token is fed as a
one-token segment that attends to the memory plus itself, and the next one is sampled from the
renormalised top-k (k = 40 by default), optionally top-p, at a temperature.

Why a cache. Transformer-XL's memory stores each layer's *input* hidden states; a forward pass
re-projects all M of them to keys and values, O(M D^2) per layer and token. The projections
never change once made (inference: no dropout, fixed weights), so ``CachedDecoder`` keeps them:
per layer the keys and values of the memory positions (for pre-LN of the normalised states),
trimmed to ``mem_len`` exactly as the memory is. A step then projects one token and attends
over M + 1 cached keys: O(M D) attention work per layer. The relative position keys
W_kR R_d depend only on the distance d, and a single query at key index K-1 sees key j at
distance K-1-j <= mem_len, so they are computed once for d = 0 .. mem_len (clamped like the
model clamps) and sliced each step: exact however the window slides.

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

    def append(self, ks: list[Tensor], vs: list[Tensor]) -> None:
        """Append each layer's keys/values [B, H, L, Dh] of L new positions, all valid."""
        new = ks[0].size(2)
        keep = min(new, self.mem_len)  # older ones would be trimmed at once
        if keep == 0:
            self.start = self.end
            return
        self.reserve(keep)
        e = self.end
        for n, (k, v) in enumerate(zip(ks, vs, strict=True)):
            self.k[n, :, :, e : e + keep] = k[:, :, new - keep :]
            self.v[n, :, :, e : e + keep] = v[:, :, new - keep :]
        self.valid[:, e : e + keep] = True
        self.advance(keep)


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

    Reading the context goes through ``model.transform`` (the model's own code, which also
    hands back each segment's projected keys and values); each later token runs the one-query
    step below, which uses the layers' weights directly.
    """

    def __init__(self, model: TransformerXL) -> None:
        super().__init__(model)
        c = self.config
        self.mem_len = c.mem_len
        self.tables = self._position_tables() if c.attn_type in ("xl", "shaw") else None

    @torch.no_grad()
    def _position_tables(self) -> list[Tensor]:
        """Per layer [H, T, Dh]: position keys for distances mem_len, ..., 1, 0 (column c holds
        distance T-1-c, the order the model lays distances out in), clamped as the model does."""
        c = self.config
        dist = torch.arange(c.mem_len, -1, -1, device=self.device, dtype=torch.float32)
        if c.attn_type == "xl":
            if c.clamp_len > 0:
                dist = dist.clamp(max=c.clamp_len)
            pos = sinusoid(dist, c.d_model).to(self.dtype)  # R [T, D]
        else:  # shaw: learned rows, clipped into the table like TransformerXL.transform
            limit = min(c.clamp_len, c.n_positions - 1) if c.clamp_len > 0 else c.n_positions - 1
            pos = dist.clamp(max=limit)
        return [layer.attn.position_keys(pos).to(self.dtype) for layer in self.model.layers]

    def _begin(self, batch: int) -> None:
        c = self.config
        self.cache = KVCache(
            c.n_layer, batch, c.n_head, c.d_head, c.mem_len,
            slack=max(c.tgt_len, 256), device=self.device, dtype=self.dtype,
        )  # fmt: skip
        self.mems: list[Tensor] | None = None  # hidden-state memory, only while reading
        self.mem_mask: Tensor | None = None

    def _segment(self, ids: Tensor, reset: Tensor | None) -> Tensor:
        extras: list[dict] = []
        hidden, self.mems, self.mem_mask = self.model.transform(
            ids, self.mems, reset, self.mem_mask, attn_kwargs={"return_kv": True}, extras=extras
        )
        self.cache.append([e["k"] for e in extras], [e["v"] for e in extras])
        if self.mem_mask is not None:  # the model's verdict on what stays visible
            self.cache.valid[:, self.cache.start : self.cache.end] = self.mem_mask
        return hidden

    def prefill(self, prompts: Sequence[Sequence[int]], *, start_id: int | None = None) -> Tensor:
        log_probs = super().prefill(prompts, start_id=start_id)
        self.mems = None  # from here on the cache is the memory
        return log_probs

    @torch.no_grad()
    def step(self, ids: Tensor) -> Tensor:
        c, model, cache = self.config, self.model, self.cache
        ids = ids.view(-1, 1).to(self.device)  # [B, 1]
        h = model.embed(ids)  # [B, 1, D]
        if c.attn_type == "vaswani":  # absolute position 0 of a one-token segment
            h = h + sinusoid(torch.zeros(1, device=self.device), c.d_model).to(h.dtype)

        cache.reserve(1)
        s, e = cache.start, cache.end
        klen = e + 1 - s  # K = M + 1
        cache.valid[:, e] = True
        keep = cache.valid[:, s : e + 1]  # [B, K]
        if c.same_length and klen > c.mem_len:  # the query sees only the mem_len newest keys
            keep = keep.clone()
            keep[:, : klen - c.mem_len] = False
        blocked = ~keep[:, None, None, :]  # [B, 1, 1, K]
        u_shared, v_shared = getattr(model, "u", None), getattr(model, "v", None)
        tcols = c.mem_len + 1

        for n, layer in enumerate(model.layers):
            attn = layer.attn
            if c.attn_type == "alrfou":
                h = h + layer.pos_emb[0].to(h.dtype)
            x = attn.norm(h) if attn.pre_lnorm else h
            qkv = F.linear(x, attn.qkv.weight).chunk(3, dim=-1)  # rows: queries, keys, values
            q, k_new, v_new = (attn._heads(t) for t in qkv)  # [B, H, 1, Dh] each
            cache.k[n, :, :, e : e + 1] = k_new  # [B, H, 1, Dh]
            cache.v[n, :, :, e : e + 1] = v_new
            keys, values = cache.k[n, :, :, s : e + 1], cache.v[n, :, :, s : e + 1]  # [B,H,K,Dh]

            if c.attn_type == "xl":
                u = attn.u if hasattr(attn, "u") else u_shared
                v = attn.v if hasattr(attn, "v") else v_shared
                scores = (q + u[:, None, :]) @ keys.transpose(-1, -2)  # [B, H, 1, K]
            else:
                u = v = None
                scores = q @ keys.transpose(-1, -2)
            if self.tables is not None:
                qp = q if v is None else q + v[:, None, :]
                rk = self.tables[n][:, tcols - klen :]  # [H, K, Dh]: distances K-1 .. 0
                scores = scores + qp @ rk.transpose(-1, -2)
            scores = (scores * attn.scale).masked_fill(blocked, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
            out = attn.out((probs @ values).transpose(1, 2).flatten(2))  # [B, 1, D]
            h = h + out if attn.pre_lnorm else attn.norm(h + out)
            h = layer.ff(h)
        cache.advance(1)
        return model.softmax.log_prob(h[:, -1])


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
            generator.manual_seed(seed if seed is not None else torch.seed())
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
