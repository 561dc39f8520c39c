"""HTTP download with resume, progress bar and sha256 verification.

A download goes to ``DEST.part``; an interrupted transfer leaves that file behind and the next
call asks the server for the remaining bytes (``Range``). Only a file whose sha256 matches is
renamed to ``DEST``, so a file without the ``.part`` suffix has always been verified.

Where the expected hash comes from, first match wins:

1. ``TXLM_SHA256_FILE``: a JSON file ``{"file name": "sha256"}``, for private mirrors that
   re-pack an archive (and for the tests, which serve small archives of the same layout);
2. the hashes built into ``corpora.py`` for archives whose sha256 is published;
3. ``DOWNLOAD_DIR/checksums.json``, the hash recorded the first time the file was fetched
   (trust on first use: later downloads of the same name must match it).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from txlm import atomic
from txlm.data.progress import Progress
from txlm.errors import DataError

CHUNK = 1 << 20
CHECKSUM_RECORD = "checksums.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK * 4):
            h.update(block)
    return h.hexdigest()


def mirror_url(default_url: str, mirror: str | None) -> str:
    """Same file name under another base URL (``--mirror`` / ``TXLM_MIRROR``)."""
    if not mirror:
        return default_url
    return mirror.rstrip("/") + "/" + default_url.rsplit("/", 1)[-1]


def sha256_overrides() -> dict[str, str]:
    path = os.environ.get("TXLM_SHA256_FILE")
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read TXLM_SHA256_FILE {path}: {exc}") from None
    if not isinstance(data, dict):
        raise DataError(f"TXLM_SHA256_FILE {path} must hold a JSON object")
    return {str(k): str(v).lower() for k, v in data.items()}


def load_record(download_dir: Path) -> dict[str, dict]:
    p = download_dir / CHECKSUM_RECORD
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise DataError(f"{p} is not valid JSON; delete it to record checksums again") from None
    return data if isinstance(data, dict) else {}


def save_record(download_dir: Path, name: str, sha256: str, size: int, url: str) -> None:
    record = load_record(download_dir)
    record[name] = {"sha256": sha256, "bytes": size, "url": url}
    atomic.write_text(download_dir / CHECKSUM_RECORD, json.dumps(record, indent=1, sort_keys=True))


def download(
    url: str,
    dest: Path,
    *,
    sha256: str | None,
    progress: bool = True,
    timeout: float = 60.0,
) -> str:
    """Fetch ``url`` into ``dest`` (resuming ``dest.part``); return the file's sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": "txlm"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # the .part is already complete (or junk): start over
            part.unlink()
            return download(url, dest, sha256=sha256, progress=progress, timeout=timeout)
        raise DataError(f"download of {url} failed: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DataError(f"download of {url} failed: {reason}") from None

    with response:
        resumed = response.status == 206
        if not resumed:
            have = 0  # the server ignored Range: restart the file from byte 0
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        hasher = hashlib.sha256()
        if resumed:
            with open(part, "rb") as f:  # the hash must cover the bytes fetched earlier
                while block := f.read(CHUNK * 4):
                    hasher.update(block)
        done = have
        # a bar on a terminal, a line per tenth or 30 s in a log (txlm.data.progress)
        bar = Progress(dest.name, total, unit="bytes", initial=have, enabled=progress)
        try:
            with open(part, "ab" if resumed else "wb") as out:
                while True:
                    try:
                        block = response.read(CHUNK)
                    except (http.client.IncompleteRead, OSError) as exc:
                        raise DataError(
                            f"download of {url} interrupted after {done} of {total or '?'} bytes "
                            f"({type(exc).__name__}); run the command again to resume"
                        ) from None
                    if not block:
                        break
                    out.write(block)
                    hasher.update(block)
                    done += len(block)
                    bar.update(len(block))
        finally:
            bar.close()
    if total is not None and done != total:
        raise DataError(
            f"download of {url} interrupted after {done} of {total} bytes; "
            "run the command again to resume"
        )
    digest = hasher.hexdigest()
    if sha256 is not None and digest != sha256.lower():
        part.unlink(missing_ok=True)  # a complete but wrong file cannot be resumed into a right one
        raise DataError(
            f"checksum mismatch for {dest.name} from {url}: expected sha256 {sha256}, got {digest}"
        )
    os.replace(part, dest)
    return digest


def fetch(
    url: str,
    download_dir: Path,
    *,
    known_sha256: str | None,
    progress: bool = True,
) -> tuple[Path, str]:
    """Return a verified local copy of ``url`` in ``download_dir`` and its sha256.

    An existing file is checked against the expected hash (without re-reading it when the
    record says this exact size was verified before); a missing one is downloaded.
    """
    name = url.rsplit("/", 1)[-1]
    dest = download_dir / name
    record = load_record(download_dir).get(name, {})
    expected = sha256_overrides().get(name) or known_sha256 or record.get("sha256")
    if dest.is_file():
        size = dest.stat().st_size
        if record.get("sha256") == expected and record.get("bytes") == size and expected:
            return dest, expected
        digest = sha256_file(dest)
        if expected is not None and digest != expected:
            raise DataError(
                f"checksum mismatch for {dest}: expected sha256 {expected}, got {digest}; "
                "delete the file to download it again"
            )
        save_record(download_dir, name, digest, size, url)
        return dest, digest
    digest = download(url, dest, sha256=expected, progress=progress)
    save_record(download_dir, name, digest, dest.stat().st_size, url)
    return dest, digest
