"""The command line as a user meets it: help, presets, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys


def txlm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "txlm", *args], capture_output=True, text=True, timeout=120
    )


def test_info_lists_every_preset_with_its_parameter_count():
    result = txlm("info", "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["preset"]: r for r in json.loads(result.stdout)["presets"]}
    assert {"debug", "shakespeare-char", "wt103-base", "enwik8-large"} <= set(rows)
    assert abs(rows["wt103-base"]["params"] - 151e6) / 151e6 < 0.03


def test_unknown_command_is_one_line_and_exit_2():
    result = txlm("frobnicate")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("txlm: error:")
    assert "Traceback" not in result.stderr
