"""``txlm train``: train a model (one process, or DDP under torchrun) and evaluate it.

txlm train [--preset P] [--config F.yaml ...] [--set key=value ...] [--out DIR]
txlm train --resume runs/x/last [--set optim.max_steps=N ...]
txlm train --init CKPT --set data.dataset=text:notes.txt ...   (fine-tune CKPT's model)
txlm train --init CKPT --task classify --set data.dataset=classes:DIR ...   (a classifier)
txlm train --out runs/x --overwrite   (replace the run that runs/x holds)
torchrun --standalone --nproc_per_node N -m txlm train ...   (N GPUs, or N CPU processes)
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from txlm import atomic
from txlm.commands.options import add_device_options, add_set_option, config_overrides
from txlm.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model (default: shakespeare-char on the bundled corpus)",
        description="Train, validate, checkpoint (out/last, out/best), then evaluate on test "
        "and print a sample. Configuration: preset -> --config YAML files -> --set overrides. "
        "Metrics go to out/metrics.jsonl and, with the tensorboard package, to "
        "out/tensorboard (tensorboard --logdir OUT/tensorboard). Several processes: "
        "torchrun --standalone --nproc_per_node N -m txlm train ... (data.batch_size is global). "
        "run.time_budget_s caps the training seconds of each invocation: a --resume gets the "
        "whole budget again.",
    )
    p.add_argument(
        "--preset", default=None, help="model + training preset (default shakespeare-char)"
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="F.yaml",
        help="YAML overrides (repeatable)",
    )
    add_set_option(p, "dotted overrides, e.g. optim.lr=1e-3 model.n_layer=2 data.batch_size=8")
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default runs/<preset>; with --init CKPT, runs/<CKPT's run>-ft)",
    )
    p.add_argument(
        "--resume", default=None, metavar="DIR", help="continue exactly from a `last` checkpoint"
    )
    p.add_argument(
        "--init",
        default=None,
        metavar="CKPT",
        help="start a new run from CKPT's model (a `txlm train` or `txlm convert` checkpoint): "
        "its configuration, weights and vocabulary (the corpus is encoded with it); fresh "
        "optimizer, schedule and counters; model.* may set only dropout, dropatt, tgt_len, "
        "mem_len, clamp_len and same_length",
    )
    p.add_argument(
        "--task", default=None, choices=["lm", "classify"],
        help="lm: a language model (default); classify: a document classifier on the --init "
        "checkpoint's body, data.dataset=classes:DIR (txlm.training.tasks.classify)",
    )  # fmt: skip
    add_device_options(p, in_config=True)
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="train into an --out that holds another run, replacing it (its checkpoints, "
        "metrics and TensorBoard events are removed before the first step)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--json", action="store_true", help="print one JSON summary object at the end")
    p.set_defaults(func=run)


# What a run writes into its --out (training/loop.py, training/metrics.py).
RUN_OUTPUTS = ("last", "best", "metrics.jsonl", "results.json", "loss.png", "tensorboard")


def used_by_another_run(out: Path, resume: Path | None) -> list[str]:
    """The outputs of a run already in ``out`` (empty when there are none, or when they are
    the run being resumed: ``--resume out/last``)."""
    if resume is not None and Path(resume).resolve().parent == out.resolve():
        return []
    # a run killed between the two renames of a checkpoint write holds only NAME.old
    return [
        name
        for name in RUN_OUTPUTS
        if (out / name).exists() or atomic.previous(out / name).exists()
    ]


def _remove_run(out: Path, names: list[str]) -> None:
    for name in names:
        for path in (out / name, atomic.previous(out / name)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()


def run(args: argparse.Namespace) -> int:
    from txlm.checkpoints import checkpoint
    from txlm.errors import CheckpointError
    from txlm.training import distributed
    from txlm.training.config import TrainConfig, resolve

    base = None
    resume = None
    init = None
    if args.init and args.resume:
        raise ConfigError(
            "--init starts a new run from a checkpoint, --resume continues a run: pass one"
        )
    if args.init:
        from txlm.training.init import open_init

        init = open_init(args.init)
    if args.resume:
        resume = checkpoint.resolve(args.resume)
        saved = checkpoint.read_config(resume)
        if "train" not in saved:
            raise CheckpointError(f"{resume} holds no training configuration: cannot resume it")
        base = TrainConfig.from_dict(saved["train"])
        if args.preset:
            raise CheckpointError("--resume takes the checkpoint's configuration; drop --preset")
    config = resolve(
        args.preset, args.config, [*args.sets, *config_overrides(args)], base=base, init=init
    )
    if args.task is not None and args.task != config.task:
        if resume is not None:
            raise ConfigError(f"--resume continues a task={config.task} run; drop --task")
        config.task = args.task
    if args.print_config:
        print(config.to_yaml(), end="")
        return 0
    out = args.out or config.run.out_dir
    if out is None:
        if args.resume:
            out = str(Path(args.resume).parent)
        elif init is not None:  # not the run it starts from (runs/NAME/best -> runs/NAME-ft)
            run = init.path.parent if init.path.name in ("best", "last") else init.path
            out = f"runs/{run.resolve().name}-ft"
        else:
            out = f"runs/{config.preset}"
    config.run.out_dir = out
    held = used_by_another_run(Path(out), resume)
    if held and not args.overwrite:
        raise ConfigError(
            f"{out} already holds a training run ({', '.join(held)}): continue it with --resume "
            f"{Path(out) / 'last'}, replace it with --overwrite, or choose another --out"
        )

    from txlm.training import Trainer

    trainer = Trainer(config, out, resume=resume, echo=not args.json)
    if held and trainer.dist.is_main:
        # Every check has passed (config, corpus, memory): only now is the old run removed,
        # so that a refused command leaves it as it was.
        _remove_run(Path(out), held)
        if not args.json:
            print(f"txlm train: --overwrite: removed the run in {out} ({', '.join(held)})")
    summary = trainer.fit()
    if args.json and trainer.dist.is_main:
        print(json.dumps(summary))
    code = int(summary.get("exit_code", 0))
    if trainer.dist.enabled:  # everything is written and the group left
        distributed.exit_rank(code)
    return code
