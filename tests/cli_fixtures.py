"""The fixtures of the bad-input tables, loaded as a plugin by each ``test_cli_bad_*.py``
(``pytest_plugins = ["cli_fixtures"]``): one copy of the assets for every command's table
(cases copy what they use into their own working directory before breaking it); the runner
is conftest.py's. Apart from ``cli_table.py`` so that pytest loads it before any test module
imports it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_table import build_assets
from reliability_helpers import Runner


@pytest.fixture(scope="session")
def assets(tmp_path_factory, runner: Runner) -> Path:
    return build_assets(tmp_path_factory.mktemp("assets"), runner)
