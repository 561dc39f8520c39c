"""The paper's analysis tools on the command line.

    txlm bench eval-speed   Table 9: per-token evaluation time, Transformer-XL vs vanilla
    txlm bench memory       does the memory work? Table 6's variants on the recall task,
                            copy accuracy against distance at 1x, 2x, 4x training memory
    txlm recl               Appendix C: relative effective context length of a model group
    txlm attention          Appendix D: attention over relative distance, per head and term
    txlm ablate             Table 6 on data we have: encodings x recurrence, equal budget

Each prints a table, or one JSON object with ``--json``, and writes PNG figures to
``--out-dir`` (default: no figures).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from txlm.commands.options import add_device_options, add_set_option
from txlm.devices import resolve_device
from txlm.errors import CheckpointError, ConfigError, DataError


# -- shared helpers ----------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _contexts(text: str) -> list[int]:
    """START:STOP:STEP (inclusive stop) or a comma list, evenly spaced."""
    if ":" in text:
        try:
            start, stop, step = (int(x) for x in text.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected START:STOP:STEP, got {text!r}") from None
        if start < 1 or step < 1 or stop < start:
            raise argparse.ArgumentTypeError(f"need 1 <= START <= STOP and STEP >= 1: {text!r}")
        return list(range(start, stop + 1, step))
    return _ints(text)


def _head(text: str) -> tuple[int, int]:
    try:
        layer, head = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER:HEAD, got {text!r}") from None
    return layer, head


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out-dir", default=None, help="write the PNG figures (and result.json) here")
    add_device_options(p)


def _add_text(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", default=None, help="a UTF-8 text file, encoded with the vocabulary")
    p.add_argument(
        "--dataset",
        default="shakespeare",
        help="prepared dataset name or folder (default shakespeare; see txlm prepare)",
    )
    p.add_argument("--data-dir", default=None, help="default: $TXLM_DATA_DIR or ./data")
    p.add_argument("--split", default="valid", help="split of the prepared dataset (valid)")


def _setup(args: argparse.Namespace):
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return resolve_device(args.device)


def _load_checkpoint(path: str, device):
    from txlm.checkpoint import load

    return load(path, device=device)


def _checkpoint_vocab(path: str):
    from txlm.checkpoint import VOCAB_FILE, resolve
    from txlm.data import Vocab

    file = resolve(path) / VOCAB_FILE
    if not file.is_file():
        return None
    return Vocab.load(file)


def _read_tokens(args: argparse.Namespace, checkpoint: str, max_tokens: int):
    """Token ids [T] of the text to analyse, in the checkpoint's vocabulary."""
    import numpy as np

    from txlm.data import load_prepared, prepare_dataset
    from txlm.data.prepare import default_data_dir

    vocab = _checkpoint_vocab(checkpoint)
    if args.text:
        if vocab is None:
            raise CheckpointError(
                f"{checkpoint} has no vocab.json: use --dataset instead of --text"
            )
        path = Path(args.text)
        if not path.is_file():
            raise DataError(f"text file {path} does not exist")
        ids = vocab.encode_array(path.read_text(encoding="utf-8"))
    else:
        folder = Path(args.dataset)
        if not (folder / "meta.json").is_file():
            data_dir = args.data_dir or default_data_dir()
            folder = prepare_dataset(args.dataset, data_dir, progress=False)
        corpus = load_prepared(folder)
        if vocab is not None and vocab.fingerprint != corpus.vocab.fingerprint:
            raise DataError(
                f"{checkpoint}'s vocabulary ({vocab.fingerprint}) is not the one of {folder} "
                f"({corpus.vocab.fingerprint})"
            )
        ids = corpus.split(args.split)
    return np.asarray(ids[:max_tokens], dtype=np.int64)


def _emit(args: argparse.Namespace, payload: dict, table: str) -> None:
    if args.out_dir:
        from txlm.checkpoint import write_json

        write_json(Path(args.out_dir) / "result.json", payload)
    if args.json:
        print(json.dumps(payload))
    else:
        print(table)
        if payload.get("figures"):
            print("figures: " + ", ".join(payload["figures"]))


