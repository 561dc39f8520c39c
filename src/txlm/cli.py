"""The ``txlm`` command line.

Each subcommand lives in its own module and exposes ``register(subparsers)``, which adds its
parser and sets ``func`` to a callable taking the parsed namespace and returning an exit code.
This file only wires them together and turns user errors into one line on stderr + exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import select
import sys

import torch

from txlm.errors import TxlmError

# Subcommand modules, in the order ``txlm --help`` lists them.
COMMANDS = [
    "txlm.commands.prepare",
    "txlm.commands.train",
    "txlm.commands.eval",
    "txlm.commands.classify",
    "txlm.commands.generate",
    "txlm.commands.serve",
    "txlm.commands.convert",
    "txlm.commands.analysis",
    "txlm.commands.info",
]


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage already; make its message a single line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"txlm: error: {message}\n")
        raise SystemExit(2)


@contextlib.contextmanager
def _notes():
    """The library's notes (its ``txlm`` loggers' INFO records: a package being made, which
    takes a while) as this command's own lines on stderr, for the command's run only."""
    log = logging.getLogger("txlm")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("txlm: note: %(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="txlm", description="Transformer-XL language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()  # a command's --threads is its own, not its caller's
    try:
        with _notes():
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except TxlmError as exc:
        sys.stderr.write(f"txlm: error: {exc}\n")
        return 2
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            # The reader of our output is gone (``txlm info | head -1``): end quietly, as
            # tools that SIGPIPE ends do (Python ignores the signal: the write got EPIPE).
            _silence_stdout()
            return 128 + 13  # 141, the shell's status of a command that SIGPIPE ended
        # The system refused a read or write the user asked for: --out or --data-dir under a
        # file, a read-only or full disk, a missing directory. That is bad input/environment,
        # not a bug: one line naming the path, exit 2 (writes are atomic, so nothing already
        # on disk was damaged). Errors inside txlm's own logic still raise TxlmError.
        where = f": {exc.filename}" if exc.filename else ""
        reason = exc.strerror or str(exc) or type(exc).__name__
        sys.stderr.write(f"txlm: error: {reason}{where}\n")
        return 2
    except (MemoryError, RuntimeError) as exc:
        # Memory that ran out although the checks before allocation passed (they are lower
        # bounds: txlm.resources). Files are written atomically and a training run's
        # checkpoints only ever replaced whole, so what is on disk is still the last good
        # state; the message says so in one line. Any other RuntimeError is a bug.
        from txlm.resources import out_of_memory_message

        message = out_of_memory_message(exc)
        if message is None:
            raise
        sys.stderr.write(f"txlm: error: {message}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("txlm: interrupted\n")
        return 130
    finally:
        torch.set_num_threads(threads)


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader closed it (poll reports an error on
    such a write end; a terminal or a file never does)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(event & select.POLLERR for _, event in poller.poll(0))


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that flushing what is still buffered at exit
    does not fail a second time and print ``Exception ignored ... BrokenPipeError``."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


if __name__ == "__main__":
    raise SystemExit(main())
