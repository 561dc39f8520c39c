"""Every download format end to end, through a real HTTP server on 127.0.0.1.

The archives are small but laid out exactly like the real ones (names, folders, zip vs
tar.gz, the ``./`` prefix in PTB's tarball, lm1b's shard names and its vocabulary file).
Their hashes differ from the published ones, so the tests name them in TXLM_SHA256_FILE,
the override meant for re-packed private mirrors.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from txlm.cli import main
from txlm.data import SentenceStreamIterator, StreamIterator, load_prepared, prepare_dataset
from txlm.data.corpora import LM1B_HELDOUT_DIR, LM1B_TRAIN_DIR
from txlm.errors import DataError

# --- archives in the real layouts -------------------------------------------------------


def wiki_tokens(n_articles: int, tag: str) -> str:
    lines = [" \n"]
    for a in range(n_articles):
        lines += [
            f" = {tag} Article {a} = \n",
            " \n",
            f" The {tag} article {a} is about <unk> things , in 1 @,@ 000 words . \n",
            " \n",
            " = = History = = \n",
            " \n",
            f" More @-@ text for {a} and the {tag} set . \n",
            " \n",
        ]
    return "".join(lines)


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def tgz_bytes(members: dict[str, bytes], dirs: tuple[str, ...] = ()) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            tf.addfile(info)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def ptb_text(n: int, tag: str) -> str:
    return "".join(f" the {tag} company said <unk> N shares {i % 7} \n" for i in range(n))


ENWIK8 = ("<mediawiki>\n" + "  <page>\n    <title>Zürich ☃</title>\n  </page>\n" * 60).encode()
TEXT8 = " ".join(["anarchism originated as a term of abuse"] * 80)
LM1B_TOP = "1-billion-word-language-modeling-benchmark-r13output"


def lm1b_sentences(n: int, tag: str) -> str:
    return "".join(f"The {tag} sentence number {i} is here .\n" for i in range(n))


def lm1b_vocab() -> bytes:
    words = ["<S>", "</S>", "<UNK>", "The", "sentence", "number", "is", "here", "."]
    words += [str(i) for i in range(0, 40)] + ["train", "held"]
    return "".join(f"{w} {1000 - i}\n" for i, w in enumerate(words)).encode()


def build_archives() -> dict[str, bytes]:
    def wiki(top: str) -> bytes:
        return zip_bytes(
            {
                f"{top}/wiki.train.tokens": wiki_tokens(6, "train").encode(),
                f"{top}/wiki.valid.tokens": wiki_tokens(2, "valid").encode(),
                f"{top}/wiki.test.tokens": wiki_tokens(2, "test").encode(),
            }
        )

    ptb = {f"./simple-examples/data/ptb.{s}.txt": ptb_text(30, s).encode() for s in ("train",)}
    ptb.update(
        {f"./simple-examples/data/ptb.{s}.txt": ptb_text(8, s).encode() for s in ("valid", "test")}
    )
    ptb["./simple-examples/data/ptb.char.train.txt"] = b"t h e _ c o m p a n y\n"
    lm1b = {
        f"{LM1B_TRAIN_DIR}/news.en-0000{i}-of-00100": lm1b_sentences(25, "train").encode()
        for i in (2, 1)  # archive order need not be sorted
    }
    lm1b[f"{LM1B_HELDOUT_DIR}/news.en.heldout-00000-of-00050"] = lm1b_sentences(6, "held").encode()
    lm1b[f"{LM1B_HELDOUT_DIR}/news.en.heldout-00001-of-00050"] = lm1b_sentences(5, "held").encode()
    return {
        "wikitext-2-v1.zip": wiki("wikitext-2"),
        "wikitext-103-v1.zip": wiki("wikitext-103"),
        "simple-examples.tgz": tgz_bytes(ptb, ("./simple-examples", "./simple-examples/data")),
        "enwik8.zip": zip_bytes({"enwik8": ENWIK8}),
        "text8.zip": zip_bytes({"text8": TEXT8.encode()}),
        "1-billion-word-language-modeling-benchmark-r13output.tar.gz": tgz_bytes(lm1b, (LM1B_TOP,)),
        "1b_word_vocab.txt": lm1b_vocab(),
    }


# --- a loopback server with Range support and a switch to cut a transfer ----------------


class Handler(BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:
        name = self.path.lstrip("/").rsplit("/", 1)[-1]
        rng = self.headers.get("Range")
        self.server.log.append((name, rng))
        data = self.server.files.get(name)
        if data is None:
            self.send_error(404)
            return
        start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
        if start >= len(data) and rng:
            self.send_error(416)
            return
        body = data[start:]
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if name in self.server.cut_once:  # drop the connection half way through
            self.server.cut_once.discard(name)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class Server(ThreadingHTTPServer):
    files: dict[str, bytes]
    log: list[tuple[str, str | None]]
    cut_once: set[str]


@pytest.fixture(scope="module")
def archives() -> dict[str, bytes]:
    return build_archives()


@pytest.fixture
def server(archives) -> Iterator[Server]:
    srv = Server(("127.0.0.1", 0), Handler)
    srv.files = dict(archives)
    srv.log = []
    srv.cut_once = set()
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


@pytest.fixture
def mirror(server, tmp_path, monkeypatch, archives) -> str:
    sums = {name: hashlib.sha256(data).hexdigest() for name, data in archives.items()}
    f = tmp_path / "sha256.json"
    f.write_text(json.dumps(sums))
    monkeypatch.setenv("TXLM_SHA256_FILE", str(f))
    return f"http://127.0.0.1:{server.server_address[1]}/mirror"


def norm_lines(text: str) -> str:
    return "".join(" ".join(line.split()) + "\n" for line in text.splitlines())


# --- one test per format -------------------------------------------------------------------


@pytest.mark.parametrize(("name", "top"), [("wt2", "wikitext-2"), ("wt103", "wikitext-103")])
def test_wikitext(tmp_path, mirror, archives, name, top):
    c = load_prepared(prepare_dataset(name, tmp_path, mirror=mirror, progress=False))
    assert c.level == "word" and c.meta["metric"] == "ppl"
    assert c.vocab.symbols[:2] == ["<unk>", "<eos>"]
    raw = zipfile.ZipFile(io.BytesIO(archives[f"{top}-v1.zip"]))
    for split in ("train", "valid", "test"):
        text = raw.read(f"{top}/wiki.{split}.tokens").decode()
        ids = c.split(split)
        if split != "train":  # the split's own tag is unseen in train: <unk>
            text = text.replace(f" {split} ", " <unk> ")
        assert c.vocab.decode(ids) == norm_lines(text)  # every line ends in <eos>
        # one document per article, starting at its " = Title = " line
        starts = c.doc_starts(split).tolist()
        assert len(starts) == text.count(" Article ")
        for s in starts[1:]:
            assert c.vocab.symbols[int(ids[s])] == "=" and c.vocab.symbols[int(ids[s + 1])] != "="
    assert "valid" not in c.vocab  # vocabulary from train only
    assert c.meta["sources"][0]["url"].startswith(mirror)


def test_ptb(tmp_path, mirror, archives):
    c = load_prepared(prepare_dataset("ptb", tmp_path, mirror=mirror, progress=False))
    expect = ptb_text(8, "test").replace(" test ", " <unk> ")  # unseen in train
    assert c.vocab.decode(c.split("test")) == norm_lines(expect)
    assert c.doc_starts("train").tolist() == [0]
    # the checksum was recorded on first use (PTB publishes none)
    record = json.loads((tmp_path / "downloads" / "checksums.json").read_text())
    digest = hashlib.sha256(archives["simple-examples.tgz"]).hexdigest()
    assert record["simple-examples.tgz"]["sha256"] == digest


def test_enwik8_bytes_and_paper_split(tmp_path, mirror):
    c = load_prepared(prepare_dataset("enwik8", tmp_path, mirror=mirror, progress=False))
    assert c.level == "byte" and len(c.vocab) == 256 and c.meta["metric"] == "bpc"
    parts = [np.asarray(c.split(s)).tobytes() for s in ("train", "valid", "test")]
    assert b"".join(parts) == ENWIK8
    k = len(ENWIK8) // 20  # 5M of 100M in the real file
    assert [len(p) for p in parts] == [len(ENWIK8) - 2 * k, k, k]


def test_text8_chars(tmp_path, mirror):
    c = load_prepared(prepare_dataset("text8", tmp_path, mirror=mirror, progress=False))
    text = "".join(c.vocab.decode(c.split(s)) for s in ("train", "valid", "test"))
    assert text == TEXT8 and c.level == "char"
    assert c.vocab.unk_id is None and len(c.vocab) == len(set(TEXT8))  # no unused <unk>
    assert len(c.split("test")) == len(TEXT8) // 20


def test_lm1b_sentences_vocab_file_and_heldout_shards(tmp_path, mirror):
    c = load_prepared(prepare_dataset("lm1b", tmp_path, mirror=mirror, progress=False))
    v = c.vocab
    assert (v.bos, v.eos, v.unk) == ("<S>", "</S>", "<UNK>")
    assert v.symbols[:3] == ["<S>", "</S>", "<UNK>"] and len(v) == 9 + 40 + 2
    test = c.split("test")
    assert v.decode(test) == lm1b_sentences(6, "held")  # heldout-00000 is the test set
    assert v.decode(c.split("valid")) == lm1b_sentences(5, "held")  # heldout-00001 validates
    starts = c.doc_starts("train")
    assert len(starts) == 50 and all(int(c.split("train")[s]) == v.bos_id for s in starts)
    it = SentenceStreamIterator(c.split("train"), 2, 5, doc_starts=starts, doc_mode="reset")
    b = next(iter(it))
    expect = b.input_ids == v.bos_id  # a sentence starts at its <S>
    expect[:, 0] = True  # and every row starts afresh in an epoch's first batch
    assert torch.equal(b.reset, expect)


def test_stream_over_a_prepared_split(tmp_path, mirror):
    c = load_prepared(prepare_dataset("wt2", tmp_path, mirror=mirror, progress=False))
    it = StreamIterator(c.split("train"), 2, 8, doc_starts=c.doc_starts("train"), doc_mode="reset")
    flags = torch.cat([b.reset for b in it], dim=1)
    assert int(flags.sum()) >= len(c.doc_starts("train")) - 1


# --- resume, checksums, cache ----------------------------------------------------------------


def test_interrupted_download_resumes_with_range(tmp_path, server, mirror, capsys):
    server.cut_once.add("text8.zip")
    code = main(["prepare", "text8", "--data-dir", str(tmp_path), "--mirror", mirror])
    err = capsys.readouterr().err
    assert code == 2 and "interrupted" in err and err.count("\n") == 1
    part = tmp_path / "downloads" / "text8.zip.part"
    assert part.exists() and not (tmp_path / "text8").exists()
    have = part.stat().st_size
    assert main(["prepare", "text8", "--data-dir", str(tmp_path), "--mirror", mirror]) == 0
    assert ("text8.zip", f"bytes={have}-") in server.log
    assert not part.exists() and (tmp_path / "text8" / "meta.json").exists()


def test_failed_checksum_is_refused_and_keeps_earlier_data(tmp_path, server, mirror, monkeypatch):
    path = prepare_dataset("wt2", tmp_path, mirror=mirror, progress=False)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    (tmp_path / "downloads" / "wikitext-2-v1.zip").unlink()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"wikitext-2-v1.zip": "0" * 64}))
    monkeypatch.setenv("TXLM_SHA256_FILE", str(bad))
    with pytest.raises(DataError, match="checksum mismatch"):
        prepare_dataset("wt2", tmp_path, mirror=mirror, progress=False, force=True)
    assert not list((tmp_path / "downloads").glob("wikitext-2-v1.zip*"))
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_trust_on_first_use_detects_a_changed_archive(tmp_path, server, mirror, monkeypatch):
    monkeypatch.delenv("TXLM_SHA256_FILE")
    prepare_dataset("ptb", tmp_path, mirror=mirror, progress=False)
    (tmp_path / "downloads" / "simple-examples.tgz").unlink()
    server.files["simple-examples.tgz"] = tgz_bytes(
        {"./simple-examples/data/ptb.train.txt": b"changed\n"}
    )
    with pytest.raises(DataError, match="checksum mismatch"):
        prepare_dataset("ptb", tmp_path, mirror=mirror, progress=False, force=True)


def test_prepared_copy_is_reused_without_network(tmp_path, server, mirror):
    prepare_dataset("enwik8", tmp_path, mirror=mirror, progress=False)
    n = len(server.log)
    prepare_dataset("enwik8", tmp_path, mirror=mirror, progress=False)
    assert len(server.log) == n


def test_missing_file_on_the_server(tmp_path, server, mirror, capsys):
    del server.files["enwik8.zip"]
    code = main(["prepare", "enwik8", "--data-dir", str(tmp_path), "--mirror", mirror])
    err = capsys.readouterr().err
    assert code == 2 and "HTTP 404" in err


def test_mirror_from_environment_and_a_bad_archive(tmp_path, server, mirror, monkeypatch, capsys):
    monkeypatch.setenv("TXLM_MIRROR", mirror)
    server.files["text8.zip"] = b"this is not a zip file at all"
    sums = tmp_path / "s.json"
    sums.write_text(
        json.dumps({"text8.zip": hashlib.sha256(server.files["text8.zip"]).hexdigest()})
    )
    monkeypatch.setenv("TXLM_SHA256_FILE", str(sums))
    code = main(["prepare", "text8", "--data-dir", str(tmp_path / "d"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "not a readable archive" in err
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["downloads"]


def test_progress_is_shown_in_a_log(tmp_path, mirror, capsys, monkeypatch):
    import itertools

    from txlm.data import progress

    # every reading of the progress clock 2 s later: the download lasts past its first second
    monkeypatch.setattr(progress, "_now", itertools.count(0.0, 2.0).__next__)
    prepare_dataset("text8", tmp_path, mirror=mirror, progress=True)
    size = (tmp_path / "downloads" / "text8.zip").stat().st_size
    assert f"text8.zip: {size}/{size} bytes, " in capsys.readouterr().err


def test_default_urls_are_the_public_ones():
    from txlm.data.corpora import SPECS

    urls = {n: [r.url for r in s.remote] for n, s in SPECS.items()}
    assert urls["enwik8"] == ["http://mattmahoney.net/dc/enwik8.zip"]
    assert urls["wt103"] == ["https://wikitext.smerity.com/wikitext-103-v1.zip"]
    assert urls["ptb"] == ["http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz"]
    assert all(len(r.sha256 or "0" * 64) == 64 for s in SPECS.values() for r in s.remote)
