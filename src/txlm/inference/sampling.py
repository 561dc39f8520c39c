"""Drawing the next token from a distribution: the paper's top-k (Appendix E), top-p,
temperature and greedy decoding, on the device.

Dimension legend
    B  rows     V  vocabulary     k  candidates kept by top-k

Every function here is device work only: no value is read back to the host, so a draw can
follow a decoding step inside one captured graph. A draw is an exponential race (``draw``:
argmax p_i / E_i, what ``torch.multinomial`` computes for one sample), so the same generator
state gives the same token whichever of these functions computed the probabilities; a draw
over a whole vocabulary inverts the CDF at one uniform (``draw_cdf``).

The random numbers of a draw (``noise``: an exponential per top-k candidate, or one uniform
per row) can be drawn ahead, ``draw_noise``, and the draw given them: a pure function of the
scores and the noise, which a compiled or captured decoding step can hold (a generator can
be neither traced nor captured). Drawn with the same generator, shape and dtype as the draw
itself would, they are the same numbers, so the same token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from txlm.errors import ConfigError
from txlm.model.adaptive import upcast


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
    scores: Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None = None,
    *,
    noise: Tensor | None = None,
) -> Tensor:
    """Draw one token per row: [B, V] scores -> [B] ids.

    ``scores`` are log-probabilities or raw logits: only their differences within a row
    matter (the kept mass is renormalised), so the decoder can skip the log-softmax.
    A top-k cut draws among its k candidates (``draw``); a draw over the whole vocabulary
    inverts the distribution's CDF at one uniform per row (``draw_cdf``), which an adaptive
    softmax keeps while skipping the clusters the draw cannot reach (``clusters_needed``).
    ``noise``: the draw's random numbers (``draw_noise``), else drawn here from ``generator``.
    """
    if config.greedy:
        return scores.argmax(dim=-1)
    if noise is None:
        noise = draw_noise(config, scores.size(0), scores.size(-1), generator, scores.device,
                           upcast(scores).dtype)  # fmt: skip
    top = top_k_candidates(scores, config)
    if top is not None:
        probs, ids = top
        return ids.gather(1, race(probs, noise)).squeeze(1)
    probs = filter_log_probs(scores, config).softmax(dim=-1)
    return cdf_index(probs.cumsum(dim=-1), noise.to(probs.dtype))


def clusters_needed(
    config: SamplingConfig, shortlist: int, noise: Tensor | None
) -> Callable[[Tensor], Tensor] | None:
    """Which tail clusters of an adaptive softmax a draw of ``config`` may take its token
    from, as a rule on the head's log-probabilities: [B, shortlist + C] (the shortlist
    tokens', then one per cluster) -> bool [B, C]; what ``AdaptiveLogSoftmax.log_prob``
    (``need=``) computes. None where the head rules no cluster out (top-p alone, a
    temperature without top-k, a top-k above the shortlist). ``noise``: the draw's random
    numbers (``draw_noise``), the same the draw is then given.

    A token of cluster c has log-probability head_c + log p(token | c) <= head_c, so:
    - greedy, top-k: a cluster whose head_c is below the k-th best shortlist log-probability
      holds no candidate, and the k best of the vocabulary are among the shortlist's and the
      other clusters';
    - plain sampling (temperature 1): the inverse CDF over the vocabulary, laid out
      shortlist then cluster by cluster as the head is, falls at its uniform inside the
      cluster the head's own inverse CDF draws at it: that cluster only.
    """
    if config.greedy or (config.top_k is not None and config.top_k <= shortlist):
        k = 1 if config.greedy else config.top_k

        def above_kth(head: Tensor) -> Tensor:
            kth = head[:, :shortlist].topk(k, dim=-1).values[:, -1:]  # [B, 1]
            return head[:, shortlist:] >= kth

        return above_kth
    plain = config.top_p is None or config.top_p >= 1.0
    if config.top_k is not None or not plain or config.temperature != 1.0:
        return None
    assert noise is not None

    def drawn(head: Tensor) -> Tensor:
        index = cdf_index(head.exp().cumsum(dim=-1), noise.to(head.dtype))  # [B]
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
    generator: torch.Generator | None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    out: Tensor | None = None,
) -> Tensor | None:
    """The random numbers of one draw (``noise_shape``), in ``out`` when given (a static
    buffer: one kernel, no allocation). ``dtype``: the scores' (exponentials are compared
    with the candidates' probabilities in it); a uniform is float32, as the probabilities
    of a full draw (``filter_log_probs``). The same numbers as the draw makes itself."""
    shape = noise_shape(config, batch, vocab)
    if shape is None:
        return None
    kind, width = shape
    if out is None:
        dtype = dtype if kind == "exponential" else torch.float32
        out = torch.empty(batch, width, device=device, dtype=dtype)
    if kind == "exponential":
        return out.exponential_(generator=generator)
    return out.uniform_(generator=generator)


def top_k_candidates(scores: Tensor, config: SamplingConfig) -> tuple[Tensor, Tensor] | None:
    """[B, V] scores -> (probabilities [B, k], their token ids [B, k]), or None.

    The distribution of ``filter_log_probs`` restricted to the k tokens it keeps: one
    ``topk`` and a softmax over k values instead of masking and normalising the whole
    vocabulary, and a draw over k candidates (an exponential per candidate, see ``draw``).
    None when there is no top-k cut. Device work only: no value is read on the host.
    """
    k, vocab = config.top_k, scores.size(-1)
    if k is None or k >= vocab:
        return None
    vals, ids = upcast(scores).topk(k, dim=-1)  # [B, k], largest first
    return candidate_probs(vals, config), ids


def candidate_probs(vals: Tensor, config: SamplingConfig) -> Tensor:
    """The k best scores [B, k], largest first -> their sampling probabilities [B, k]:
    temperature, then the nucleus rule of ``filter_log_probs`` among them, renormalised."""
    kept = vals if config.temperature == 1.0 else vals / config.temperature
    if config.top_p is not None and config.top_p < 1.0:
        probs = kept.softmax(dim=-1)  # already sorted: the nucleus rule of filter_log_probs
        before = probs.cumsum(dim=-1) - probs
        kept = kept.masked_fill(before >= config.top_p, float("-inf"))
    return kept.softmax(dim=-1)


def draw_cdf(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row of [B, V] probabilities -> [B]: the first index whose cumulative
    probability exceeds a uniform u (inverse-CDF sampling; a u past the rounded total is
    clamped to the last index)."""
    u = torch.rand(probs.size(0), 1, generator=generator, device=probs.device, dtype=probs.dtype)
    return cdf_index(probs.cumsum(dim=-1), u)


def cdf_index(cdf: Tensor, u: Tensor) -> Tensor:
    """[B, N] cumulative probabilities, [B, 1] uniforms -> [B]: how many entries are <= u
    (the drawn index), at most N - 1."""
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=cdf.size(-1) - 1)


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row of [B, k] probabilities -> [B, 1]: ``torch.multinomial(probs, 1)``
    without its input checks (a dozen small operations; softmax output needs none).

    It is the same computation (ATen draws a single sample as argmax p_i / E_i with E_i
    exponential, one per candidate), so the same generator state gives the same index.
    """
    return race(probs, torch.empty_like(probs).exponential_(generator=generator))


def race(probs: Tensor, noise: Tensor) -> Tensor:
    """[B, k] probabilities, [B, k] exponentials -> [B, 1]: the index of argmax p_i / E_i."""
    return (probs / noise).argmax(dim=-1, keepdim=True)
