"""``text:FOLDER`` with empty documents: each empty (or whitespace-only) ``.txt`` is skipped
and counted in one line, the corpus is what the other documents make; a folder with no
document holding text is refused in one line, nothing written."""

from __future__ import annotations

import json

from tests.helpers.train import tiny_text
from txlm.cli import main
from txlm.data import load_prepared, prepare_dataset


def folder_of(root, *, empty: dict[str, str]):
    root.mkdir()
    play = tiny_text(root, n_chars=6000).read_text()
    folder = root / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(play[:3000])
    (folder / "b.txt").write_text(play[3000:])
    for name, text in empty.items():
        (folder / name).write_text(text)
    return folder


def test_empty_documents_are_skipped_and_counted(tmp_path, capsys):
    with_empty = folder_of(tmp_path / "x", empty={"c.txt": "", "d.txt": " \n\n\t\n"})
    without = folder_of(tmp_path / "y", empty={})
    assert main(["prepare", f"text:{with_empty}", "--data-dir", str(tmp_path / "d1")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "skipped 2 empty document(s) (nothing but whitespace): c.txt, d.txt"
    )
    a = load_prepared(tmp_path / "d1" / "text-docs")
    b = load_prepared(prepare_dataset(f"text:{without}", tmp_path / "d2", progress=False))
    for split in ("train", "valid", "test"):  # the same corpus as without them
        assert (a.split(split) == b.split(split)).all()
    assert a.meta["corpus"]["skipped_empty"] == ["c.txt", "d.txt"]
    assert "skipped_empty" not in b.meta["corpus"]
    assert (
        main(["prepare", f"text:{with_empty}", "--data-dir", str(tmp_path / "d1"), "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["skipped_empty"] == ["c.txt", "d.txt"]


def test_a_folder_of_empty_documents_is_refused(tmp_path, capsys):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("")
    (folder / "b.txt").write_text("\n \n")
    assert main(["prepare", f"text:{folder}", "--data-dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert err == f"txlm: error: folder {folder} has no document with text (2 empty)\n"
    assert not (tmp_path / "data").exists()
