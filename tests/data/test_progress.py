"""``txlm.data.progress``: a bar on a terminal; in a log a line per tenth of the work or every
30 s, and nothing for a step that ends within a second. The clock is a hook the tests
advance step by step (never the wall clock)."""

from __future__ import annotations

import io
import itertools

from txlm.data import progress
from txlm.data.progress import Progress


def ticking(step_s: float):
    """A clock that moves ``step_s`` seconds at every reading."""
    times = itertools.count(0.0, step_s)
    return lambda: next(times)


def test_a_log_gets_a_line_per_tenth_once_past_a_second():
    out = io.StringIO()
    bar = Progress("valid", 40, unit="segments", stream=out, clock=ticking(0.25))
    for _ in range(40):
        bar.update()
    bar.close()
    lines = out.getvalue().splitlines()
    # readings: 0 at the start, 0.25 s per update; the first second prints nothing
    assert lines[0] == "valid: 4/40 segments, 1s"
    assert lines[-1] == "valid: 40/40 segments, 10s"
    done = [int(line.split()[1].split("/")[0]) for line in lines]
    assert done == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]


def test_a_step_within_a_second_prints_nothing():
    out = io.StringIO()
    with Progress("test", 1000, unit="segments", stream=out, clock=ticking(0.0009)) as bar:
        for _ in range(1000):
            bar.update()
    assert out.getvalue() == ""


def test_without_a_total_a_line_every_thirty_seconds():
    out = io.StringIO()
    with Progress("text-x train", None, unit="tokens", stream=out, clock=ticking(7.0)) as bar:
        for _ in range(10):
            bar.update(1000)
    # no tenths to count: a line once 30 s have passed since the start or the last line
    assert out.getvalue().splitlines() == [
        "text-x train: 5000 tokens, 35s",
        "text-x train: 10000 tokens, 70s",
    ]


def test_a_terminal_gets_a_bar_and_disabled_prints_nothing():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    with Progress("eval", 5, unit="segments", stream=tty, clock=ticking(10.0)) as bar:
        for _ in range(5):
            bar.update()
    assert "\r" in tty.getvalue() and "eval:" in tty.getvalue() and "/5 " in tty.getvalue()
    silent = io.StringIO()
    with Progress("eval", 5, stream=silent, enabled=False, clock=ticking(10.0)) as bar:
        for _ in range(5):
            bar.update()
    assert silent.getvalue() == "" and bar.done == 5


def test_the_default_clock_is_the_module_hook(monkeypatch):
    monkeypatch.setattr(progress, "_now", ticking(5.0))
    out = io.StringIO()
    with Progress("eval", 2, stream=out) as bar:
        bar.update()
        bar.update()
    assert out.getvalue() == "eval: 1/2 it, 5s\neval: 2/2 it, 10s\n"


def test_a_classifiers_documents_show_their_progress_in_a_log(tmp_path, monkeypatch, capsys):
    """``txlm classify`` and a classifier's evaluation count documents as they are read."""
    import numpy as np

    from tests.helpers.classify import save_classifier, tiny_lm
    from txlm.checkpoints.checkpoint import load_classifier
    from txlm.classify.predict import predict

    model = load_classifier(save_classifier(tmp_path / "cls", tiny_lm(tmp_path / "lm")))
    docs = [np.arange(1 + i % 5) % 8 for i in range(20)]
    monkeypatch.setattr(progress, "_now", ticking(3.0))
    predict(model, docs, batch_size=4, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"classify: {n}/20 documents, {3 * (n // 4)}s" for n in (4, 8, 12, 16, 20)]
