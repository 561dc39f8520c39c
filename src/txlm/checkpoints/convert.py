"""Import of published Transformer-XL checkpoints (Hugging Face ``TransfoXLLMHeadModel``).

    convert_hf(src_dir, out_dir) -> ConversionResult

``src_dir`` is a Hugging Face TransfoXL directory, the layout of ``transfo-xl-wt103``:
``config.json`` plus ``model.safetensors`` or ``pytorch_model.bin`` (sharded variants with an
``*.index.json`` too), optionally the tokenizer's pickled vocabulary ``vocab.pkl`` /
``vocab.bin``. The result is an ordinary txlm checkpoint (``txlm.load`` reads it).

The conversion is strict in both directions: every tensor of the source must land somewhere,
and every txlm tensor must be filled, with the right shape. Tensors that txlm ties (output
and input embeddings, shared projections, the shared u/v biases) may appear several times in
the source — a ``.bin`` keeps every alias, safetensors keeps one — and then must all be equal.
Anything else is a ``CheckpointError`` that names the tensor.

Name map (HF -> txlm), ``L`` a layer index, ``i`` a cluster index:

    transformer.word_emb.emb_layers.i.weight        embed.layers.i.weight
    transformer.word_emb.emb_projs.i                embed.projs.i
    transformer.layers.L.dec_attn.qkv_net.weight    layers.L.attn.qkv.weight  (rows: q, k, v)
    transformer.layers.L.dec_attn.r_net.weight      layers.L.attn.r_net.weight  (W_kR)
    transformer.layers.L.dec_attn.o_net.weight      layers.L.attn.out.weight
    transformer.layers.L.dec_attn.layer_norm.*      layers.L.attn.norm.*
    transformer.layers.L.pos_ff.CoreNet.0.*         layers.L.ff.fc1.*
    transformer.layers.L.pos_ff.CoreNet.3.*         layers.L.ff.fc2.*
    transformer.layers.L.pos_ff.layer_norm.*        layers.L.ff.norm.*
    r_w_bias (content bias, paper's u)              u, or layers.L.attn.u when untie_r
    r_r_bias (position bias, paper's v)             v, or layers.L.attn.v when untie_r
    crit.out_layers.i.*, crit.out_projs.i           softmax.layers.i.*, softmax.projs.i
    crit.cluster_weight, crit.cluster_bias          softmax.cluster_weight, .cluster_bias
    transformer.pos_emb.inv_freq                    (checked against txlm's frequencies)

HF keeps the biases in two places: with ``untie_r`` one pair per layer inside ``dec_attn``;
without it one pair on the model (``transformer.r_w_bias``) that every layer's ``dec_attn``
also references, so a ``.bin`` lists it n_layer + 1 times. Checkpoints exported straight
from the original TensorFlow code stack the untied pairs as [n_layer, H, Dh]; those are split.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from txlm.checkpoints.files import BUILD_DIRECTLY_BELOW, rough_parameter_count, save
from txlm.checkpoints.safe_unpickle import load_pickled_object
from txlm.config import ModelConfig
from txlm.data.vocab import Vocab
from txlm.errors import CheckpointError, ConfigError
from txlm.model import TransformerXL
from txlm.model.positional import inverse_frequencies

HF_CONFIG = "config.json"
HF_SAFETENSORS = "model.safetensors"
HF_BIN = "pytorch_model.bin"
HF_VOCAB_FILES = ("vocab.pkl", "vocab.bin")  # the tokenizer's name first, then the legacy one


@dataclass
class ConversionResult:
    out_dir: Path
    config: ModelConfig
    n_tensors: int  # source tensors consumed
    n_parameters: int
    weights_file: str
    vocab_file: str | None = None
    vocab_size: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out_dir),
            "n_tensors": self.n_tensors,
            "n_parameters": self.n_parameters,
            "weights_file": self.weights_file,
            "vocab_file": self.vocab_file,
            "vocab_size": self.vocab_size,
            "notes": self.notes,
        }


# -- configuration --------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path.parent} has no {path.name}: not a Hugging Face checkpoint")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


def hf_config_to_model_config(hf: dict[str, Any], *, source: str = HF_CONFIG) -> ModelConfig:
    """Map a ``TransfoXLConfig`` (as its config.json dict) to txlm's ``ModelConfig``.

    Refuses what txlm cannot run identically: attention types other than 0 (the paper's
    relative encoding; HF itself raises NotImplementedError for them) and sampled softmax.
    """
    model_type = hf.get("model_type")
    if model_type is not None and model_type != "transfo-xl":
        raise CheckpointError(f"{source}: model_type is {model_type!r}, not 'transfo-xl'")
    attn_type = hf.get("attn_type", 0)
    if attn_type != 0:
        raise CheckpointError(
            f"{source}: attn_type={attn_type!r} is not supported; only 0 (relative, "
            "partially learnable: the paper's encoding) can be converted"
        )
    sample_softmax = hf.get("sample_softmax", -1)
    if isinstance(sample_softmax, int | float) and sample_softmax > 0:
        raise CheckpointError(
            f"{source}: sample_softmax={sample_softmax} (sampled softmax) is not supported"
        )

    def get(key: str, *aliases: str, default: Any = None) -> Any:
        for k in (key, *aliases):
            if k in hf:
                return hf[k]
        if default is None:
            raise CheckpointError(f"{source}: missing {key!r}")
        return default

    cutoffs = list(get("cutoffs", default=[]))
    tie_projs = hf.get("tie_projs")
    if tie_projs is None:  # older configs only say whether all but the head share
        share = hf.get("proj_share_all_but_first", True)
        tie_projs = [False] + [bool(share)] * len(cutoffs)
    # "tie_word_embeddings" is PretrainedConfig's name (absent when default True);
    # the original code's configs call it "tie_weight".
    tie_weight = hf.get("tie_word_embeddings", hf.get("tie_weight", True))
    tgt_len = hf.get("tgt_len")
    data: dict[str, Any] = dict(
        vocab_size=get("vocab_size", "n_token"),
        n_layer=get("n_layer", "num_hidden_layers"),
        d_model=get("d_model", "hidden_size"),
        n_head=get("n_head", "num_attention_heads"),
        d_head=get("d_head"),
        d_inner=get("d_inner"),
        d_embed=get("d_embed", default=hf.get("d_model")),
        div_val=get("div_val", default=1),
        cutoffs=cutoffs,
        tie_projs=[bool(t) for t in tie_projs],
        tie_weight=bool(tie_weight),
        pre_lnorm=bool(hf.get("pre_lnorm", False)),
        mem_len=get("mem_len", default=0),
        clamp_len=get("clamp_len", default=-1),
        same_length=bool(hf.get("same_length", False)),
        untie_r=bool(hf.get("untie_r", True)),
        dropout=float(hf.get("dropout", 0.1)),
        dropatt=float(hf.get("dropatt", 0.0)),
        layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        init_std=float(hf.get("init_std", 0.02)),
        proj_init_std=float(hf.get("proj_init_std", 0.01)),
        attn_type="xl",
    )
    # tgt_len is not a model property in HF (only the original code's configs carry it);
    # keep it when it is there, else txlm's default.
    if isinstance(tgt_len, int) and not isinstance(tgt_len, bool) and tgt_len > 0:
        data["tgt_len"] = tgt_len
    try:
        return ModelConfig.from_dict(data)
    except ConfigError as exc:
        raise CheckpointError(f"{source}: cannot be expressed as a txlm config: {exc}") from None


# -- weights --------------------------------------------------------------------------------


def _load_weight_file(path: Path) -> dict[str, Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device="cpu")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt file, pickle refused by weights_only, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read weights {path}: {first}") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a flat state dict of tensors")
    return state


def read_hf_weights(src: Path) -> tuple[dict[str, Tensor], str]:
    """All tensors of the checkpoint (shards merged) and the file name they came from."""
    for single, index in (
        (HF_SAFETENSORS, HF_SAFETENSORS + ".index.json"),
        (HF_BIN, HF_BIN + ".index.json"),
    ):
        if (src / single).is_file():
            return _load_weight_file(src / single), single
        if (src / index).is_file():
            weight_map = _read_json(src / index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{src / index} has no weight_map")
            state: dict[str, Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                state.update(_load_weight_file(src / shard))
            return state, index
    raise CheckpointError(f"{src} has neither {HF_SAFETENSORS} nor {HF_BIN}")


_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(p), r)
    for p, r in [
        (r"word_emb\.emb_layers\.(\d+)\.weight", r"embed.layers.\1.weight"),
        (r"word_emb\.emb_projs\.(\d+)", r"embed.projs.\1"),
        (r"layers\.(\d+)\.dec_attn\.qkv_net\.weight", r"layers.\1.attn.qkv.weight"),
        (r"layers\.(\d+)\.dec_attn\.r_net\.weight", r"layers.\1.attn.r_net.weight"),
        (r"layers\.(\d+)\.dec_attn\.o_net\.weight", r"layers.\1.attn.out.weight"),
        (r"layers\.(\d+)\.dec_attn\.layer_norm\.(weight|bias)", r"layers.\1.attn.norm.\2"),
        (r"layers\.(\d+)\.pos_ff\.CoreNet\.0\.(weight|bias)", r"layers.\1.ff.fc1.\2"),
        (r"layers\.(\d+)\.pos_ff\.CoreNet\.3\.(weight|bias)", r"layers.\1.ff.fc2.\2"),
        (r"layers\.(\d+)\.pos_ff\.layer_norm\.(weight|bias)", r"layers.\1.ff.norm.\2"),
        (r"crit\.out_layers\.(\d+)\.(weight|bias)", r"softmax.layers.\1.\2"),
        (r"crit\.out_projs\.(\d+)", r"softmax.projs.\1"),
        (r"crit\.cluster_(weight|bias)", r"softmax.cluster_\1"),
    ]
]
_BIAS = re.compile(r"(?:layers\.(\d+)\.dec_attn\.)?r_(w|r)_bias")
_INV_FREQ = "pos_emb.inv_freq"


def hf_name_to_txlm(name: str, *, untie_r: bool) -> str | None:
    """txlm's name for an HF tensor name; None for names with no rule."""
    if name.startswith("transformer."):
        name = name[len("transformer.") :]
    m = _BIAS.fullmatch(name)
    if m:
        which = "u" if m.group(2) == "w" else "v"  # r_w_bias: content (u), r_r_bias: position (v)
        if m.group(1) is not None and untie_r:
            return f"layers.{m.group(1)}.attn.{which}"
        return which  # shared pair (a per-layer alias of it when not untie_r)
    for pattern, repl in _RULES:
        if pattern.fullmatch(name):
            return pattern.sub(repl, name)
    return None


