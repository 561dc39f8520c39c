"""Drawing the next token from a distribution: the paper's top-k (Appendix E), top-p, min-p,
temperature, greedy decoding, a repetition penalty and banned tokens, on the device.

Dimension legend
    B  rows     V  vocabulary     k  candidates kept by top-k

API (stable; txlm.inference.generate and the server build on it)
    ``SamplingConfig``: one row's (or a batch's) settings, frozen and hashable: temperature
        (0: greedy), top_k, top_p, min_p, repetition_penalty, ban (token ids never drawn),
        stop (stop strings: not part of the draw, matched by txlm.inference.stops).
    ``sample(scores, config, generator, *, noise=None, seen=None) -> [B] ids``: one draw per
        row from [B, V] log-probabilities (or raw logits where no repetition penalty is set).
        ``generator``: one ``torch.Generator`` for the batch, or one per row (a sequence of B).
        ``seen``: bool [B, V], the tokens already present in each row (``seen_tokens``),
        needed by a repetition penalty.
    ``sample_each(scores, configs, generators, *, seen=None) -> [B] ids``: each row with its
        own settings and generator (a server's batch); rows that share settings draw together.
    ``filter_log_probs(scores, config, seen=None) -> [B, V]``: the controls applied, the
        excluded tokens at -inf: softmax of it is the distribution a draw samples.
    ``seen_tokens(rows, vocab, device)`` / ``mark_seen(seen, ids)``: the presence mask a
        repetition penalty reads.
    ``draw_noise``, ``clusters_needed``: a draw's random numbers drawn ahead, and which tail
        clusters of an adaptive softmax it may need (what a compiled decoding step holds).

Order of the controls (Hugging Face's): the repetition penalty and the bans on the
log-probabilities, then temperature, top-k, top-p, min-p; greedy takes the argmax after the
penalty and the bans.

Every function here is device work only: no value is read back to the host, so a draw can
follow a decoding step inside one captured graph. A top-k draw is an exponential race
(``race``: argmax p_i / E_i, what ``torch.multinomial`` computes for one sample), a draw over
the whole vocabulary inverts the CDF at one uniform per row (``cdf_index``), so the same
generator state gives the same token whichever of these functions computed the probabilities.

The random numbers of a draw (``noise``: an exponential per top-k candidate, or one uniform
per row) can be drawn ahead, ``draw_noise``, and the draw given them: a pure function of the
scores and the noise, which a compiled or captured decoding step can hold (a generator can
be neither traced nor captured). Drawn with the same generator, shape and dtype as the draw
itself would, they are the same numbers, so the same token; a row drawn from its own
generator draws what it would alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from txlm.errors import ConfigError
from txlm.model.adaptive import upcast

Generators = torch.Generator | Sequence[torch.Generator] | None  # one, one per row, or none


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is drawn from a distribution.

    ``top_k``: keep the k most likely tokens (None: all). ``top_p``: then keep the smallest set
    of most likely tokens whose mass reaches p (nucleus sampling; None or 1.0: all).
    ``min_p``: then keep the tokens whose probability is at least min_p times the most likely
    one's (None or 0: all). ``temperature`` divides the log-probabilities first; 0 means
    greedy. ``greedy`` takes the argmax and ignores temperature, top-k, top-p and min-p. The
    kept mass is renormalised before drawing.

    ``repetition_penalty`` (CTRL; Hugging Face's ``RepetitionPenaltyLogitsProcessor``): the
    log-probability s of every token already present in the row (the prompt's and the
    generated ones) becomes s / penalty where s > 0, s * penalty otherwise (log-probabilities
    are <= 0, so: multiplied); 1: off. ``ban``: token ids never drawn (their scores -inf).
    ``stop``: stop strings, matched on the decoded text by the generation loop
    (txlm.inference.stops); they do not change a draw, so they take no part in equality and
    hashing: two settings that draw alike share one compiled decoding step.
    """

    top_k: int | None = 40
    top_p: float | None = None
    temperature: float = 1.0
    greedy: bool = False
    min_p: float | None = None
    repetition_penalty: float = 1.0
    ban: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        k, p, t = self.top_k, self.top_p, self.temperature
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ConfigError(f"top-k must be an integer >= 1, got {k!r}")
        if p is not None and (not isinstance(p, int | float) or not 0.0 < p <= 1.0):
            raise ConfigError(f"top-p must be in (0, 1], got {p!r}")
        if not isinstance(t, int | float) or isinstance(t, bool) or not t >= 0.0 or math.isinf(t):
            raise ConfigError(f"temperature must be a number >= 0 (0: greedy), got {t!r}")
        if t == 0.0:
            object.__setattr__(self, "greedy", True)
        m = self.min_p
        if m is not None and (not isinstance(m, int | float) or not 0.0 <= m <= 1.0):
            raise ConfigError(f"min-p must be in [0, 1], got {m!r}")
        r = self.repetition_penalty
        if not isinstance(r, int | float) or not r > 0.0 or math.isinf(r):
            raise ConfigError(f"repetition penalty must be a positive number, got {r!r}")
        ban = tuple(self.ban)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ban):
            raise ConfigError(f"banned tokens must be ids >= 0, got {list(ban)!r}")
        object.__setattr__(self, "ban", tuple(sorted(set(ban))))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ConfigError(f"stop strings must be non-empty text, got {list(stop)!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def penalised(self) -> bool:
        """Whether a draw reads the row's history (``seen``): a repetition penalty is set."""
        return self.repetition_penalty != 1.0

    @property
    def min_ratio(self) -> float | None:
        """min_p when it excludes anything, else None."""
        return self.min_p if self.min_p else None


def seen_tokens(rows: Sequence[Sequence[int]], vocab: int, device=None) -> Tensor:
    """bool [B, V]: which tokens each row holds already (what a repetition penalty reads)."""
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            seen[b, torch.tensor(list(r), dtype=torch.long)] = True
    return seen.to(device)


def mark_seen(seen: Tensor, ids: Tensor) -> Tensor:
    """``seen`` [B, V] with each row's new token ``ids`` [B] marked, in place."""
    return seen.scatter_(1, ids.view(-1, 1).to(seen.device), True)


def penalise(scores: Tensor, config: SamplingConfig, seen: Tensor | None) -> Tensor:
    """[B, V] log-probabilities -> the same with the repetition penalty and the bans applied
    (the controls that come before temperature). Bans are one slice each: nothing is copied
    to the device, so a captured step can hold them."""
    if config.penalised:
        if seen is None:
            raise ConfigError("a repetition penalty needs each row's tokens so far (seen)")
        r = config.repetition_penalty
        scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
    if config.ban:
        scores = scores.clone()
        for i in config.ban:
            if i < scores.size(-1):
                scores[:, i] = float("-inf")
    return scores


def filter_log_probs(
    log_probs: Tensor, config: SamplingConfig, seen: Tensor | None = None
) -> Tensor:
    """[B, V] log-probabilities -> [B, V] scores with the excluded tokens at -inf: the
    repetition penalty and the bans, temperature, top-k, top-p and min-p in that order.

    The result is unnormalised; softmax of it is the renormalised sampling distribution.
    """
    scores = penalise(log_probs.float(), config, seen)
    return scores if config.greedy else truncate(scores, config)


def truncate(scores: Tensor, config: SamplingConfig) -> Tensor:
    """[B, V] scores (penalised) -> temperature, top-k, top-p and min-p applied, the excluded
    tokens at -inf."""
    scores = scores / config.temperature
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
    return min_p_cut(scores, config)


def min_p_cut(scores: Tensor, config: SamplingConfig) -> Tensor:
    """[B, N] tempered scores -> the same with the tokens below min_p times the most likely
    token's probability at -inf: p_i >= min_p * p_max is s_i - s_max >= log(min_p), whatever
    the normalisation (and the most likely token always stays)."""
    ratio = config.min_ratio
    if ratio is None:
        return scores
    best = scores.max(dim=-1, keepdim=True).values
    return scores.masked_fill(scores - best < math.log(ratio), float("-inf"))


def sample(
    scores: Tensor,
    config: SamplingConfig,
    generator: Generators = None,
    *,
    noise: Tensor | None = None,
    seen: Tensor | None = None,
) -> Tensor:
    """Draw one token per row: [B, V] scores -> [B] ids.

    ``scores`` are log-probabilities or, without a repetition penalty, raw logits: then only
    their differences within a row matter (the kept mass is renormalised), so the decoder can
    skip the log-softmax. A top-k cut draws among its k candidates (``race``); a draw over the
    whole vocabulary inverts the distribution's CDF at one uniform per row (``cdf_index``),
    which an adaptive softmax keeps while skipping the clusters the draw cannot reach
    (``clusters_needed``). ``noise``: the draw's random numbers (``draw_noise``), else drawn
    here from ``generator`` (one, or one per row). ``seen``: bool [B, V], each row's tokens
    so far, for a repetition penalty (``seen_tokens``).
    """
    if config.greedy:
        return penalise(scores, config, seen).argmax(dim=-1)
    if noise is None:
        noise = draw_noise(config, scores.size(0), scores.size(-1), generator, scores.device,
                           upcast(scores).dtype)  # fmt: skip
    if config.penalised or config.ban:
        scores = penalise(upcast(scores), config, seen)
    top = top_k_candidates(scores, config)
    if top is not None:
        probs, ids = top
        return ids.gather(1, race(probs, noise)).squeeze(1)
    probs = truncate(scores.float(), config).softmax(dim=-1)
    return cdf_index(probs.cumsum(dim=-1), noise.to(probs.dtype))


def sample_each(
    scores: Tensor,
    configs: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator | None],
    *,
    seen: Tensor | None = None,
) -> Tensor:
    """One draw per row, row b with ``configs[b]`` and ``generators[b]``: [B, V] scores
    (log-probabilities where a row has a repetition penalty) -> [B] ids. Rows of equal
    settings are drawn in one ``sample`` call, each still from its own generator, so every
    row draws what it would alone. ``seen``: bool [B, V] (``seen_tokens``), needed where a
    row has a repetition penalty."""
    if not len(configs) == len(generators) == scores.size(0):
        raise ConfigError(
            f"{len(configs)} settings and {len(generators)} generators for {scores.size(0)} rows"
        )
    out = torch.empty(scores.size(0), dtype=torch.long, device=scores.device)
    groups: dict[SamplingConfig, list[int]] = {}
    for b, config in enumerate(configs):
        groups.setdefault(config, []).append(b)
    for config, rows in groups.items():
        index = torch.tensor(rows, device=scores.device)
        part = None if seen is None else seen.index_select(0, index)
        gens = [generators[b] for b in rows]
        out[index] = sample(scores.index_select(0, index), config, gens, seen=part)
    return out


