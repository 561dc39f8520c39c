"""``txlm convert --from hf NAME``: Hub downloads against a loopback server (helpers/hub_server.py).

The client is the real huggingface_hub, pointed at 127.0.0.1 with HF_ENDPOINT; its cache is
a temporary folder (HF_HUB_CACHE). Paths: a good repository (converted equal to the local
folder, then found in the cache offline), a listed file the server does not have, a
download cut short (refused, then resumed with a Range request), a pickle payload (refused
as for a local folder), an unknown repository, offline without a cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.hf import save_tiny_hf
from tests.helpers.hub_server import HubServer, Repo
from tests.helpers.reliability import evil_torch_zip
from txlm.cli import main

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory) -> dict[str, bytes]:
    """A real TransfoXL checkpoint (pytorch_model.bin, the layout of transfo-xl-wt103)."""
    folder = tmp_path_factory.mktemp("hf")
    save_tiny_hf(folder, safe=False)
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def convert(name: str, out: str, capsys) -> tuple[int, str, str]:
    rc = main(["convert", "--from", "hf", name, "--out", out, "--no-progress"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("txlm: error: "), err
    return lines[0]


def test_good_repo_downloads_converts_and_is_cached(hf_files, env, monkeypatch, capsys, tmp_path):
    (tmp_path / "local").mkdir()
    for name, data in hf_files.items():
        (tmp_path / "local" / name).write_bytes(data)
    assert main(["convert", "--from", "hf", "local", "--out", "from-dir"]) == 0
    with HubServer({"org/tiny-xl": Repo(hf_files)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        rc, _, err = convert("org/tiny-xl", "from-hub", capsys)
        assert rc == 0, err
        paths = [p for m, p, _ in hub.requests if m == "GET"]
    assert "/api/models/org/tiny-xl/revision/main" in paths
    assert any(p.startswith("/cdn/") for p in paths)  # the weights came by the LFS redirect
    a, b = load_file("from-dir/model.safetensors"), load_file("from-hub/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "hf-hub:org/tiny-xl" in (tmp_path / "from-hub/config.json").read_text()

    # The server is gone: offline mode converts from the cache, touching no network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    rc, _, err = convert("org/tiny-xl", "offline", capsys)
    assert rc == 0, err
    c = load_file("offline/model.safetensors")
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_listed_file_missing_on_server(hf_files, env, monkeypatch, capsys):
    repo = Repo(hf_files, missing={"pytorch_model.bin"})
    with HubServer({"org/broken": repo}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        rc, _, err = convert("org/broken", "o", capsys)
    assert rc == 2
    assert "missing" in one_error_line(err)
    assert not Path("o").exists()


def test_repo_without_weights_is_refused_before_downloading(hf_files, env, monkeypatch, capsys):
    files = {k: v for k, v in hf_files.items() if k == "config.json"}
    with HubServer({"org/no-weights": Repo(files)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        rc, _, err = convert("org/no-weights", "o", capsys)
        resolved = [p for m, p, _ in hub.requests if "/resolve/" in p]
    assert rc == 2 and "pytorch_model.bin" in one_error_line(err)
    assert resolved == []


def test_truncated_download_fails_then_resumes(hf_files, env, monkeypatch, capsys):
    import huggingface_hub.constants

    # The client writes what it received in chunks of 10 MB; with small chunks the half of a
    # small file that arrives before the cut reaches the .incomplete file, as a big one's does.
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    size = len(hf_files["pytorch_model.bin"])
    repo = Repo(hf_files, truncate={"pytorch_model.bin": 1})
    with HubServer({"org/flaky": repo}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        rc, _, err = convert("org/flaky", "o", capsys)
        assert rc == 2
        assert "cut short" in one_error_line(err)
        assert not Path("o").exists()
        partial = list(Path(env / "hf-cache").rglob("*.incomplete"))
        assert len(partial) == 1 and 0 < partial[0].stat().st_size < size
        kept = partial[0].stat().st_size

        hub.requests.clear()
        rc, _, err = convert("org/flaky", "o", capsys)
        assert rc == 0, err
        ranges = [r for m, p, r in hub.requests if m == "GET" and p.startswith("/cdn/")]
    assert ranges == [f"bytes={kept}-"]  # resumed where the cut left it, not restarted
    assert not list(Path(env / "hf-cache").rglob("*.incomplete"))


def test_pickle_payload_is_refused(hf_files, env, monkeypatch, capsys, tmp_path):
    marker = tmp_path / "PWNED"
    files = {**hf_files, "pytorch_model.bin": evil_torch_zip(marker)}
    with HubServer({"org/evil": Repo(files)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        rc, _, err = convert("org/evil", "o", capsys)
    assert rc == 2
    assert "pytorch_model.bin" in one_error_line(err)
    assert not marker.exists()
    assert not Path("o").exists()


def test_unknown_repo_and_offline_without_cache(env, monkeypatch, capsys):
    with HubServer({}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        rc, _, err = convert("org/nothing-here", "o", capsys)
    assert rc == 2 and "no repository org/nothing-here" in one_error_line(err)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = convert("org/nothing-here", "o", capsys)
    assert rc == 2 and "HF_HUB_OFFLINE" in one_error_line(err)


def test_a_path_that_does_not_exist_is_not_sent_to_the_hub(env, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a request would fail loudly
    rc, _, err = convert("./models/nope", "o", capsys)
    assert rc == 2 and "models/nope" in one_error_line(err)
    rc, _, err = convert("a/b/c", "o", capsys)
    assert rc == 2 and "a/b/c" in one_error_line(err)


def test_an_unreachable_hub_is_named_with_the_local_folder_way(env, monkeypatch, capsys):
    """No network (a loopback port nothing listens on): one line that says the Hub cannot
    be reached and that a local folder works; offline without a cache says so too."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    rc, _, err = convert("org/model", "o", capsys)
    line = one_error_line(err)
    assert rc == 2 and "cannot reach the Hugging Face Hub at http://127.0.0.1:9" in line
    assert "connection refused" in line and "local folder" in line
    assert not Path("o").exists()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = convert("org/model", "o", capsys)
    line = one_error_line(err)
    assert rc == 2 and "HF_HUB_OFFLINE" in line and "local folder" in line