def _out_dir(args: argparse.Namespace) -> Path | None:
    if not args.out_dir:
        return None
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _log(args: argparse.Namespace):
    if args.json:
        return None
    return lambda msg: print(msg, file=sys.stderr, flush=True)


# -- bench eval-speed ------------------------------------------------------------------------
def _run_speed(args: argparse.Namespace) -> int:
    import torch

    from txlm.analysis.speed import format_table, measure_eval_speed, plot_speed
    from txlm.config import ModelConfig
    from txlm.model import TransformerXL

    device = _setup(args)
    if args.checkpoint:
        model = _load_checkpoint(args.checkpoint, device)
        source = args.checkpoint
    else:
        torch.manual_seed(0)
        config = ModelConfig.from_preset(args.preset, dropout=0.0, dropatt=0.0)
        model = TransformerXL(config).to(device).eval()
        source = f"preset {args.preset} (random weights: timing does not depend on them)"
    result = measure_eval_speed(
        model,
        args.lengths,
        tgt_len=args.tgt_len,
        xl_tokens=args.xl_tokens,
        vanilla_positions=args.vanilla_positions,
        vanilla=args.vanilla,
        repeats=args.repeats,
        progress=_log(args),
    )
    payload = {"command": "bench eval-speed", "source": source, **result.to_dict()}
    out = _out_dir(args)
    if out is not None:
        plot_speed(result, out / "table9_eval_speed.png")
        payload["figures"] = [str(out / "table9_eval_speed.png")]
    _emit(args, payload, f"{source}\n" + format_table(result))
    return 0


# -- attention --------------------------------------------------------------------------------
def _run_attention(args: argparse.Namespace) -> int:
    from txlm.analysis import attention_maps as am

    device = _setup(args)
    model = _load_checkpoint(args.checkpoint, device)
    c = model.config
    tgt_len = args.tgt_len or c.tgt_len
    mem_len = args.mem_len if args.mem_len is not None else c.mem_len
    tokens = _read_tokens(args, args.checkpoint, args.tokens)
    if args.position is not None and not 0 <= args.position < len(tokens):
        raise ConfigError(f"--position {args.position} is outside the {len(tokens)} tokens")
    maps = am.attention_maps(
        model,
        tokens,
        tgt_len=tgt_len,
        mem_len=mem_len,
        terms=not args.no_terms,
        head=args.head,
        position=args.position,
    )
    payload = {"command": "attention", "checkpoint": args.checkpoint, **am.summary(maps, args.top)}
    out = _out_dir(args)
    if out is not None:
        figures = [out / "fig5_heads_by_distance.png", out / "fig6_head_segment.png"]
        am.plot_heads_by_distance(maps, figures[0])
        am.plot_head_segment(maps, figures[1])
        if maps.terms:
            figures.append(out / "fig7_terms_abd.png")
            am.plot_terms(maps, figures[2])
        payload["figures"] = [str(f) for f in figures]
    _emit(args, payload, am.format_table(maps, args.top))
    return 0


