"""Checkpoints by name: a Hugging Face Hub repository's files, through ``huggingface_hub``.

    local_or_hub(name, revision=None) -> Path     the folder ``txlm convert --from hf`` reads

``name`` is a local folder when one exists; a name that is not one but reads as a Hub
repository id (``transfo-xl/transfo-xl-wt103``, ``org/name``) is downloaded:

* only what the conversion reads: ``config.json``, one weights format (``model.safetensors``
  before ``pytorch_model.bin``; sharded: the index and its shards) and the tokenizer's
  vocabulary (``vocab.pkl`` / ``vocab.bin``), never a whole repository;
* into huggingface_hub's cache (``HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``): a
  second call finds the files there, and an interrupted download is resumed from its
  ``.incomplete`` file instead of starting over;
* ``HF_HUB_OFFLINE=1``: the cache only, no network; ``HF_ENDPOINT``: another server (a
  mirror; the tests' loopback server); ``HF_HUB_CACHE`` / ``HF_HOME``: the cache's place.
  All are read when the call is made (huggingface_hub reads them once, at import).

What arrives is data, as a local folder is: the weights go through ``torch.load(
weights_only=True)`` or safetensors and a pickled vocabulary through txlm's restricted
unpickler (``txlm.checkpoints.convert``), so a repository carrying a pickle payload is refused the
same
way. Every failure (no such repository, a listed file the server does not have, a download
cut short, no network) is one ``CheckpointError`` line.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from txlm.errors import CheckpointError

CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # preferred first, as convert reads them
VOCABS = ("vocab.pkl", "vocab.bin")
_TRUE = {"1", "on", "yes", "true"}
_PATHLIKE = re.compile(r"^(\.{1,2}|~)?/|[\\]|^\.{1,2}$|/$")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def cache_dir() -> str | None:
    """HF_HUB_CACHE as it is now (None: huggingface_hub's own default, HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def local_or_hub(name: str | Path, *, revision: str | None = None, progress: bool = True) -> Path:
    """The local folder ``name``, or the cached snapshot of the Hub repository ``name``."""
    path = Path(name).expanduser()
    text = str(name)
    if path.exists() or _PATHLIKE.search(text) or text.count("/") > 1:
        return path  # a path (existing or not): convert says what is wrong with it
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        raise CheckpointError(
            f"{text} is neither a folder nor a Hugging Face Hub repository id (org/name)"
        ) from None
    return download(text, revision=revision, progress=progress)


def download(repo_id: str, *, revision: str | None = None, progress: bool = True) -> Path:
    """The folder (a cache snapshot) holding what ``convert_hf`` reads of ``repo_id``."""
    import huggingface_hub as hub
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    # The library reports retries and fallbacks through logging and warnings; txlm's
    # contract for a failure is one line, so only its own message is printed.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    (enable_progress_bars if progress else disable_progress_bars)()
    rev = revision or "main"
    where = f"Hub repository {repo_id} (revision {rev})"
    if offline():
        try:
            folder = hub.snapshot_download(
                repo_id,
                revision=rev,
                allow_patterns=[CONFIG, *WEIGHTS, "*.index.json", "*.safetensors", "*.bin",
                                *VOCABS],
                local_files_only=True,
                cache_dir=cache_dir(),
            )  # fmt: skip
        except hub.utils.LocalEntryNotFoundError:
            raise CheckpointError(
                f"{repo_id} is not a local folder, and HF_HUB_OFFLINE is set: the {where} "
                "is not in the cache; download it once online, or pass a local folder "
                "holding its config.json and weights"
            ) from None
        return Path(folder)

    api = hub.HfApi(endpoint=endpoint())
    try:
        info = _model_info(api, repo_id, rev)
        names = {s.rfilename for s in info.siblings or []}
        wanted = _choose(repo_id, names)
        fetched: dict[str, Path] = {}
        for file in wanted:
            fetched[file] = _get(hub, repo_id, file, rev)
        index = next((f for f in wanted if f.endswith(".index.json")), None)
        if index is not None:
            for shard in _shards(fetched[index], names):
                fetched[shard] = _get(hub, repo_id, shard, rev)
    except CheckpointError:
        raise
    except hub.utils.RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo_id} is not a local folder, and {endpoint()} has no repository {repo_id} "
            "(or it is private or gated)"
        ) from None
    except hub.utils.RevisionNotFoundError:
        raise CheckpointError(f"{repo_id} has no revision {rev!r} on {endpoint()}") from None
    except hub.utils.EntryNotFoundError as exc:
        raise CheckpointError(
            f"{where}: a listed file is missing on {endpoint()} ({_first_line(exc)})"
        ) from None
    except hub.utils.HfHubHTTPError as exc:
        raise CheckpointError(f"{where}: {_first_line(exc)}") from None
    except OSError as exc:  # requests' errors are OSErrors; so is a short download
        raise CheckpointError(
            f"{where}: download failed or was cut short ({_first_line(exc)}); run the "
            "command again to resume it, or set HF_HUB_OFFLINE=1 to use the cache"
        ) from None
    return fetched[CONFIG].parent


