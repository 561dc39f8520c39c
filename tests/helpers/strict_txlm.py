"""``python tests/helpers/strict_txlm.py ARGS`` (also as torchrun's script): ``python -m txlm
ARGS`` with every warning attributed to txlm's own code an error. A deprecated argument
txlm passes to torch (torch warns with ``stacklevel=2``, i.e. at txlm's call) then fails the
run with a traceback instead of printing a line on every rank."""

import runpy
import sys
import warnings

warnings.filterwarnings("error", module=r"txlm(\.|$)")
sys.argv = ["txlm", *sys.argv[1:]]
runpy.run_module("txlm", run_name="__main__", alter_sys=True)