def _empty_model(config: ModelConfig, state: dict[str, Tensor]) -> TransformerXL:
    """A model whose every tensor is about to be overwritten.

    config.json, not the weights, decides how much this allocates: a config claiming a huge
    vocabulary or a million layers next to a small weight file must be refused before any
    allocation. So the layer count is compared with the weights first, and a model larger
    than a small one is built on the meta device (shapes only); load_hf_state_dict compares
    those shapes with the weights' and only then allocates (``to_empty``). A small model is
    built directly on the CPU: its random init costs milliseconds, while the first
    meta-device construction in a process imports torch's meta kernels (seconds).
    """
    layers = {k.split(".")[2] for k in state if k.startswith("transformer.layers.")}
    layers |= {k.split(".")[1] for k in state if k.startswith("layers.")}
    if layers and len(layers) != config.n_layer:
        raise CheckpointError(
            f"the weights hold {len(layers)} layers, config.json says n_layer={config.n_layer}"
        )
    if rough_parameter_count(config) <= BUILD_DIRECTLY_BELOW:
        return TransformerXL(config)
    with torch.device("meta"):
        return TransformerXL(config)


def _split_stacked_biases(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """With untie_r, the original TF checkpoints (and their direct exports) stack the
    per-layer biases as one [n_layer, H, Dh] ``r_w_bias`` / ``r_r_bias``; HF's PyTorch
    model keeps one [H, Dh] pair per layer. Accept the stacked form by splitting it."""
    if not config.untie_r:
        return state
    out = dict(state)
    for key in ("r_w_bias", "r_r_bias", "transformer.r_w_bias", "transformer.r_r_bias"):
        t = out.get(key)
        if t is not None and t.dim() == 3 and t.size(0) == config.n_layer:
            del out[key]
            for n in range(config.n_layer):
                layer_key = f"transformer.layers.{n}.dec_attn.{key.rsplit('.', 1)[-1]}"
                if layer_key in out:
                    raise CheckpointError(f"both stacked {key!r} and per-layer {layer_key!r}")
                out[layer_key] = t[n]
    return out


def load_hf_state_dict(state: dict[str, Tensor], config: ModelConfig) -> TransformerXL:
    """A txlm model (eval mode) holding exactly the tensors of an HF state dict."""
    model = _empty_model(config, state)
    targets = model.state_dict(keep_vars=True)  # every name, tied aliases included
    # Tied tensors are one Parameter under several names: fill each Parameter once.
    owner: dict[int, str] = {}
    aliases: dict[int, list[str]] = {}
    for name, p in targets.items():
        owner.setdefault(id(p), name)
        aliases.setdefault(id(p), []).append(name)
    sources: dict[int, list[tuple[str, Tensor]]] = {}

    for hf_name, tensor in _split_stacked_biases(state, config).items():
        base = hf_name.removeprefix("transformer.")
        if base == _INV_FREQ:
            expected = inverse_frequencies(config.d_model)
            if tensor.shape != expected.shape or not torch.allclose(
                tensor.float(), expected, rtol=1e-5, atol=0
            ):
                raise CheckpointError(
                    f"{hf_name} differs from the sinusoid frequencies txlm computes for "
                    f"d_model={config.d_model}"
                )
            continue
        name = hf_name_to_txlm(hf_name, untie_r=bool(config.untie_r))
        if name is None:
            raise CheckpointError(f"unexpected tensor {hf_name!r}: no txlm parameter for it")
        if name not in targets:
            raise CheckpointError(
                f"unexpected tensor {hf_name!r} (-> {name}): the converted config has no such "
                f"parameter (untie_r={config.untie_r}, cutoffs={config.cutoffs}, "
                f"div_val={config.div_val}, n_layer={config.n_layer})"
            )
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, txlm's {name} expects "
                f"{tuple(target.shape)} from config.json (vocab_size={config.vocab_size}, "
                f"d_model={config.d_model}, d_inner={config.d_inner}, n_head={config.n_head})"
            )
        sources.setdefault(id(target), []).append((hf_name, tensor))

    missing = [owner[k] for k in owner if k not in sources]
    if missing:
        shown = ", ".join(sorted(missing)[:4])
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} tensor(s) txlm needs: {shown}"
            + (" ..." if len(missing) > 4 else "")
        )

    if any(t.is_meta for t in targets.values()):
        # The shapes matched the weights: now allocate (what the weights hold, no more).
        model = model.to_empty(device="cpu")
        model.tie_weights()
        real = model.state_dict(keep_vars=True)
        targets = {name: real[name] for name in targets}
    with torch.no_grad():
        for key, provided in sources.items():
            first_name, first = provided[0]
            for other_name, other in provided[1:]:
                if not torch.equal(first, other):
                    raise CheckpointError(
                        f"{first_name!r} and {other_name!r} differ, but the config ties them "
                        f"(txlm {', '.join(aliases[key])})"
                    )
            targets[owner[key]].copy_(first)
    return model.eval()


