"""Options that several commands share, declared once so they read the same everywhere."""

from __future__ import annotations

import argparse

from txlm.devices import DEVICE_HELP


def add_device_options(p: argparse.ArgumentParser, *, precision: bool = False) -> None:
    """``--device``, ``--threads`` and, for commands that run a model in mixed precision,
    ``--precision``."""
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    if precision:
        p.add_argument(
            "--precision",
            default="fp32",
            choices=["fp32", "bf16", "fp16"],
            help="autocast for the matmuls (fp16: GPU only); default fp32",
        )
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads")


def add_set_option(p: argparse.ArgumentParser, help: str) -> None:
    """``--set KEY=VALUE ...``: dotted training-config overrides, collected in ``args.sets``."""
    p.add_argument(
        "--set",
        dest="sets",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help=help,
    )
