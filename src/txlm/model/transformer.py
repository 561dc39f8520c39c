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

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from txlm.config import ModelConfig
from txlm.errors import ConfigError
from txlm.model.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from txlm.model.attention import PositionwiseFF, RelativeAttention
from txlm.model.cache import KVCache, LayerCache
from txlm.model.dropout import Dropout, dropout
from txlm.model.mask import attention_mask
from txlm.model.memory import update_memory
from txlm.model.positional import relative_distances, sinusoid

# Fields that may change on a built model (``model.config = ...``, ``model.lengths(...)``).
RUNTIME_FIELDS = (
    "tgt_len", "mem_len", "clamp_len", "same_length", "dropout", "dropatt", "attn_impl",
)  # fmt: skip


@dataclass
class TransformerXLOutput:
    mems: list[Tensor]
    mem_mask: Tensor | None
    hidden: Tensor  # [B, L, D] last layer's output
    loss: Tensor | None = None  # scalar mean over labelled tokens
    losses: Tensor | None = None  # [B, L] per token, 0 where the label is ignored
    log_probs: Tensor | None = None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn = RelativeAttention(config)
        self.ff = PositionwiseFF(config)
        if config.attn_type == "alrfou":
            # Al-Rfou et al.: a learned absolute embedding added to every layer's input.
            self.pos_emb = nn.Parameter(torch.zeros(config.n_positions, config.d_model))

    def forward(self, h, mem, mask, pos, u, v, **attn_kwargs) -> tuple[Tensor, dict]:
        out, extras = self.attn(h, mem, mask, pos, u, v, **attn_kwargs)
        return self.ff(out), extras