# -- vocabulary -----------------------------------------------------------------------------


def read_hf_vocab(path: Path, vocab_size: int) -> tuple[str, dict[str, Any]]:
    """vocab.json text and tokenizer notes from a pickled TransfoXLTokenizer dict."""
    obj = load_pickled_object(path)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a pickled dict, found {type(obj).__name__}")
    symbols = obj.get("idx2sym")
    if symbols is None and isinstance(obj.get("sym2idx"), dict):
        by_id = sorted(obj["sym2idx"].items(), key=lambda kv: kv[1])
        symbols = [s for s, _ in by_id]
    if not isinstance(symbols, list) or not all(isinstance(s, str) for s in symbols):
        raise CheckpointError(f"{path}: no idx2sym list of strings")
    if len(symbols) != vocab_size:
        raise CheckpointError(
            f"{path}: {len(symbols)} symbols, but the model's vocab_size is {vocab_size}"
        )
    if len(set(symbols)) != len(symbols):
        raise CheckpointError(f"{path}: duplicate symbols in idx2sym")
    sym2idx = obj.get("sym2idx")
    if isinstance(sym2idx, dict) and any(
        sym2idx.get(s, i) != i for i, s in enumerate(symbols[:1000])
    ):
        raise CheckpointError(f"{path}: sym2idx disagrees with idx2sym")
    present = set(symbols)
    unk = next((s for s in ("<unk>", "<UNK>") if s in present), None)
    eos = "<eos>" if "<eos>" in present else None
    notes = {
        k: obj[k]
        for k in ("lower_case", "delimiter", "special", "min_freq", "max_size")
        if k in obj and isinstance(obj[k], str | int | float | bool | list | type(None))
    }
    return Vocab(symbols, "word", unk=unk, eos=eos).to_json(), notes


