"""Run many ``python -m txlm ...`` invocations cheaply: a warm parent forks one child per run.

Starting Python and importing torch costs ~1.5 s of CPU per process; the bad-input table has
dozens of cases. This server imports txlm and every command module once, then for each
request forks a child that does what ``python -m txlm ARGS`` does after interpreter start-up
(``runpy.run_module("txlm", run_name="__main__")`` with ``sys.argv`` set), in its own working
directory and environment, stdout/stderr to files. An uncaught exception is printed by the
same default hook an interpreter uses, so a traceback shows exactly as it would.

The parent never runs a torch operation: forking after torch has started its intra-op thread
pool can deadlock the child, so all computation happens in the children.

Protocol (one JSON object per line): request {"argv", "cwd", "env", "stdout", "stderr",
"timeout"} -> replies {"pid"} at once (so a test can signal the child) and {"rc"} when it
ends: its exit code, or minus the signal that killed it (-9 also when it ran past timeout).

A child whose ``env`` names COUNT_OPENS_OF (a file) counts every open of that file (an
audit hook) and writes the count to the file COUNT_OUT names as it ends.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import runpy
import signal
import sys


def _child(req: dict) -> int:
    os.chdir(req["cwd"])
    os.environ.update(req["env"])
    opens = _count_opens(os.environ.get("COUNT_OPENS_OF"))
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [os.path.join(os.path.dirname(__import__("txlm").__file__), "__main__.py")]
    sys.argv += req["argv"]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the parent's timeout is not ours
    try:
        runpy.run_module("txlm", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if opens is not None:
        with open(os.environ["COUNT_OUT"], "w") as f:
            f.write(str(len(opens)))
    return code


def _count_opens(target: str | None) -> list[str] | None:
    """The opens of ``target`` from now on, as a list that grows (None: not counted)."""
    if not target:
        return None
    target = os.path.realpath(target)
    opens: list[str] = []

    def hook(event: str, args: tuple) -> None:
        path = args[0] if event == "open" else None
        if (
            isinstance(path, (str, bytes, os.PathLike))
            and os.path.realpath(os.fsdecode(path)) == target
        ):
            opens.append(target)

    sys.addaudithook(hook)
    return opens


def _wait(pid: int, timeout: float) -> int:
    """Block until the child ends; one that outlives ``timeout`` (a hung run) is killed.
    The alarm is a safety net for a stuck child, not a moment any test waits for."""

    def expire(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, math.ceil(timeout)))
    try:
        _, status = os.waitpid(pid, 0)  # retried after the handler runs (PEP 475)
    finally:
        signal.alarm(0)
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    # Warm imports only (see the module docstring).
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim imports it: ~2 s per training child)

    import txlm.cli

    txlm.cli.build_parser()  # imports every command module
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(req)
            finally:
                os._exit(code)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")  # the caller may signal the child
        sys.stdout.flush()
        rc = _wait(pid, float(req.get("timeout", 120)))
        sys.stdout.write(json.dumps({"rc": rc}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