def clusters_needed(
    config: SamplingConfig, shortlist: int, noise: Tensor | None
) -> Callable[[Tensor], Tensor] | None:
    """Which tail clusters of an adaptive softmax a draw of ``config`` may take its token
    from, as a rule on the head's log-probabilities: [B, shortlist + C] (the shortlist
    tokens', then one per cluster) -> bool [B, C]; what ``AdaptiveLogSoftmax.log_prob``
    (``need=``) computes. None where the head rules no cluster out (top-p alone, a
    temperature without top-k or min-p, min-p with top-p at a temperature, a top-k above
    the shortlist, a repetition penalty, a ban on a tail token in plain sampling): the draw
    is then over the full distribution.
    ``noise``: the draw's random numbers (``draw_noise``), the same the draw is then given.

    A token of cluster c has log-probability head_c + log p(token | c) <= head_c, so:
    - greedy, top-k: a cluster whose head_c is below the k-th best allowed (not banned)
      shortlist log-probability holds no candidate, and the k best of the vocabulary are
      among the shortlist's and the other clusters';
    - min-p without top-k: a cluster whose head_c is below the best allowed shortlist
      log-probability + T log(min_p) holds no token min-p keeps (the best of the vocabulary
      is at least the shortlist's); the tokens it keeps are then exact, and those of a
      skipped cluster, head_c - log n_c, fall below the cut too; under top-p only at
      temperature 1, where a skipped cluster keeps its mass, so top-p ranks and weighs the
      kept tokens as over the full softmax (tempered, the evenly spread mass is not the
      cluster's);
    - plain sampling (temperature 1): the inverse CDF over the vocabulary, laid out
      shortlist then cluster by cluster as the head is, falls at its uniform inside the
      cluster the head's own inverse CDF draws at it (banned shortlist tokens removed from
      both and the rest renormalised): that cluster only.
    A repetition penalty moves each row's seen tokens, which the head cannot bound: None.
    """
    if config.penalised:
        return None
    banned = [i for i in config.ban if i < shortlist]

    def allowed(head: Tensor) -> Tensor:  # the shortlist's log-probabilities, bans at -inf
        short = head[:, :shortlist]
        if banned:
            short = short.clone()
            for i in banned:
                short[:, i] = float("-inf")
        return short

    if config.greedy or (config.top_k is not None and config.top_k <= shortlist):
        k = 1 if config.greedy else config.top_k

        def above_kth(head: Tensor) -> Tensor:
            kth = allowed(head).topk(k, dim=-1).values[:, -1:]  # [B, 1]
            return head[:, shortlist:] >= kth

        return above_kth
    if config.top_k is not None:
        return None
    ratio = config.min_ratio
    plain = config.top_p is None or config.top_p >= 1.0
    if ratio is not None and (plain or config.temperature == 1.0):
        margin = config.temperature * math.log(ratio)

        def above_cut(head: Tensor) -> Tensor:
            best = allowed(head).max(dim=-1, keepdim=True).values  # [B, 1]
            return head[:, shortlist:] >= best + margin

        return above_cut
    if ratio is not None or not plain or config.temperature != 1.0 or len(banned) < len(config.ban):
        return None
    assert noise is not None

    def drawn(head: Tensor) -> Tensor:
        probs = torch.cat([allowed(head), head[:, shortlist:]], dim=-1).exp()
        cdf = probs.cumsum(dim=-1)
        if banned:  # renormalised as the draw's softmax is
            cdf = cdf / cdf[:, -1:]
        index = cdf_index(cdf, noise.to(head.dtype))  # [B]
        clusters = torch.arange(shortlist, head.size(-1), device=head.device)
        return index[:, None] == clusters

    return drawn


