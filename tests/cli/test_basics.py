"""The command line as a user meets it: help, presets, and one-line errors."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess

import pytest
import torch

from tests.helpers.train import REPO
from tests.helpers.train import txlm as forked_txlm
from txlm.cli import build_parser, main
from txlm.commands import info
from txlm.devices import resolve_device
from txlm.errors import ConfigError
from txlm.training.config import TrainConfig


def txlm(*args: str) -> subprocess.CompletedProcess:
    return forked_txlm(list(args), REPO / "data", timeout=120)


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


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every command by name; a command with its own subcommands (``bench``) appears as each
    of them, ``bench eval-speed``, ``bench memory``, and under its own name as the first."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out: dict[str, argparse.ArgumentParser] = {}
    for name, p in sub.choices.items():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not nested:
            out[name] = p
            continue
        for i, (child, q) in enumerate(nested[0].choices.items()):
            out[f"{name} {child}"] = q
            if i == 0:
                out[name] = q
    return out


# Commands that run a model: each takes --device, and it means the same everywhere.
MODEL_COMMANDS = {"train", "eval", "generate", "bench", "attention", "recl", "ablate"}


def test_every_model_command_defaults_to_device_auto():
    options = {
        name: {o: a for a in p._actions for o in a.option_strings}
        for name, p in _subcommands().items()
    }
    assert set(options) >= MODEL_COMMANDS
    for name in MODEL_COMMANDS - {"train"}:  # train: run.device in the config, auto too
        assert options[name]["--device"].default == "auto", name
    assert options["bench memory"]["--device"].default == "auto"
    assert TrainConfig().run.device == "auto"


def test_one_option_name_per_concept():
    """A prepared corpus is --dataset wherever a command takes one (never --data)."""
    for name, p in _subcommands().items():
        flags = {o for a in p._actions for o in a.option_strings}
        assert "--data" not in flags, name


def test_device_names_resolve_or_fail_in_one_line():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "cuda:x", ""):
        with pytest.raises(ConfigError, match="bad device"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no GPU"):
            resolve_device("cuda:0")
        result = txlm("generate", "nowhere", "--prompt", "a", "--device", "cuda")
        assert result.returncode == 2 and result.stderr.count("\n") == 1
        assert "no GPU" in result.stderr


def test_every_model_command_takes_device_and_threads_and_train_puts_them_in_its_config():
    for name, p in _subcommands().items():
        if name.split()[0] in MODEL_COMMANDS:
            flags = {o for a in p._actions for o in a.option_strings}
            assert {"--device", "--threads"} <= flags, name

    def resolved(*args: str) -> dict:
        import yaml

        result = txlm("train", "--preset", "debug", *args, "--print-config")
        assert result.returncode == 0, result.stderr
        return yaml.safe_load(result.stdout)["run"]

    run = resolved("--device", "cpu", "--threads", "2")
    assert (run["device"], run["threads"]) == ("cpu", 2)
    run = resolved("--set", "run.device=cpu", "run.threads=3")  # not given: as configured
    assert (run["device"], run["threads"]) == ("cpu", 3)
    run = resolved("--set", "run.device=cpu", "--device", "auto")  # the named option wins
    assert run["device"] == "auto"
    result = txlm("train", "--preset", "debug", "--threads", "0", "--print-config")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "run.threads must be >= 1" in result.stderr


def test_info_lists_every_preset_a_command_accepts():
    from txlm.analysis.ablation import ABLATION_PRESETS, AblationSettings
    from txlm.config import PRESETS

    result = txlm("info", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert {r["preset"] for r in data["presets"]} == set(PRESETS)
    ablation = {r["preset"]: r for r in data["ablation_presets"]}
    assert ablation["small"]["aliases"] == ["ablation-small"]
    assert ablation["small"]["steps"] == AblationSettings(preset="small").resolved()["steps"]
    names = {n for r in ablation.values() for n in [r["preset"], *r["aliases"]]}
    assert names == set(ABLATION_PRESETS)
    text = txlm("info").stdout
    assert all(name in text for name in names)


def test_a_library_note_is_a_line_of_the_command_on_stderr(monkeypatch, capsys):
    """What the library logs at INFO under ``txlm`` (a package being made, which takes a
    while) reaches stderr as the command's own note, for that command only."""

    def noting(args):
        logging.getLogger("txlm.inference.packaged").info("making %s", "it")
        return 0

    log = logging.getLogger("txlm")
    handlers, level = list(log.handlers), log.level
    monkeypatch.setattr(info, "run", noting)
    assert main(["info"]) == 0
    assert capsys.readouterr().err == "txlm: note: making it\n"
    assert log.handlers == handlers and log.level == level
    logging.getLogger("txlm.inference.packaged").info("after")  # (the command is over)
    assert capsys.readouterr().err == ""
