"""``txlm recl CKPT...``: relative effective context length of a model group (Appendix C)."""

from __future__ import annotations

import argparse
import sys

import numpy as np
from tqdm import tqdm

from txlm.analysis import recl
from txlm.checkpoints.checkpoint import Checkpoint
from txlm.commands.analysis import common


def _contexts(text: str) -> list[int]:
    """START:STOP:STEP (inclusive stop) or a comma list."""
    if ":" in text:
        try:
            start, stop, step = (int(x) for x in text.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected START:STOP:STEP, got {text!r}") from None
        if start < 1 or step < 1 or stop < start:
            raise argparse.ArgumentTypeError(f"need 1 <= START <= STOP and STEP >= 1: {text!r}")
        return list(range(start, stop + 1, step))
    return common.ints(text)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "recl",
        help="relative effective context length of a model group (Appendix C)",
        description="Relative effective context length (paper Appendix C): each target is "
        "scored from exactly c preceding tokens for every context length c, and RECL is the "
        "longest context that still gains over the group's best shorter one.",
    )
    p.add_argument(
        "checkpoints", metavar="CKPT", nargs="+", help="the model group's checkpoint directories"
    )
    p.add_argument("--names", default=None, help="comma-separated model names")
    common.add_text(p)
    p.add_argument(
        "--contexts",
        type=_contexts,
        default=list(range(16, 129, 16)),
        help="context lengths: START:STOP:STEP (inclusive) or a list (default 16:128:16)",
    )
    p.add_argument("--targets", type=int, default=256, help="target tokens scored")
    p.add_argument("--spacing", type=int, default=8, help="tokens of text per target")
    p.add_argument("--ratios", type=common.floats, default=[0.1, 0.5, 1.0], help="r values")
    p.add_argument("--threshold", type=float, default=0.01, help="gain threshold (0.01)")
    p.add_argument("--batch-size", type=int, default=32, help="windows per forward")
    common.add_output(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    device = common.setup(args)
    names = recl.group_names(args.checkpoints, args.names.split(",") if args.names else None)
    recl.check_contexts(args.contexts)
    checkpoints = [Checkpoint.open(path) for path in args.checkpoints]
    recl.check_same_vocabulary(checkpoints)  # every model must read the same text
    contexts = args.contexts
    tokens = common.read_tokens(args, checkpoints[0], max(contexts) + args.targets * args.spacing)
    targets = recl.target_positions(len(tokens), max(contexts), args.targets)
    note = common.log(args)
    # A bar on a terminal; in a log file carriage returns would pile up, so one plain line
    # per model there instead.
    bar = tqdm(
        total=len(args.checkpoints) * len(targets) * sum(contexts),
        unit="tok",
        unit_scale=True,
        disable=note is None or not sys.stderr.isatty(),
        desc="per-token losses",
    )
    losses = []
    with bar:
        for i, ckpt in enumerate(checkpoints):
            model = ckpt.load_model(device, task="lm")
            losses.append(
                recl.token_losses(
                    model, tokens, contexts, targets, batch_size=args.batch_size,
                    progress=bar.update,
                )
            )  # fmt: skip
            if note is not None and bar.disable:
                note(f"per-token losses: {names[i]} done ({i + 1}/{len(args.checkpoints)})")
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
    out = common.out_dir(args)
    if out is not None:
        figures = [out / "fig3_relative_gain.png", out / "fig4_perplexity.png"]
        recl.plot_gains(result, figures[0])
        recl.plot_perplexity(result, figures[1])
        payload["figures"] = [str(f) for f in figures]
    common.emit(args, payload, recl.format_table(result))
    return 0
