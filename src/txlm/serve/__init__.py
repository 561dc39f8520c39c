"""``txlm serve``: an OpenAI-compatible completions server whose sessions keep a document's
memory. ``txlm.serve.app(checkpoint, ...)`` is the ASGI app (docs/serving.md).

The web stack (the ``serve`` extra) is imported on first use, not by ``import txlm``."""

from __future__ import annotations

from typing import Any

from txlm.serve.config import ServeConfig

__all__ = ["ServeConfig", "Service", "app", "create_app"]


def __getattr__(name: str) -> Any:
    if name in ("app", "create_app"):
        from txlm.serve import application

        return getattr(application, name)
    if name == "Service":
        from txlm.serve.service import Service

        return Service
    raise AttributeError(name)
