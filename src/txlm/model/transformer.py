"""The Transformer-XL language model (Dai et al. 2019, Sec. 3).

Legend: B batch, L segment length, M memory length, K = M + L, D model dim, V vocabulary.

    out = model(input_ids [B, L], mems=None, *, reset=None, labels=None, mem_mask=None)
    out.loss       scalar: mean NLL over the labelled tokens (labels given; -100 is ignored)
    out.losses     [B, L] per-token NLL in input order (0 at ignored positions)
    out.log_probs  [B, L, V] (labels not given)
    out.mems       n_layer tensors [B, M', D]: each layer's input states, detached, newest mem_len
    out.mem_mask   [B, M'] bool or None: memory positions the next segment may attend to

``labels[:, t]`` is the token that follows ``input_ids[:, t]``: the model does no shifting.
Feed ``out.mems`` and ``out.mem_mask`` back with the next segment of the same rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from txlm.config import ModelConfig
from txlm.model import align
from txlm.model.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from txlm.model.align import Stored
from txlm.model.attention import PositionwiseFF, RelativeAttention
from txlm.model.cache import CacheStep, KVCache
from txlm.model.dropout import Dropout, dropout
from txlm.model.lengths import Lengths
from txlm.model.mask import attention_mask
from txlm.model.memory import update_memory
from txlm.model.positional import relative_distances, sinusoid


@dataclass
class TransformerXLOutput:
    mems: list[Tensor]
    mem_mask: Tensor | None
    hidden: Tensor  # [B, L, D] last layer's output
    loss: Tensor | None = None  # scalar mean over labelled tokens
    losses: Tensor | None = None  # [B, L] per token, 0 where the label is ignored
    log_probs: Tensor | None = None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0, stored: Stored | None = None) -> None:
        super().__init__()
        stored = Stored.of(config) if stored is None else stored
        self.attn = RelativeAttention(config, index, stored)
        self.ff = PositionwiseFF(config, stored)
        if config.attn_type == "alrfou":
            # Al-Rfou et al.: a learned absolute embedding added to every layer's input.
            self.pos_emb = nn.Parameter(torch.zeros(config.n_positions, stored.d_model))

    def forward(
        self,
        h: Tensor,
        mem: Tensor | None,
        mask: Tensor | None,
        pos: Tensor | None,
        u: Tensor | None,
        v: Tensor | None,
        *,
        cache: CacheStep | None = None,
        return_probs: bool = False,
    ) -> tuple[Tensor, Mapping[str, Tensor]]:
        """h [B, L, D] -> ([B, L, D], attention extras); see RelativeAttention.forward."""
        out, extras = self.attn(h, mem, mask, pos, u, v, cache=cache, return_probs=return_probs)
        return self.ff(out), extras


class TransformerXL(nn.Module):
    def __init__(self, config: ModelConfig, stored: Stored | None = None) -> None:
        """``stored``: the widths its weights are stored with, its attention's key layout and
        its hidden states' dtype (txlm.model.align.Stored; None: as configured, the
        embedding's dtype). Padded weights have zeros past the real entries and checkpoints
        hold the real shapes (``state_dict`` strips, ``load_state_dict`` pads)."""
        super().__init__()
        self._config = config
        self._lengths = Lengths.of(config)
        self._stored = Stored.of(config) if stored is None else stored
        c, s = config, self._stored
        assert c.d_embed is not None
        self.embed = AdaptiveEmbedding(c.vocab_size, c.d_embed, c.d_model, c.cutoffs, c.div_val, s)
        self.drop = Dropout(c.dropout)
        self.layers = nn.ModuleList(DecoderLayer(c, n, s) for n in range(c.n_layer))
        if c.attn_type == "xl" and not c.untie_r:
            # Global content and position biases u, v, shared by all layers (Sec. 3.3).
            self.u = nn.Parameter(torch.zeros(c.n_head, s.d_head))
            self.v = nn.Parameter(torch.zeros(c.n_head, s.d_head))
        self.softmax = AdaptiveLogSoftmax(
            c.vocab_size, c.d_embed, c.d_model, c.cutoffs, c.div_val, s
        )
        names = {n for n, _ in self.named_parameters()}  # before tying: every name
        # parameter name -> its padded axes (txlm.model.align.padding)
        self.padding = {n: pads for n, pads in align.padding(c, s).items() if n in names}
        if self.padding:
            self._register_state_dict_hook(align.strip_hook)
            self._register_load_state_dict_pre_hook(align.pad_hook, with_module=True)
        self.reset_parameters()
        self.tie_weights()

    # -- construction -------------------------------------------------------------------
    def tie_weights(self) -> None:
        """Share output and input embeddings (and projections, per tie_projs)."""
        c = self.config
        if c.tie_weight:
            for out_layer, emb_layer in zip(self.softmax.layers, self.embed.layers, strict=True):
                out_layer.weight = emb_layer.weight
        assert c.tie_projs is not None
        for i, tie in enumerate(c.tie_projs):
            if not tie or not len(self.softmax.projs):
                continue
            self.softmax.projs[i] = self.embed.projs[0 if c.div_val == 1 else i]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, Normal(0, proj_init_std) projections, zero biases;
        a padded parameter drawn in its real shape, zeros after (txlm.model.align)."""
        c = self.config
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            pads = self.padding.get(name)
            real = p if pads is None else p.new_empty(align.real_shape(p.shape, pads))
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                real.fill_(1.0 if leaf == "weight" else 0.0)
            elif ".projs." in name:
                real.normal_(0.0, c.proj_init_std)
            elif leaf == "bias" or leaf == "cluster_bias":
                real.zero_()
            else:
                real.normal_(0.0, c.init_std)
            if pads is not None:
                p.copy_(align.pad(real, *pads))

    # -- configuration and lengths --------------------------------------------------------
    @property
    def config(self) -> ModelConfig:
        """The configuration the model was built with (read-only: other lengths are an
        argument of the forward, see ``lengths``)."""
        return self._config

    @property
    def lengths(self) -> Lengths:
        """The lengths of the built configuration: what a forward uses when given none."""
        return self._lengths

    @property
    def stored(self) -> Stored:
        """What the model stores as it was built (txlm.model.align.Stored): the widths of
        its weights and hidden states (``stored.d_model``: D as stored), its key layout."""
        return self._stored

    @property
    def activation_dtype(self) -> torch.dtype | None:
        """The hidden states' dtype (``stored.activations``; None: the embedding's)."""
        return self._stored.activations

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for p in list(self.embed.parameters()) + list(self.softmax.parameters()):
                params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    # -- forward ------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        mems: list[Tensor] | None = None,
        *,
        reset: Tensor | None = None,
        labels: Tensor | None = None,
        mem_mask: Tensor | None = None,
        lengths: Lengths | None = None,
        bucket_sizes: Sequence[int] | None = None,
    ) -> TransformerXLOutput:
        """``lengths``: the attention lengths of this call (txlm.model.lengths; None: the
        model's, ``model.lengths``); the memory is trimmed to its ``mem_len``.
        ``bucket_sizes``: the adaptive softmax's tail buckets for the labels
        (``AdaptiveLogSoftmax.nll``; None: sized by the clusters' token counts)."""
        # Keyword-only past ``mems``: a positional ``model(x, mems, labels)`` would otherwise
        # read the labels as document-start flags without any error.
        hidden, new_mems, next_mask = self.transform(
            input_ids, mems, reset, mem_mask, lengths=lengths
        )
        return self.output(hidden, new_mems, next_mask, labels, bucket_sizes)

    def output(
        self,
        hidden: Tensor,
        mems: list[Tensor],
        mem_mask: Tensor | None,
        labels: Tensor | None = None,
        bucket_sizes: Sequence[int] | None = None,
    ) -> TransformerXLOutput:
        """The output layer on hidden states [B, L, D]: token losses, or log-probs."""
        out = TransformerXLOutput(mems=mems, mem_mask=mem_mask, hidden=hidden)
        flat = hidden.reshape(-1, hidden.size(-1))
        if labels is not None:
            losses = self.softmax.nll(flat, labels.reshape(-1), sizes=bucket_sizes)
            out.losses = losses.view(labels.shape)
            # a tensor division, not .item(): no host sync; 0 / 1 when nothing is labelled
            counted = (labels != -100).sum().clamp(min=1)
            out.loss = out.losses.sum() / counted
        else:
            out.log_probs = self.softmax.log_prob(flat).view(*hidden.shape[:2], -1)
        return out

    def transform(
        self,
        input_ids: Tensor,
        mems: list[Tensor] | None = None,
        reset: Tensor | None = None,
        mem_mask: Tensor | None = None,
        *,
        lengths: Lengths | None = None,
        cache: KVCache | None = None,
        attn_kwargs: dict | None = None,
        extras: list[dict] | None = None,
    ) -> tuple[Tensor, list[Tensor], Tensor | None]:
        """Hidden states [B, L, D], the updated memory and its validity (no output layer).

        ``lengths``: as in ``forward``; with a cache they are the cache's (it was made for
        them) and none other may be given.
        ``cache`` (inference): the memory's keys and values come from it and this segment's
        go into it (txlm.model.cache); ``mems`` and ``mem_mask`` are then only carried along
        (updated when given, for callers that want the hidden-state memory too).
        Every query length runs the same layers: a segment, a prompt's segment or one
        decoded token.
        ``extras``, when a list, receives each layer's attention extras (see
        RelativeAttention.forward; ``attn_kwargs`` asks for them).
        """
        c = self.config
        if cache is not None:
            if lengths is not None and lengths != cache.lengths:
                raise ValueError(f"lengths {lengths} differ from the cache's {cache.lengths}")
            lengths = cache.lengths
        elif lengths is None:
            lengths = self._lengths
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
        qlen = input_ids.size(1)
        if mems is not None and len(mems) == 0:
            mems = None
        if mems is not None and len(mems) != c.n_layer:
            raise ValueError(f"mems has {len(mems)} layers, the model {c.n_layer}")
        mlen = 0 if mems is None else mems[0].size(1)
        klen = mlen + qlen
        device = input_ids.device

        h = self.embed(input_ids)
        if self.activation_dtype is not None:
            h = h.to(self.activation_dtype)
        if c.attn_type == "vaswani":  # absolute position within the segment
            h = h + sinusoid(torch.arange(qlen, device=device), c.d_model).to(h.dtype)
        if self.training:
            h = dropout(h, self.drop.p, True, c.variational_dropout)

        pos: Tensor | None = None
        step: CacheStep | None = None
        if cache is not None:
            step = cache.advance(qlen, reset)
            mask, next_valid = step.mask, None
            if c.attn_type in ("xl", "shaw"):
                cache.ensure_tables(self.position_table)
        else:
            mask, next_valid = attention_mask(
                qlen, mlen, mem_len=lengths.mem_len, same_length=lengths.same_length,
                reset=reset, mem_valid=mem_mask, device=device,
            )  # fmt: skip
            if c.attn_type == "xl":
                dist = relative_distances(klen, lengths.clamp_len, device)
                pos = self.drop(sinusoid(dist, c.d_model).to(h.dtype))  # R [K+1, D]
            elif c.attn_type == "shaw":
                pos = relative_distances(klen, self._shaw_clamp(lengths.clamp_len), device)
        kwargs = attn_kwargs or {}
        if set(kwargs) - {"return_probs"}:  # the one option the attention takes
            raise TypeError(f"unknown attention options {sorted(set(kwargs) - {'return_probs'})}")
        return_probs = bool(kwargs.get("return_probs", False))

        hiddens = []  # each layer's input: the next memory
        if c.attn_type == "alrfou":
            abs_pos = torch.arange(qlen, device=device).clamp(max=c.n_positions - 1)
        u, v = None, None  # the shared position biases [H, 1, Dh], made once a call
        if hasattr(self, "u"):
            # detached without grad: a view of a parameter made under no_grad still says it
            # requires grad, and hooks on the layers (torch's module tracker) then fail on it
            grad = torch.is_grad_enabled()
            u, v = ((p if grad else p.detach()).unsqueeze(1) for p in (self.u, self.v))
        for n, layer in enumerate(self.layers):
            if c.attn_type == "alrfou":
                h = h + layer.pos_emb[abs_pos].to(h.dtype)
            hiddens.append(h)
            h, layer_extras = layer(
                h, None if mems is None else mems[n], mask, pos, u, v, cache=step,
                return_probs=return_probs,
            )  # fmt: skip
            if extras is not None:
                extras.append(layer_extras)
        if self.training:
            h = dropout(h, self.drop.p, True, c.variational_dropout)
        if cache is not None:
            if mems is None:  # the cache is the memory; no hidden states to carry
                return h, [], None
            next_valid = cache.memory_valid() if cache.per_row else None
        new_mems = update_memory(mems, hiddens, lengths.mem_len)
        return h, new_mems, next_valid

    def _shaw_clamp(self, clamp_len: int) -> int:
        """Largest distance with its own learned row ("shaw"): farther ones share the last."""
        last = self.config.n_positions - 1
        return min(clamp_len, last) if clamp_len > 0 else last

    @torch.no_grad()
    def position_table(self, span: int, clamp_len: int) -> list[Tensor]:
        """Per layer the position keys [H, span, Dh] of distances 0 .. span-1, clamped at
        ``clamp_len`` as the forward clamps them and multiplied by the attention's scale once
        (so no step scales its queries for them): what a cache of ``span`` slots indexes
        (txlm.model.cache)."""
        c = self.config
        weight = self.embed.layers[0].weight
        device = weight.device
        dist = torch.arange(span, device=device, dtype=torch.float32)
        if c.attn_type == "xl":
            if clamp_len > 0:
                dist = dist.clamp(max=clamp_len)
            pos = sinusoid(dist, c.d_model).to(weight.dtype)
        else:
            pos = dist.clamp(max=self._shaw_clamp(clamp_len))
        return [
            (layer.attn.position_keys(pos) * layer.attn.scale).contiguous() for layer in self.layers
        ]

    def new_cache(
        self,
        batch: int,
        max_len: int | None = None,
        *,
        lengths: Lengths | None = None,
        dtype: torch.dtype | None = None,
        static: bool = True,
    ) -> KVCache:
        """An empty cache for ``batch`` rows read with ``lengths`` (None: the model's) in
        segments of up to ``max_len`` (their tgt_len), holding keys and values in ``dtype``
        (the weights' by default). ``static=False``: for eager decoding, whose one-token steps
        then skip the mask (see txlm.model.cache)."""
        c = self.config
        p = self.embed.layers[0].weight
        return KVCache(
            c.n_layer, batch, c.n_head, self._stored.d_head,
            lengths=self._lengths if lengths is None else lengths, max_len=max_len,
            device=p.device, dtype=p.dtype if dtype is None else dtype, static=static,
        )  # fmt: skip
