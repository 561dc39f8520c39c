"""The fixtures of the command-line tests (the bad-input tables among them): one copy of the
assets for every command's table (cases copy what they use into their own working directory
before breaking it); the runner is tests/conftest.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli_table import build_assets
from tests.helpers.reliability import Runner


@pytest.fixture(scope="session")
def assets(tmp_path_factory, runner: Runner) -> Path:
    return build_assets(tmp_path_factory.mktemp("assets"), runner)
