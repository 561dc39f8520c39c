"""``txlm ablate``: the paper's Table 6 on a corpus we have, every variant trained alike."""

from __future__ import annotations

import argparse
from pathlib import Path

from txlm.analysis import ablation
from txlm.commands.analysis import common

# The ablation's own shapes, each named once (ABLATION_PRESETS also keeps an older alias).
SHAPES = ", ".join(n for n in ablation.ABLATION_PRESETS if not n.startswith("ablation-"))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ablate",
        help="train and evaluate the Table 6 model group on the default corpus",
        description="Table 6: Transformer-XL, without recurrence, Shaw et al. with recurrence "
        "and the vanilla Transformer, same shape, steps and batches; reported at the training "
        "lengths and at the best of longer evaluation lengths.",
    )
    p.add_argument(
        "--preset",
        default="small",
        help=f"model shape and budget: {SHAPES} (default small, about 30 minutes on 2 CPU "
        "cores), or a txlm train preset's shape",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per model")
    p.add_argument("--batch-size", type=int, default=None, help="training batch size")
    p.add_argument("--tgt-len", type=int, default=None, help="training segment length")
    p.add_argument(
        "--eval-lengths", type=common.ints, default=None, help="evaluation attention lengths"
    )
    p.add_argument("--eval-tokens", type=int, default=None, help="validation tokens evaluated")
    p.add_argument("--half-loss", action="store_true", help="add the half-loss variants")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    p.add_argument(
        "--save-dir", default=None, help="keep each model's run here, DIR/NAME/best (for txlm recl)"
    )
    p.add_argument("--dataset", default="shakespeare", help="prepared dataset name or folder")
    p.add_argument("--data-dir", default=None, help="default: $TXLM_DATA_DIR or ./data")
    common.add_output(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    device = common.setup(args)
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
    out = common.out_dir(args)
    if out is not None:
        figure = out / "table6_ablation.png"
        ablation.plot_ablation(result, figure)
        payload["figures"] = [str(figure)]
    common.emit(args, payload, ablation.format_table(result))
    return 0
