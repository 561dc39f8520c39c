"""``python tests/helpers/script_help.py SCRIPT...``: each script's ``--help`` text, all of them
run in this one interpreter (``runpy``, as ``python SCRIPT --help`` runs it), printed as one
JSON object {script: {"rc": exit code, "out": stdout, "err": the error, if any}}. What the
docs' check asks of the benchmarks: one start-up of torch for all of a page's scripts."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path


def help_of(script: str) -> dict:
    out = io.StringIO()
    path = Path(script).resolve()
    argv, sys_path = sys.argv, list(sys.path)
    sys.argv, sys.path[0] = [str(path), "--help"], str(path.parent)
    rc, err = 0, ""
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:  # reported, not raised: the other scripts still run
        rc, err = 1, traceback.format_exc()
    finally:
        sys.argv, sys.path[:] = argv, sys_path
    return {"rc": rc, "out": out.getvalue(), "err": err}


if __name__ == "__main__":
    print(json.dumps({script: help_of(script) for script in sys.argv[1:]}))
