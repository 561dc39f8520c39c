"""The ASGI app: ``txlm.serve.app(checkpoint, ...)``, FastAPI with the routes of
``txlm.serve.routes``, the API key check, request metrics and OpenAI-style errors."""

from __future__ import annotations

import contextlib
import hmac
import sys
import traceback
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from txlm.checkpoints.checkpoint import Checkpoint
from txlm.serve.config import ServeConfig
from txlm.serve.errors import APIError
from txlm.serve.routes import build_router
from txlm.serve.service import Service


def _authorised(request: Request, key: str) -> bool:
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    # compared in constant time: how far a guess matches does not show in the reply's timing
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())


def create_app(service: Service) -> FastAPI:
    """The app serving ``service``; its lifespan loads the model in the background and stops
    the engine (every open request gets a final event) at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(title="txlm serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.service = service
    key = service.config.api_key

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        guarded = path.startswith("/v1/") or path == "/metrics"
        if key is not None and guarded and not _authorised(request, key):
            message = "a valid API key is required: Authorization: Bearer KEY"
            response = APIError(401, message).response()
            _count(request, response.status_code, service)
            return response
        try:
            response = await call_next(request)
        except APIError as exc:
            response = exc.response()
        _count(request, response.status_code, service)
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))  # fmt: skip
        return APIError(exc.status_code, message).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, "the request is not valid").response()

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exc(file=sys.stderr)  # for the operator; no traceback reaches a client
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    app.include_router(build_router(service))
    return app


def _count(request: Request, status: int, service: Service) -> None:
    route = request.scope.get("route")
    name = getattr(route, "path", None) or "other"
    service.metrics.requests.labels(route=name, status=str(status)).inc()


def app(
    checkpoint: str | Path | Checkpoint,
    config: ServeConfig | None = None,
    **options,
) -> FastAPI:
    """The ASGI app serving ``checkpoint`` (options: ``device``, ``precision``, ``compile``,
    ``tgt_len``, ``mem_len``, ``clamp_len``, ``name``); run it with uvicorn."""
    return create_app(Service(checkpoint, config, **options))
