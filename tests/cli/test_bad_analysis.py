"""Bad input to the analysis commands (`bench`, `recl`, `attention`, `ablate`) and to an
unknown command.

Contract C24 (ARCHITECTURE.md): one ``txlm: error:`` line, exit 2, nothing on disk changed.
The runner and the assets are shared by every command's table: ``helpers/cli_table.py``.
"""

from __future__ import annotations

import pytest

from tests.helpers.cli_table import (
    Case,
    run_case,
)

CASES: list[Case] = [
    Case("bench-zero-length", ["bench", "eval-speed", "--lengths", "0"], "--lengths"),
    Case("recl-missing-checkpoints", ["recl", "nope-a", "nope-b"], "nope-a"),
    Case("attention-missing-checkpoint", ["attention", "nope"], "nope"),
    Case("ablate-unknown-preset", ["ablate", "--preset", "huge"], "huge"),
    Case("bench-zero-threads", ["bench", "eval-speed", "--threads", "0"], "--threads"),
    Case("unknown-command", ["frobnicate"], "frobnicate"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, assets, runner, tmp_path) -> None:
    run_case(case, assets, runner, tmp_path)