def noise_shape(config: SamplingConfig, batch: int, vocab: int) -> tuple[str, int] | None:
    """What a draw of ``config`` over [batch, vocab] scores consumes: ("exponential", k),
    an exponential per top-k candidate [batch, k]; ("uniform", 1), a uniform per row
    [batch, 1]; None for greedy decoding (no random numbers)."""
    if config.greedy:
        return None
    if config.top_k is not None and config.top_k < vocab:
        return "exponential", config.top_k
    return "uniform", 1


def draw_noise(
    config: SamplingConfig,
    batch: int,
    vocab: int,
    generator: Generators,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    out: Tensor | None = None,
) -> Tensor | None:
    """The random numbers of one draw (``noise_shape``), in ``out`` when given (a static
    buffer: one kernel, no allocation). ``dtype``: the scores' (exponentials are compared
    with the candidates' probabilities in it); a uniform is float32, as the probabilities
    of a full draw (``filter_log_probs``). The same numbers as the draw makes itself.
    ``generator``: one for the batch, or a sequence of one per row: row b's numbers then
    come from generator b alone, the numbers that row would draw in a batch of one."""
    shape = noise_shape(config, batch, vocab)
    if shape is None:
        return None
    kind, width = shape
    if out is None:
        dtype = dtype if kind == "exponential" else torch.float32
        out = torch.empty(batch, width, device=device, dtype=dtype)
    rows: Sequence[torch.Generator | None]
    if generator is None or isinstance(generator, torch.Generator):
        rows, out_rows = [generator], [out]
    else:
        rows = list(generator)
        if len(rows) != batch:
            raise ConfigError(f"{len(rows)} generators for {batch} rows")
        out_rows = list(out)
    for g, row in zip(rows, out_rows, strict=True):
        if kind == "exponential":
            row.exponential_(generator=g)
        else:
            row.uniform_(generator=g)
    return out