def _model_info(api, repo_id: str, revision: str):
    """The repository's listing: the first request, where a missing network shows."""
    try:
        return api.model_info(repo_id, revision=revision)
    except OSError as exc:
        reason = _unreachable(exc)
        if reason is None:
            raise
        raise CheckpointError(
            f"cannot reach the Hugging Face Hub at {endpoint()} ({reason}) to fetch {repo_id}: "
            "pass a local folder holding its config.json and weights instead (txlm convert "
            "--from hf PATH), or set HF_HUB_OFFLINE=1 to use the cache"
        ) from None


def _unreachable(exc: BaseException) -> str | None:
    """Why no connection could be made (refused, unresolved, timed out), or None when the
    failure is something else."""
    import requests

    if not isinstance(exc, requests.exceptions.ConnectionError):
        return None
    text = str(exc)
    for needle, reason in (
        ("Connection refused", "connection refused"),
        ("Name or service not known", "host name not resolved"),
        ("Temporary failure in name resolution", "host name not resolved"),
        ("NameResolutionError", "host name not resolved"),
        ("Network is unreachable", "network unreachable"),
        ("timed out", "timed out"),
    ):
        if needle in text:
            return reason
    return "no connection"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:300]


def _choose(repo_id: str, names: set[str]) -> list[str]:
    if CONFIG not in names:
        raise CheckpointError(f"Hub repository {repo_id} has no {CONFIG}: not a checkpoint")
    files = [CONFIG]
    for single in WEIGHTS:
        if single in names:
            files.append(single)
            break
        if single + ".index.json" in names:
            files.append(single + ".index.json")
            break
    else:
        raise CheckpointError(
            f"Hub repository {repo_id} has neither {WEIGHTS[0]} nor {WEIGHTS[1]} (files: "
            f"{', '.join(sorted(names)[:8])})"
        )
    files += [v for v in VOCABS if v in names][:1]
    return files


def _shards(index_file: Path, names: set[str]) -> list[str]:
    import json

    try:
        weight_map = json.loads(index_file.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError):
        raise CheckpointError(f"{index_file.name} is not a weights index") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_file.name} has no weight_map")
    shards = sorted({str(v) for v in weight_map.values()})
    for shard in shards:  # a plain file of the repository, never a path out of the cache
        if "/" in shard or "\\" in shard or shard.startswith(".") or shard not in names:
            raise CheckpointError(f"{index_file.name} names a shard {shard!r} not in the repo")
    return shards


def _get(hub, repo_id: str, file: str, revision: str) -> Path:
    # By the revision's name, so the cache records which commit it named (refs/REV) and an
    # offline call finds the snapshot under that name.
    return Path(
        hub.hf_hub_download(
            repo_id, file, revision=revision, endpoint=endpoint(), cache_dir=cache_dir()
        )
    )
