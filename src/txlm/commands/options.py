"""Options that several commands share, declared once so they read the same everywhere."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from txlm.devices import DEVICE_HELP, check_precision, precision_note

if TYPE_CHECKING:
    import torch

# ``--compile auto|on|off|package`` (generate, serve) as a Decoder's ``compile``
# (txlm.inference.compiled, txlm.inference.packaged)
COMPILE: dict[str, bool | str] = {"on": True, "off": False, "auto": "auto", "package": "package"}


def add_device_options(
    p: argparse.ArgumentParser, *, precision: bool = False, in_config: bool = False
) -> None:
    """``--device``, ``--threads`` and, for commands that run a model in mixed precision,
    ``--precision``.

    ``in_config``: the command's configuration already holds these settings (``txlm train``:
    ``run.device``, ``run.threads``), so an option left out must not override what a preset,
    a YAML file or a resumed checkpoint says; ``config_overrides`` turns the given ones into
    ``--set`` items.
    """
    if in_config:
        p.add_argument(
            "--device",
            default=None,
            help="auto | cpu | cuda[:N]: sets run.device (default: as configured, auto in "
            "every preset)",
        )
    else:
        p.add_argument("--device", default="auto", help=DEVICE_HELP)
    if precision:
        p.add_argument(
            "--precision",
            default="fp32",
            choices=["fp32", "bf16", "fp16", "int8"],
            help="bf16 | fp16: autocast for the matmuls (fp16: GPU only; a bf16 decoder holds "
            "its layers' weights in bf16); int8: the layers' weights quantised to int8 "
            "(weight-only, per row), read through the K/V cache, and a decoder's (generate, "
            "serve) output head too; default fp32",
        )
    threads_help = "torch CPU threads" + ("; sets run.threads" if in_config else "")
    p.add_argument("--threads", type=int, default=None, metavar="N", help=threads_help)


def use_precision(precision: str, device: torch.device) -> None:
    """Refuse a precision ``device`` cannot run (exit 2), and say where it runs slower than
    fp32 (a line on stderr)."""
    check_precision(precision, device)
    note = precision_note(precision, device)
    if note is not None:
        print(f"txlm: {note}", file=sys.stderr)


def apply_threads(args: argparse.Namespace) -> None:
    """Set torch's CPU threads from ``--threads`` (left as they are without it); ``cli.main``
    gives the caller its own count back when the command returns."""
    if args.threads is None:
        return
    if args.threads < 1:
        from txlm.errors import ConfigError

        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    import torch

    torch.set_num_threads(args.threads)


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` items of the device options given on a command added ``in_config``;
    they go after the user's own ``--set`` items, so the named option wins."""
    items = []
    if args.device is not None:
        items.append(f"run.device={args.device}")
    if args.threads is not None:
        items.append(f"run.threads={args.threads}")
    return items


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