def top_k_candidates(scores: Tensor, config: SamplingConfig) -> tuple[Tensor, Tensor] | None:
    """[B, V] scores -> (probabilities [B, k], their token ids [B, k]), or None.

    The distribution of ``filter_log_probs`` restricted to the k tokens it keeps: one
    ``topk`` and a softmax over k values instead of masking and normalising the whole
    vocabulary, and a draw over k candidates (an exponential per candidate, see ``race``).
    None when there is no top-k cut. Device work only: no value is read on the host.
    """
    k, vocab = config.top_k, scores.size(-1)
    if k is None or k >= vocab:
        return None
    vals, ids = upcast(scores).topk(k, dim=-1)  # [B, k], largest first
    return candidate_probs(vals, config), ids


def candidate_probs(vals: Tensor, config: SamplingConfig) -> Tensor:
    """The k best scores [B, k], largest first -> their sampling probabilities [B, k]:
    temperature, then the nucleus rule of ``filter_log_probs`` among them and min-p,
    renormalised."""
    kept = vals if config.temperature == 1.0 else vals / config.temperature
    if config.top_p is not None and config.top_p < 1.0:
        probs = kept.softmax(dim=-1)  # already sorted: the nucleus rule of filter_log_probs
        before = probs.cumsum(dim=-1) - probs
        kept = kept.masked_fill(before >= config.top_p, float("-inf"))
    return min_p_cut(kept, config).softmax(dim=-1)


def cdf_index(cdf: Tensor, u: Tensor) -> Tensor:
    """[B, N] cumulative probabilities, [B, 1] uniforms -> [B]: how many entries are <= u
    (the drawn index), at most N - 1."""
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=cdf.size(-1) - 1)


def race(probs: Tensor, noise: Tensor) -> Tensor:
    """[B, k] probabilities, [B, k] exponentials -> [B, 1]: the index of argmax p_i / E_i."""
    return (probs / noise).argmax(dim=-1, keepdim=True)
