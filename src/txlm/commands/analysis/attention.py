"""``txlm attention CKPT``: where each head attends (paper Appendix D, Figures 5-7)."""

from __future__ import annotations

import argparse

from txlm.analysis import attention_maps as am
from txlm.checkpoints.checkpoint import Checkpoint
from txlm.commands.analysis import common


def _head(text: str) -> tuple[int, int]:
    try:
        layer, head = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER:HEAD, got {text!r}") from None
    return layer, head


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "attention",
        help="attention over relative distance per head, and terms (a), (b), (d) (Appendix D)",
        description="Where each head attends (paper Appendix D): average attention over "
        "relative distance (Figure 5), one head at one position (Figure 6: --head, "
        "--position; its most attended distances are printed), and the terms (a), (b), (d) "
        "each through its own softmax (Figure 7).",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory")
    common.add_text(p)
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the text to use")
    p.add_argument("--tgt-len", type=int, default=None, help="segment length (model's)")
    p.add_argument("--mem-len", type=int, default=None, help="memory length (model's)")
    p.add_argument(
        "--head", type=_head, default=None, help="LAYER:HEAD for Figure 6 (default: the widest)"
    )
    p.add_argument(
        "--position", type=int, default=None, help="token position for Figure 6 (default: last)"
    )
    p.add_argument("--top", type=int, default=5, help="how many widest heads to list")
    p.add_argument("--no-terms", action="store_true", help="skip Figure 7's terms")
    common.add_output(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    device = common.setup(args)
    ckpt = Checkpoint.open(args.checkpoint)
    model = ckpt.load_model(device, task="lm")
    c = model.config
    tokens = common.read_tokens(args, ckpt, args.tokens)
    maps = am.attention_maps(
        model,
        tokens,
        tgt_len=args.tgt_len or c.tgt_len,
        mem_len=args.mem_len if args.mem_len is not None else c.mem_len,
        terms=not args.no_terms,
        head=args.head,
        position=args.position,
    )
    payload = {"command": "attention", "checkpoint": args.checkpoint, **am.summary(maps, args.top)}
    out = common.out_dir(args)
    if out is not None:
        figures = [out / "fig5_heads_by_distance.png", out / "fig6_head_segment.png"]
        am.plot_heads_by_distance(maps, figures[0])
        am.plot_head_segment(maps, figures[1])
        if maps.terms:
            figures.append(out / "fig7_terms_abd.png")
            am.plot_terms(maps, figures[2])
        payload["figures"] = [str(f) for f in figures]
    common.emit(args, payload, am.format_table(maps, args.top))
    return 0
