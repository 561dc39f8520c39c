"""Progress on stderr: a bar on a terminal, a plain line every N steps in a log file."""

from __future__ import annotations

import io
import re

from txlm.training.metrics import ProgressReport

LINE = re.compile(
    r"^step (\d+)/10  loss (\d+\.\d{4})  bpc (\d+\.\d{4})  lr (\S+)  (\d+) tok/s  ETA (\d+:\d\d)$"
)


def _steps(report: ProgressReport, n: int) -> None:
    for step in range(1, n + 1):
        # step s: loss s nats over 100 tokens in 0.5 s, lr 1e-3 / s
        report.update(step, loss=float(step), tokens=100.0, lr=1e-3 / step, seconds=0.5,
                      eta_s=65.0 * (10 - step))  # fmt: skip


def test_plain_lines_every_interval_when_not_a_terminal():
    out = io.StringIO()
    report = ProgressReport(enabled=True, total=10, initial=0, metric="bpc", interval=4, stream=out)
    assert not report.interactive
    _steps(report, 10)
    report.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [LINE.match(x).group(1) for x in lines] == ["4", "8", "10"]  # and the last step
    _, loss, bpc, lr, tok_s, eta = LINE.match(lines[0]).groups()
    assert float(loss) == (1 + 2 + 3 + 4) / 4  # the mean over the steps since the last line
    assert float(bpc) == round(2.5 / 0.6931471805599453, 4)
    assert float(lr) == 1e-3 / 4 and tok_s == "200" and eta == "6:30"
    assert float(LINE.match(lines[2]).group(2)) == 9.5  # steps 9 and 10


def test_a_terminal_gets_a_bar_and_disabled_prints_nothing():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    report = ProgressReport(enabled=True, total=10, initial=0, metric="ppl", interval=4, stream=tty)
    assert report.interactive
    _steps(report, 10)
    report.close()
    assert "\r" in tty.getvalue() and "10/10" in tty.getvalue()
    silent = io.StringIO()
    report = ProgressReport(enabled=False, total=10, initial=0, metric="bpc", interval=1,
                            stream=silent)  # fmt: skip
    _steps(report, 10)
    assert silent.getvalue() == ""