# -- Checkpoint.open("org/name"): converted once into TXLM_HOME ------------------------------


def test_a_repository_id_opens_as_a_checkpoint_converted_once(hf_files, env, monkeypatch):
    """``txlm.load("org/name")``: downloaded and converted into TXLM_HOME on first use (the
    weights equal ``txlm convert``'s), read from there afterwards without a request."""
    import txlm
    from txlm.checkpoints.checkpoint import Checkpoint

    monkeypatch.setenv("TXLM_HOME", str(env / "home"))
    (env / "local").mkdir()
    for name, data in hf_files.items():
        (env / "local" / name).write_bytes(data)
    assert main(["convert", "--from", "hf", "local", "--out", "from-dir"]) == 0
    with HubServer({"org/tiny-xl": Repo(hf_files)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        model = txlm.load("org/tiny-xl")
        assert hub.requests  # fetched once
        hub.requests.clear()
        ckpt = Checkpoint.open("org/tiny-xl")
        assert hub.requests == []  # the conversion is read, the Hub not asked again
    assert ckpt.path == env / "home" / "hub" / "org--tiny-xl"
    assert ckpt.data["converted_from"]["source"] == "hf-hub:org/tiny-xl"
    want = txlm.load("from-dir").state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the server is gone
    assert Checkpoint.open("org/tiny-xl").model_config == ckpt.model_config


def test_an_unconverted_repository_offline_says_how_to_convert_a_folder(env, monkeypatch):
    from txlm.checkpoints.checkpoint import Checkpoint
    from txlm.errors import CheckpointError

    monkeypatch.setenv("TXLM_HOME", str(env / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a request would fail loudly
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open("org/not-here")
    msg = str(info.value)
    folder = env / "home" / "hub" / "org--not-here"
    assert "\n" not in msg and f"txlm convert --from hf DIR --out {folder}" in msg
    assert not folder.exists()