class TransformerXL(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        assert c.d_embed is not None
        self.embed = AdaptiveEmbedding(c.vocab_size, c.d_embed, c.d_model, c.cutoffs, c.div_val)
        self.drop = Dropout(c.dropout)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_layer))
        if c.attn_type == "xl" and not c.untie_r:
            # Global content and position biases u, v, shared by all layers (Sec. 3.3).
            self.u = nn.Parameter(torch.zeros(c.n_head, c.d_head))
            self.v = nn.Parameter(torch.zeros(c.n_head, c.d_head))
        self.softmax = AdaptiveLogSoftmax(c.vocab_size, c.d_embed, c.d_model, c.cutoffs, c.div_val)
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
        """Normal(0, init_std) weights, Normal(0, proj_init_std) projections, zero biases."""
        c = self.config
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                p.fill_(1.0 if leaf == "weight" else 0.0)
            elif ".projs." in name:
                p.normal_(0.0, c.proj_init_std)
            elif leaf == "bias" or leaf == "cluster_bias":
                p.zero_()
            else:
                p.normal_(0.0, c.init_std)

    # -- configuration and lengths --------------------------------------------------------
    @property
    def config(self) -> ModelConfig:
        return self._config

    @config.setter
    def config(self, config: ModelConfig) -> None:
        """Assigning a config takes effect or fails: never a silent no-op.

        Lengths are read from the config on every forward; dropout rates and the attention
        kernel are pushed into the modules that hold them; every other field fixes the
        parameters' shapes or their meaning, and changing it needs a new model.
        """
        old = getattr(self, "_config", None)
        if old is not None:
            fixed = [
                f.name
                for f in dataclasses.fields(config)
                if f.name not in RUNTIME_FIELDS and getattr(config, f.name) != getattr(old, f.name)
            ]
            if fixed:
                raise ConfigError(
                    f"{', '.join(fixed)} cannot change on a built model (only "
                    f"{', '.join(RUNTIME_FIELDS)} can); build a new TransformerXL"
                )
        self._config = config
        for module in self.modules():
            if isinstance(module, Dropout):
                module.p = config.dropout
            elif isinstance(module, RelativeAttention):
                module.attn_impl, module.dropatt = config.attn_impl, config.dropatt

    def set_lengths(
        self,
        *,
        tgt_len: int | None = None,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        same_length: bool | None = None,
    ) -> None:
        """Change the attention lengths for good, e.g. for a model loaded to generate."""
        changes = {
            k: val
            for k, val in dict(
                tgt_len=tgt_len, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length
            ).items()
            if val is not None
        }
        self.config = self.config.replace(**changes)

    @contextlib.contextmanager
    def lengths(
        self,
        *,
        tgt_len: int | None = None,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        same_length: bool | None = None,
    ) -> Iterator[TransformerXL]:
        """``with model.lengths(mem_len=4 * m):`` other lengths for the block only (e.g. to
        evaluate with longer memory than training); restored on exit, also on an exception."""
        saved = self.config
        try:
            self.set_lengths(
                tgt_len=tgt_len, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length
            )
            yield self
        finally:
            self.config = saved

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for p in list(self.embed.parameters()) + list(self.softmax.parameters()):
                params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    def generate(self, prompts, **kwargs):
        """Sample continuations with the cached incremental decoder: ``txlm.generate.generate``."""
        from txlm.generate import generate  # imported here: txlm.generate imports this module

        return generate(self, prompts, **kwargs)

    # -- forward ------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        mems: list[Tensor] | None = None,
        *,
        reset: Tensor | None = None,
        labels: Tensor | None = None,
        mem_mask: Tensor | None = None,
    ) -> TransformerXLOutput:
        # Keyword-only past ``mems``: a positional ``model(x, mems, labels)`` would otherwise
        # read the labels as document-start flags without any error.
        hidden, new_mems, next_mask = self.transform(input_ids, mems, reset, mem_mask)
        return self.output(hidden, new_mems, next_mask, labels)

    def output(
        self,
        hidden: Tensor,
        mems: list[Tensor],
        mem_mask: Tensor | None,
        labels: Tensor | None = None,
    ) -> TransformerXLOutput:
        """The output layer on hidden states [B, L, D]: token losses, or log-probs."""
        out = TransformerXLOutput(mems=mems, mem_mask=mem_mask, hidden=hidden)
        flat = hidden.reshape(-1, hidden.size(-1))
        if labels is not None:
            out.losses = self.softmax.nll(flat, labels.reshape(-1)).view(labels.shape)
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
        cache: KVCache | None = None,
        attn_kwargs: dict | None = None,
        extras: list[dict] | None = None,
    ) -> tuple[Tensor, list[Tensor], Tensor | None]:
        """Hidden states [B, L, D], the updated memory and its validity (no output layer).

        ``cache`` (inference): the memory's keys and values come from it and this segment's
        go into it (txlm.model.cache); ``mems`` and ``mem_mask`` are then only carried along
        (updated when given, for callers that want the hidden-state memory too).
        ``extras``, when a list, receives each layer's attention extras (see
        RelativeAttention.forward; ``attn_kwargs`` asks for them).
        """
        c = self.config
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
        if c.attn_type == "vaswani":  # absolute position within the segment
            h = h + sinusoid(torch.arange(qlen, device=device), c.d_model).to(h.dtype)
        h = dropout(h, self.drop.p, self.training)

        pos: Tensor | None = None
        if cache is not None:
            step = cache.advance(qlen, reset, same_length=c.same_length)
            mask, next_valid = step.mask, None
            if c.attn_type in ("xl", "shaw"):
                cache.ensure_tables(self.position_table)
        else:
            mask, next_valid = attention_mask(
                qlen, mlen, mem_len=c.mem_len, same_length=c.same_length,
                reset=reset, mem_valid=mem_mask, device=device,
            )  # fmt: skip
            if c.attn_type == "xl":
                dist = relative_distances(klen, c.clamp_len, device)
                pos = self.drop(sinusoid(dist, c.d_model).to(h.dtype))  # R [K+1, D]
            elif c.attn_type == "shaw":
                pos = relative_distances(klen, self._shaw_clamp(), device)
        u = getattr(self, "u", None)
        v = getattr(self, "v", None)

        hiddens = []
        if c.attn_type == "alrfou":
            abs_pos = torch.arange(qlen, device=device).clamp(max=c.n_positions - 1)
        for n, layer in enumerate(self.layers):
            if c.attn_type == "alrfou":
                h = h + layer.pos_emb[abs_pos].to(h.dtype)
            hiddens.append(h)
            layer_kwargs = dict(attn_kwargs or {})
            if cache is not None:
                layer_kwargs["cache"] = LayerCache(cache, step, n)
            h, layer_extras = layer(
                h, None if mems is None else mems[n], mask, pos, u, v, **layer_kwargs
            )
            if extras is not None:
                extras.append(layer_extras)
        h = dropout(h, self.drop.p, self.training)
        if cache is not None:
            if mems is None:  # the cache is the memory; no hidden states to carry
                return h, [], None
            next_valid = cache.memory_valid() if cache.per_row else None
        new_mems = update_memory(mems, hiddens, c.mem_len)
        return h, new_mems, next_valid

    def _shaw_clamp(self) -> int:
        """Largest distance with its own learned row ("shaw"): farther ones share the last."""
        c = self.config
        return min(c.clamp_len, c.n_positions - 1) if c.clamp_len > 0 else c.n_positions - 1

    @torch.no_grad()
    def position_table(self, span: int) -> list[Tensor]:
        """Per layer the position keys [H, span, Dh] of distances 0 .. span-1, clamped as the
        forward clamps them and multiplied by the attention's scale once (so no step scales
        its queries for them): what a cache of ``span`` slots indexes (txlm.model.cache)."""
        c = self.config
        weight = self.embed.layers[0].weight  # (a decoder's copy may hold plain tensors)
        device = weight.device
        dist = torch.arange(span, device=device, dtype=torch.float32)
        if c.attn_type == "xl":
            if c.clamp_len > 0:
                dist = dist.clamp(max=c.clamp_len)
            pos = sinusoid(dist, c.d_model).to(weight.dtype)
        else:
            pos = dist.clamp(max=self._shaw_clamp())
        return [
            (layer.attn.position_keys(pos) * layer.attn.scale).contiguous() for layer in self.layers
        ]

    def new_cache(
        self,
        batch: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        static: bool = True,
    ) -> KVCache:
        """An empty cache for ``batch`` rows and segments of up to ``max_len`` (tgt_len),
        holding keys and values in ``dtype`` (the weights' by default). ``static=False``: for
        eager decoding, whose one-token steps then skip the mask (see txlm.model.cache)."""
        c = self.config
        p = self.embed.layers[0].weight
        return KVCache(
            c.n_layer, batch, c.n_head, self.layers[0].attn.d_head, mem_len=c.mem_len,
            max_len=c.tgt_len if max_len is None else max_len, device=p.device,
            dtype=p.dtype if dtype is None else dtype, static=static,
        )  # fmt: skip
