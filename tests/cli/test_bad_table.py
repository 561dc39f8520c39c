"""The bad-input tables as a whole: every subcommand has cases, every case names a real one,
and a few cases run again as real ``python -m txlm`` processes (the warm runner of
``helpers/cli_table.py`` must not hide anything a fresh interpreter would show)."""

from __future__ import annotations

import pytest

from tests.cli import (
    test_bad_analysis,
    test_bad_classify,
    test_bad_convert,
    test_bad_eval,
    test_bad_generate,
    test_bad_info,
    test_bad_prepare,
    test_bad_serve,
    test_bad_train,
)
from tests.helpers.cli_table import Case, run_case_subprocess

TABLES = {
    "prepare": test_bad_prepare.CASES,
    "convert": test_bad_convert.CASES,
    "train": test_bad_train.CASES,
    "eval": test_bad_eval.CASES,
    "classify": test_bad_classify.CASES,
    "generate": test_bad_generate.CASES,
    "info": test_bad_info.CASES,
    "analysis": test_bad_analysis.CASES,
    "serve": test_bad_serve.CASES,
}
ALL: list[Case] = [c for cases in TABLES.values() for c in cases]


def _commands() -> set[str]:
    from txlm.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices)


def test_the_table_covers_every_command() -> None:
    """Every subcommand has bad-input cases, and every case names a real subcommand."""
    commands = _commands()
    covered = {c.command for c in ALL if not c.id.startswith("unknown")}
    assert covered == commands, (commands - covered, covered - commands)


def test_each_file_holds_its_own_commands_cases() -> None:
    analysis = {"bench", "recl", "attention", "ablate", "frobnicate"}
    for table, cases in TABLES.items():
        for case in cases:
            want = analysis if table == "analysis" else {table}
            assert case.command in want, (table, case.id)
    ids = [c.id for c in ALL]
    assert len(ids) == len(set(ids)), "case ids must be unique"


def test_table_size() -> None:
    """At least 25 cases across the subcommands."""
    assert len(ALL) >= 25


# A few cases again as real `python -m txlm` subprocesses: the runner must not hide anything.
REAL = ["convert-evil-vocab-bin", "eval-vocab-mismatch", "generate-pickle-as-checkpoint"]


@pytest.mark.parametrize("case_id", REAL)
def test_bad_input_real_subprocess(case_id: str, assets, tmp_path) -> None:
    case = next(c for c in ALL if c.id == case_id)
    run_case_subprocess(case, assets, tmp_path)