# -- recl -------------------------------------------------------------------------------------
def _run_recl(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from txlm.analysis import recl

    device = _setup(args)
    names = args.names.split(",") if args.names else [_run_name(p) for p in args.checkpoints]
    if len(names) != len(args.checkpoints):
        raise ConfigError(f"{len(names)} --names for {len(args.checkpoints)} checkpoints")
    if len(set(names)) != len(names):
        raise ConfigError(f"model names must differ, got {names} (use --names)")
    contexts = args.contexts
    if len(contexts) < 2:
        raise ConfigError("RECL needs at least two context lengths")
    steps = {b - a for a, b in itertools.pairwise(contexts)}
    if len(steps) != 1:
        raise ConfigError(f"context lengths must be evenly spaced (one step Delta), got {contexts}")
    tokens = _read_tokens(args, args.checkpoints[0], max(contexts) + args.targets * args.spacing)
    for other in args.checkpoints[1:]:  # every model must read the same text
        vocab0, vocab = _checkpoint_vocab(args.checkpoints[0]), _checkpoint_vocab(other)
        if vocab0 is not None and vocab is not None and vocab0.fingerprint != vocab.fingerprint:
            raise CheckpointError(f"{other} has another vocabulary than {args.checkpoints[0]}")
    targets = recl.target_positions(len(tokens), max(contexts), args.targets)
    work = len(args.checkpoints) * len(targets) * sum(contexts)
    losses = []
    with tqdm(
        total=work, unit="tok", unit_scale=True, disable=args.json, desc="per-token losses"
    ) as bar:
        for path in args.checkpoints:
            model = _load_checkpoint(path, device)
            losses.append(
                recl.token_losses(
                    model, tokens, contexts, targets, batch_size=args.batch_size,
                    progress=bar.update,
                )
            )  # fmt: skip
    import numpy as np

    result = recl.compute_recl(
        np.stack(losses),
        contexts,
        names,
        ratios=args.ratios,
        threshold=args.threshold,
        method=(
            "each target scored from exactly c preceding tokens: one window per target, "
            "no memory, last position scored"
        ),
    )
    payload = {"command": "recl", "checkpoints": args.checkpoints, **result.to_dict()}
    out = _out_dir(args)
    if out is not None:
        figures = [out / "fig3_relative_gain.png", out / "fig4_perplexity.png"]
        recl.plot_gains(result, figures[0])
        recl.plot_perplexity(result, figures[1])
        payload["figures"] = [str(f) for f in figures]
    _emit(args, payload, recl.format_table(result))
    return 0


def _run_name(path: str) -> str:
    """A model's name from its checkpoint path: RUN for RUN/best or RUN/last."""
    p = Path(path)
    return p.parent.name if p.name in ("best", "last") and p.parent.name else p.name


# -- ablate -----------------------------------------------------------------------------------
def _run_ablate(args: argparse.Namespace) -> int:
    from txlm.analysis import ablation

    device = _setup(args)
    result = ablation.run_ablation(
        ablation.AblationSettings(
            preset=args.preset,
            steps=args.steps,
            batch_size=args.batch_size,
            tgt_len=args.tgt_len,
            eval_lengths=args.eval_lengths,
            eval_tokens=args.eval_tokens,
            half_loss=args.half_loss,
            seed=args.seed,
            lr=args.lr,
        ),
        data=args.dataset,
        data_dir=args.data_dir,
        device=device,
        progress=not args.json,
        save_dir=args.save_dir,
    )
    payload = {"command": "ablate", **result.to_dict()}
    if args.save_dir:
        payload["checkpoints"] = [str(Path(args.save_dir) / r.name / "best") for r in result.rows]
    out = _out_dir(args)
    if out is not None:
        figure = out / "table6_ablation.png"
        ablation.plot_ablation(result, figure)
        payload["figures"] = [str(figure)]
    _emit(args, payload, ablation.format_table(result))
    return 0


# -- bench memory -----------------------------------------------------------------------------
def _run_memory(args: argparse.Namespace) -> int:
    import tempfile

    from txlm.analysis import memory

    device = _setup(args)
    settings = memory.MemoryBenchSettings(
        dataset=args.dataset or memory.BENCH_TASK,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        tgt_len=args.tgt_len,
        mem_len=args.mem_len,
        eval_multiples=tuple(args.eval_multiples),
        eval_tokens=args.eval_tokens,
        eval_tgt_len=args.eval_tgt_len,
        clamp=args.clamp,
        seed=args.seed,
        only=tuple(args.variants.split(",")) if args.variants else (),
        sets=tuple(args.sets),
    )
    out = _out_dir(args)
    with tempfile.TemporaryDirectory(prefix="txlm-memory-") as scratch:
        runs = Path(args.runs_dir) if args.runs_dir else Path(scratch)
        result = memory.run_memory_bench(
            settings, runs, data_dir=args.data_dir, device=str(device), log=_log(args)
        )
    payload = {"command": "bench memory", **result.to_dict()}
    if not args.runs_dir:  # the checkpoints lived in a temporary folder
        for v in payload["variants"]:
            v["checkpoint"] = None
    if out is not None:
        figure = out / "memory_accuracy_by_distance.png"
        memory.plot_memory(result, figure)
        payload["figures"] = [str(figure)]
    _emit(args, payload, memory.format_table(result))
    return 0


# -- registration -----------------------------------------------------------------------------
def _register_memory(bench_sub: argparse._SubParsersAction) -> None:
    mem = bench_sub.add_parser(
        "memory",
        help="does the memory work? Table 6's variants on the recall task",
        description="Train the Table 6 variants (XL, Shaw + memory, XL without memory, "
        "absolute positions with and without memory) on the recall copy task with txlm "
        "train's trainer (preset recall), then measure copy accuracy and loss against the "
        "distance back to the copied span, with 1x, 2x and 4x each model's training memory.",
    )
    mem.add_argument(
        "--dataset",
        default=None,
        help="recall dataset: recall or recall:key=value,... (see txlm prepare --help); "
        "default: the associative form (txlm.analysis.memory.BENCH_TASK)",
    )
    mem.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    mem.add_argument("--steps", type=int, default=None, help="training steps per model (preset)")
    mem.add_argument("--batch-size", type=int, default=None, help="training batch size")
    mem.add_argument("--lr", type=float, default=None, help="peak learning rate")
    mem.add_argument("--tgt-len", type=int, default=None, help="training segment length")
    mem.add_argument("--mem-len", type=int, default=None, help="training memory length")
    mem.add_argument(
        "--eval-multiples",
        type=_ints,
        default=[1, 2, 4],
        help="evaluation memories as multiples of the training memory (1,2,4)",
    )
    mem.add_argument("--eval-tokens", type=int, default=None, help="valid tokens scored (all)")
    mem.add_argument(
        "--eval-tgt-len",
        type=int,
        default=8,
        help="segment length when evaluating models with memory (8: query i of a segment "
        "sees m + i back, so 'in view' is nearly d <= m)",
    )
    mem.add_argument(
        "--clamp",
        choices=("none", "train", "both"),
        default="both",
        help="relative-sinusoid models: distances unclamped, clamped to the training reach "
        "M + L, or both (default)",
    )
    mem.add_argument("--seed", type=int, default=0)
    add_set_option(mem, "txlm train overrides for every variant, e.g. model.d_model=128")
    mem.add_argument(
        "--runs-dir", default=None, help="keep each variant's training run here (default: none)"
    )
    mem.add_argument("--data-dir", default=None, help="default: $TXLM_DATA_DIR or ./data")
    _add_output(mem)
    mem.set_defaults(func=_run_memory)


def register(subparsers: argparse._SubParsersAction) -> None:
    bench_top = subparsers.add_parser(
        "bench",
        help="benchmarks: evaluation speed (paper Table 9), does the memory work",
        description="Benchmarks. eval-speed: the paper's Table 9. memory: copy accuracy "
        "against distance on the recall task.",
    )
    bench_sub = bench_top.add_subparsers(dest="what", metavar="WHAT", parser_class=type(bench_top))
    bench_sub.required = True
    bench = bench_sub.add_parser(
        "eval-speed",
        help="evaluation speed, Transformer-XL vs vanilla Transformer (paper Table 9)",
        description="Table 9: per-token evaluation time of Transformer-XL with memory against "
        "a vanilla Transformer evaluated the Al-Rfou way.",
    )
    _register_memory(bench_sub)
    source = bench.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", default=None, help="a checkpoint directory")
    source.add_argument(
        "--preset", default="shakespeare-char", help="a preset shape (default shakespeare-char)"
    )
    bench.add_argument(
        "--lengths",
        type=_ints,
        default=[100, 200, 400],
        help="attention lengths (default 100,200,400 for a CPU; the paper: 800,1800,2800,3800)",
    )
    bench.add_argument("--tgt-len", type=int, default=128, help="XL evaluation segment length")
    bench.add_argument("--xl-tokens", type=int, default=512, help="XL tokens timed per length")
    bench.add_argument(
        "--vanilla-positions", type=int, default=8, help="vanilla positions timed per length"
    )
    bench.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    bench.add_argument(
        "--vanilla",
        choices=["alrfou", "same"],
        default="alrfou",
        help="vanilla model: same-shape Al-Rfou model (default) or this model without memory",
    )
    _add_output(bench)
    bench.set_defaults(func=_run_speed)

    att = subparsers.add_parser(
        "attention",
        help="attention over relative distance per head, and terms (a), (b), (d) (Appendix D)",
        description="Where each head attends (paper Appendix D): average attention over "
        "relative distance (Figure 5), one head at one position (Figure 6), and the terms "
        "(a), (b), (d) each through its own softmax (Figure 7).",
    )
    att.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory")
    _add_text(att)
    att.add_argument("--tokens", type=int, default=4096, help="tokens of the text to use")
    att.add_argument("--tgt-len", type=int, default=None, help="segment length (model's)")
    att.add_argument("--mem-len", type=int, default=None, help="memory length (model's)")
    att.add_argument("--head", type=_head, default=None, help="LAYER:HEAD for Figure 6")
    att.add_argument("--position", type=int, default=None, help="token position for Figure 6")
    att.add_argument("--top", type=int, default=5, help="how many widest heads to list")
    att.add_argument("--no-terms", action="store_true", help="skip Figure 7's terms")
    _add_output(att)
    att.set_defaults(func=_run_attention)

    rc = subparsers.add_parser(
        "recl",
        help="relative effective context length of a model group (Appendix C)",
        description="Relative effective context length (paper Appendix C): each target is "
        "scored from exactly c preceding tokens for every context length c, and RECL is the "
        "longest context that still gains over the group's best shorter one.",
    )
    rc.add_argument(
        "checkpoints", metavar="CKPT", nargs="+", help="the model group's checkpoint directories"
    )
    rc.add_argument("--names", default=None, help="comma-separated model names")
    _add_text(rc)
    rc.add_argument(
        "--contexts",
        type=_contexts,
        default=list(range(16, 129, 16)),
        help="context lengths: START:STOP:STEP (inclusive) or a list (default 16:128:16)",
    )
    rc.add_argument("--targets", type=int, default=256, help="target tokens scored")
    rc.add_argument("--spacing", type=int, default=8, help="tokens of text per target")
    rc.add_argument("--ratios", type=_floats, default=[0.1, 0.5, 1.0], help="r values")
    rc.add_argument("--threshold", type=float, default=0.01, help="gain threshold (0.01)")
    rc.add_argument("--batch-size", type=int, default=32, help="windows per forward")
    _add_output(rc)
    rc.set_defaults(func=_run_recl)

    ab = subparsers.add_parser(
        "ablate",
        help="train and evaluate the Table 6 model group on the default corpus",
        description="Table 6: Transformer-XL, without recurrence, Shaw et al. with recurrence "
        "and the vanilla Transformer, same shape, steps and batches; reported at the training "
        "lengths and at the best of longer evaluation lengths.",
    )
    ab.add_argument("--preset", default="ablation-small", help="model shape (ablation-small)")
    ab.add_argument("--steps", type=int, default=None, help="training steps per model")
    ab.add_argument("--batch-size", type=int, default=None, help="training batch size")
    ab.add_argument("--tgt-len", type=int, default=None, help="training segment length")
    ab.add_argument("--eval-lengths", type=_ints, default=None, help="evaluation attention lengths")
    ab.add_argument("--eval-tokens", type=int, default=None, help="validation tokens evaluated")
    ab.add_argument("--half-loss", action="store_true", help="add the half-loss variants")
    ab.add_argument("--lr", type=float, default=None, help="peak learning rate")
    ab.add_argument("--seed", type=int, default=0, help="default 0")
    ab.add_argument(
        "--save-dir", default=None, help="keep each model's run here, DIR/NAME/best (for txlm recl)"
    )
    ab.add_argument("--dataset", default="shakespeare", help="prepared dataset name or folder")
    ab.add_argument("--data-dir", default=None, help="default: $TXLM_DATA_DIR or ./data")
    _add_output(ab)
    ab.set_defaults(func=_run_ablate)
