"""txlm as a Unix filter: output into a pipe whose reader is gone ends quietly (no error line,
the status 141 of a tool that SIGPIPE ends), as ``head``-piped tools do. Real processes and
real pipes: the warm runner's children write to files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.env import subprocess_env
from tests.helpers.train import tiny_text


def into_closed_pipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m txlm ARGS`` writing into a pipe whose read end is closed before it starts:
    every write fails (EPIPE), whatever the timing."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "txlm", *args], cwd=cwd, stdout=write,
            stderr=subprocess.PIPE, text=True, env=subprocess_env(), timeout=300,
        )  # fmt: skip
    finally:
        os.close(write)


def test_info_into_head_ends_quietly(tmp_path):
    txlm = subprocess.Popen(
        [sys.executable, "-m", "txlm", "info"], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=subprocess_env(),
    )  # fmt: skip
    head = subprocess.run(["head", "-1"], stdin=txlm.stdout, capture_output=True, timeout=300)
    txlm.stdout.close()
    err = txlm.stderr.read().decode()
    txlm.stderr.close()
    assert txlm.wait(timeout=300) in (0, 141), err
    assert err == ""
    assert head.stdout.decode().count("\n") == 1 and b"preset" in head.stdout


def test_prepare_into_a_closed_pipe_is_141_and_the_corpus_is_whole(tmp_path):
    text = tiny_text(tmp_path, n_chars=3000)
    result = into_closed_pipe(["prepare", f"text:{text}", "--data-dir", "data"], tmp_path)
    assert (result.returncode, result.stderr) == (141, "")
    # it printed after the corpus was in place: a second prepare finds it up to date
    again = subprocess.run(
        [sys.executable, "-m", "txlm", "prepare", f"text:{text}", "--data-dir", "data"],
        cwd=tmp_path, capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "data" / "text-tiny" / "meta.json").is_file()


def test_a_broken_pipe_of_another_file_is_still_an_error(monkeypatch, capsys):
    """EPIPE from something other than standard output (a socket, a child's stdin) is a
    failure to report, not a reader that left."""
    from txlm import cli

    def fails(args):
        raise BrokenPipeError(32, "Broken pipe", "some-socket")

    parser = cli.build_parser()
    args = parser.parse_args(["info"])
    monkeypatch.setattr(args, "func", fails)
    monkeypatch.setattr(cli.argparse.ArgumentParser, "parse_args", lambda self, argv=None: args)
    assert cli.main(["info"]) == 2
    assert capsys.readouterr().err == "txlm: error: Broken pipe: some-socket\n"