def text_options(config_data: dict[str, Any]) -> dict[str, Any]:
    """How text is normalised before a checkpoint's vocabulary encodes it: the options a
    converted tokenizer recorded (``converted_from.tokenizer`` in config.json), which a run
    fine-tuned from it carries on (``init.text``): ``lower_case``. A checkpoint trained on
    txlm's own vocabulary has none: text as it is."""
    converted = config_data.get("converted_from")
    tokenizer = converted.get("tokenizer") if isinstance(converted, dict) else None
    init = config_data.get("init")
    inherited = init.get("text") if isinstance(init, dict) else None
    lower = any(
        isinstance(options, dict) and options.get("lower_case") is True
        for options in (tokenizer, inherited)
    )
    return {"lower_case": lower}


# -- the whole conversion -------------------------------------------------------------------


def convert_hf(
    src_dir: str | Path, out_dir: str | Path, *, source: str | None = None
) -> ConversionResult:
    """Convert a Hugging Face TransfoXL checkpoint directory into a txlm checkpoint.

    ``source``: what to record as its origin (a Hub repository id; default: the folder).
    A repository by name: ``convert_hf(txlm.checkpoints.hub.local_or_hub(name), out)``.
    """
    src = Path(src_dir)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory")
    hf_config = _read_json(src / HF_CONFIG)
    config = hf_config_to_model_config(hf_config, source=str(src / HF_CONFIG))
    state, weights_file = read_hf_weights(src)
    model = load_hf_state_dict(state, config)

    notes: list[str] = []
    vocab_json = None
    vocab_file = None
    tokenizer: dict[str, Any] = {}
    for name in HF_VOCAB_FILES:
        if (src / name).is_file():
            vocab_json, tokenizer = read_hf_vocab(src / name, config.vocab_size)
            vocab_file = name
            break
    if vocab_file is None:
        notes.append("no vocab.pkl/vocab.bin: the checkpoint has no vocab.json")
    if tokenizer.get("lower_case"):
        notes.append(
            "the tokenizer lower-cased its input: txlm generate, eval --file and train --init "
            "lower-case text before encoding it (txlm.data.text.normalize_text)"
        )
    if hf_config.get("mem_len", 0) > 0:
        notes.append(
            "HF's forward starts from mem_len zero vectors when mems=None; txlm (like the "
            "original code) starts from empty memory, so first-segment outputs differ from "
            "HF's default (they match when HF is given empty mems)"
        )

    extra = {
        "converted_from": {
            "format": "hf-transfo-xl",
            "source": source or str(src.resolve()),
            "weights_file": weights_file,
            "vocab_file": vocab_file,
            "transformers_version": hf_config.get("transformers_version"),
            "tokenizer": tokenizer,
        }
    }
    out = save(model, out_dir, vocab_json=vocab_json, extra_config=extra)
    return ConversionResult(
        out_dir=out,
        config=config,
        n_tensors=len(state),
        n_parameters=model.num_parameters(),
        weights_file=weights_file,
        vocab_file=vocab_file,
        vocab_size=config.vocab_size if vocab_json is not None else None,
        notes=notes,
    )
