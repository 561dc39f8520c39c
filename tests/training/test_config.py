"""Training configuration: composition order, typed --set values, clear refusals; schedules."""

from __future__ import annotations

import itertools
import math

import pytest

from txlm.cli import main
from txlm.errors import ConfigError
from txlm.training import learning_rate
from txlm.training.config import TrainConfig, parse_set, preset_config, resolve


def test_preset_yaml_set_compose_in_order(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("optim:\n  lr: 3.0e-3\n  max_steps: 50\nmodel:\n  n_layer: 3\n")
    config = resolve("debug", [str(yaml_file)], ["optim.lr=1e-2", "model.d_model=48"])
    assert config.preset == "debug"
    assert config.optim.lr == pytest.approx(1e-2)  # --set beats YAML
    assert config.optim.max_steps == 50  # YAML beats the preset (20)
    assert config.model["n_layer"] == 3
    assert config.model["d_model"] == 48
    assert config.model["d_head"] == 16  # untouched preset value
    assert config.data.batch_size == 4  # the preset's train defaults
    assert config.eval.eval_mem_len == 32  # Preset.eval mapped to eval.eval_mem_len


def test_default_preset_and_yaml_preset(tmp_path):
    assert resolve().preset == "shakespeare-char"
    yaml_file = tmp_path / "p.yaml"
    yaml_file.write_text("preset: debug\n")
    assert resolve(None, [str(yaml_file)]).preset == "debug"
    assert resolve("shakespeare-char", [str(yaml_file)]).preset == "shakespeare-char"


@pytest.mark.parametrize(
    ("item", "key", "expected"),
    [
        ("optim.lr=1e-3", ("optim", "lr"), 1e-3),  # YAML 1.1 reads 1e-3 as a string
        ("optim.warmup_steps=7", ("optim", "warmup_steps"), 7),
        ("run.stop_at=null", ("run", "stop_at"), None),
        ("run.deterministic=true", ("run", "deterministic"), True),
        ("data.dataset=text:my 1.txt", ("data", "dataset"), "text:my 1.txt"),
        ("run.out_dir=123", ("run", "out_dir"), "123"),  # a str field keeps the text
        ("optim.schedule=inv_sqrt", ("optim", "schedule"), "inv_sqrt"),
    ],
)
def test_set_values_are_typed(item, key, expected):
    config = resolve("debug", None, [item])
    value = getattr(getattr(config, key[0]), key[1])
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'"),
        ("optimizer.lr=1", "unknown config section 'optimizer'"),
        ("lr=1", "use section.name"),
        ("optim.max_steps=abc", "optim.max_steps must be an integer"),
        ("optim.max_steps=0", "optim.max_steps must be >= 1"),
        ("optim.schedule=linear", "optim.schedule must be one of cosine, inv_sqrt, constant"),
        ("run.precision=fp8", "run.precision must be one of"),
        ("model.n_layers=2", "unknown config key 'model.n_layers'"),
        ("model.dropout=1.5", "dropout must be in [0, 1)"),
        ("model.vocab_size=10", "comes from the data's vocabulary"),
        ("data.batch_size=6", "divisible by optim.grad_accum"),
        ("novalue", "expects key=value"),
    ],
)
def test_bad_settings_are_refused_clearly(item, message):
    sets = [item, "optim.grad_accum=4"] if item.startswith("data.batch_size") else [item]
    with pytest.raises(ConfigError, match=_escape(message)):
        resolve("debug", None, sets)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_cli_reports_one_line_and_exit_2(capsys):
    assert main(["train", "--preset", "debug", "--set", "optim.lr=fast"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("txlm: error: optim.lr must be a number")
    assert len(err.strip().splitlines()) == 1
    assert main(["train", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_print_config_round_trips(capsys):
    assert main(["train", "--preset", "debug", "--set", "optim.lr=0.5", "--print-config"]) == 0
    import yaml

    data = yaml.safe_load(capsys.readouterr().out)
    config = TrainConfig.from_dict(data)
    assert config.optim.lr == 0.5
    assert config.to_dict() == resolve("debug", None, ["optim.lr=0.5"]).to_dict()


def test_parse_set_keeps_text():
    key, raw = parse_set("data.dataset=text:a=b.txt")
    assert key == "data.dataset" and raw.text == "text:a=b.txt"


def _cfg(**optim) -> TrainConfig:
    config = preset_config("debug")
    for k, v in optim.items():
        setattr(config.optim, k, v)
    return config


def test_cosine_with_warmup():
    c = _cfg(lr=1.0, warmup_steps=4, max_steps=14, schedule="cosine", min_lr=0.1)
    assert [learning_rate(s, c.optim) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(4, c.optim) == pytest.approx(1.0)
    assert learning_rate(9, c.optim) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: mean of ends
    assert learning_rate(14, c.optim) == pytest.approx(0.1)
    lrs = [learning_rate(s, c.optim) for s in range(4, 15)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_inverse_sqrt_and_constant():
    c = _cfg(lr=1.0, warmup_steps=4, schedule="inv_sqrt")
    assert learning_rate(3, c.optim) == pytest.approx(1.0)
    assert learning_rate(15, c.optim) == pytest.approx(math.sqrt(4 / 16))
    c = _cfg(lr=0.3, warmup_steps=0, schedule="constant")
    assert learning_rate(0, c.optim) == learning_rate(999, c.optim) == 0.3


def test_a_printed_config_is_a_config_file(tmp_path):
    """What --print-config writes (top-level init and task included) reads back as --config,
    and an init checkpoint named in a file is refused: it comes from --init."""
    printed = resolve("debug", sets=["optim.lr=0.5", "data.batch_size=3"])
    path = tmp_path / "run.yaml"
    path.write_text(printed.to_yaml())
    assert resolve(None, config_files=[str(path)]) == printed
    path.write_text(printed.to_yaml().replace("init: null", "init: runs/x/best"))
    with pytest.raises(ConfigError, match="init is set with txlm train --init"):
        resolve(None, config_files=[str(path)])
