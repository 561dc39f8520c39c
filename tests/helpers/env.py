"""The repository and the environment of a ``python -m txlm`` child process."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def subprocess_env(data_dir: str | Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a ``python -m txlm`` child: this checkout's ``src`` first on the
    path, one thread, fixed hashing, never the real Hub, the data directory given (else the
    default, as a user has it) and no fault seam unless asked for (``TXLM_FAULT=...``)."""
    env = dict(os.environ)
    for key in ("TXLM_DATA_DIR", "TXLM_FAULT", "TXLM_FAULT_DIR"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONHASHSEED"] = "0"
    env["HF_HUB_OFFLINE"] = "1"  # `convert --from hf NAME` must never reach the real Hub
    if data_dir is not None:
        env["TXLM_DATA_DIR"] = str(data_dir)
    env.update(extra)
    return env
