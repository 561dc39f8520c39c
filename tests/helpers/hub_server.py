"""A minimal Hugging Face Hub on 127.0.0.1, for ``txlm convert --from hf NAME`` tests.

Not a test module. It serves what huggingface_hub 0.36 asks for when it downloads files:

* ``GET /api/models/{repo}/revision/{rev}``: the repository's commit ``sha`` and its file
  list (``siblings``), as ``HfApi.model_info`` reads them;
* ``HEAD /{repo}/resolve/{rev}/{file}``: metadata only. Small files answer 200 with
  ``X-Repo-Commit``, ``ETag`` (the git blob hash) and ``Content-Length``; large (LFS) files
  answer 302 to a content-addressed CDN address with ``X-Linked-Etag`` (their sha256) and
  ``X-Linked-Size``, as the Hub does. ``hf_hub_download`` refuses metadata without a commit,
  an ETag or a size, so all three are always sent;
* ``GET`` of either address: the bytes, honouring ``Range: bytes=N-`` (a resumed download);
* errors the client maps to its exceptions by ``X-Error-Code``: ``RepoNotFound``,
  ``RevisionNotFound``, ``EntryNotFound``.

Faults for the tests: ``missing`` (listed in the API but 404 on download) and ``truncate``
(the next N downloads of a file send half of it under the full ``Content-Length`` and close
the connection). ``requests`` records every request line with its Range header.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

LFS_SUFFIXES = (".bin", ".safetensors", ".pkl")


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = ""
    missing: set[str] = field(default_factory=set)  # listed, but 404 when fetched
    truncate: dict[str, int] = field(default_factory=dict)  # file -> downloads to cut short

    def __post_init__(self) -> None:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + self.files[name])
        self.sha = self.sha or digest.hexdigest()


class HubServer:
    """``with HubServer({"org/tiny": Repo({...})}) as hub:`` then HF_ENDPOINT = hub.url."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                server._handle(self, body=False)

            def do_GET(self) -> None:
                server._handle(self, body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- routing ------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(h.path.split("?")[0])
        with self.lock:
            self.requests.append((h.command, path, h.headers.get("Range")))
        m = re.fullmatch(r"/api/models/(.+?)(?:/revision/([^/]+))?", path)
        if m:
            return self._api(h, m[1], m[2] or "main", body)
        m = re.fullmatch(r"/cdn/([0-9a-f]{64})", path)
        if m:
            for repo in self.repos.values():
                for name, data in repo.files.items():
                    if hashlib.sha256(data).hexdigest() == m[1]:
                        return self._send_file(h, repo, name, body)
            return self._error(h, 404, None, {})
        m = re.fullmatch(r"/([^/]+/[^/]+|[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(h, m[1], m[2], m[3], body)
        return self._error(h, 404, None, {})

    def _repo(self, h, repo_id: str, rev: str, body: bool) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 401, "RepoNotFound", {}, body)
            return None
        if rev not in ("main", repo.sha):
            self._error(h, 404, "RevisionNotFound", {}, body)
            return None
        return repo

    def _api(self, h, repo_id: str, rev: str, body: bool) -> None:
        repo = self._repo(h, repo_id, rev, body)
        if repo is None:
            return
        info = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": repo.sha,
            "private": False,
            "siblings": [{"rfilename": n} for n in sorted(repo.files)],
        }
        data = json.dumps(info).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _resolve(self, h, repo_id: str, rev: str, name: str, body: bool) -> None:
        repo = self._repo(h, repo_id, rev, body)
        if repo is None:
            return
        commit = {"X-Repo-Commit": repo.sha}
        if name not in repo.files or name in repo.missing:
            return self._error(h, 404, "EntryNotFound", commit, body)
        data = repo.files[name]
        if name.endswith(LFS_SUFFIXES):  # LFS: the Hub redirects to its content store
            sha256 = hashlib.sha256(data).hexdigest()
            h.send_response(302)
            h.send_header("Location", f"{self.url}/cdn/{sha256}")
            h.send_header("X-Repo-Commit", repo.sha)
            h.send_header("X-Linked-Etag", f'"{sha256}"')
            h.send_header("X-Linked-Size", str(len(data)))
            h.send_header("ETag", '"redirect"')
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        self._send_file(h, repo, name, body, extra=commit)

    def _send_file(self, h, repo: Repo, name: str, body: bool, extra: dict | None = None) -> None:
        data = repo.files[name]
        start = 0
        rng = h.headers.get("Range")
        if rng and (m := re.fullmatch(r"bytes=(\d+)-", rng.strip())):
            start = min(int(m[1]), len(data))
        part = data[start:]
        h.send_response(206 if start else 200)
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        h.send_header("ETag", f'"{blob}"')
        h.send_header("Content-Length", str(len(part)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Accept-Ranges", "bytes")
        if not body:
            h.end_headers()
            return
        cut = body and repo.truncate.get(name, 0) > 0
        if cut:
            repo.truncate[name] -= 1
            h.send_header("Connection", "close")
        h.end_headers()
        if cut:
            h.wfile.write(part[: len(part) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(part)

    def _error(self, h, status: int, code: str | None, extra: dict, body: bool = True) -> None:
        data = json.dumps({"error": code or "not found"}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        for k, v in extra.items():
            h.send_header(k, v)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)
