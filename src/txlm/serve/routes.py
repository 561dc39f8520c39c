"""The HTTP routes: OpenAI's completions, sessions, classification, health, models, metrics,
and the playground page."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from txlm.serve.engine import Call, Job, Outbox, Token
from txlm.serve.errors import APIError, bad
from txlm.serve.protocol import CompletionRequest, check_prompt_tokens, parse_completion
from txlm.serve.service import Service
from txlm.serve.text import logprob_entries


async def read_json(request: Request, cap: int) -> Any:
    """The body as JSON, at most ``cap`` bytes (413 past it, also without a Content-Length)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise APIError(413, f"the body has {declared} bytes, over the cap of {cap} "
                       "(--max-body-bytes)")  # fmt: skip
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > cap:
            raise APIError(413, f"the body is over the cap of {cap} bytes (--max-body-bytes)")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # (a JSONDecodeError is a ValueError)
        raise bad(f"the body is not valid JSON: {exc}") from None


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


class Completion:
    """One request's rows as they are answered: text, tokens and log-probs per choice."""

    def __init__(self, service: Service, req: CompletionRequest, prompts: list[list[int]]):
        self.service, self.req, self.prompts = service, req, prompts
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.rows = len(prompts) * req.n
        self.tokens: list[list[Token]] = [[] for _ in range(self.rows)]
        self.echoed: list[tuple[list, list]] = []
        self.finish: list[str | None] = [None] * self.rows

    def prompt_of(self, row: int) -> int:
        return row // self.req.n

    def echo_text(self, row: int) -> str:
        return self.service.decode(self.prompts[self.prompt_of(row)]) if self.req.echo else ""

    def echo_logprobs(self, row: int) -> dict[str, Any] | None:
        if self.req.logprobs is None or not self.req.echo or not self.echoed:
            return None
        chosen, tops = self.echoed[self.prompt_of(row)]
        return logprob_entries(self.service.vocab, self.prompts[self.prompt_of(row)],
                               chosen, tops)  # fmt: skip

    def token_logprobs(self, tokens: list[Token]) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        return logprob_entries(self.service.vocab, [t.id for t in tokens],
                               [t.logprob for t in tokens], [t.top for t in tokens])  # fmt: skip

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        done = sum(len(t) for t in self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.service.name, "choices": choices, **extra}  # fmt: skip

    def whole(self) -> dict[str, Any]:
        choices = []
        for r in range(self.rows):
            tokens = self.tokens[r]
            logprobs = self.token_logprobs(tokens)
            echoed = self.echo_logprobs(r)
            if echoed is not None and logprobs is not None:
                logprobs = _join(echoed, logprobs, len(self.echo_text(r)))
            choices.append({
                "text": self.echo_text(r) + "".join(t.text for t in tokens),
                "index": r,
                "logprobs": logprobs,
                "finish_reason": self.finish[r],
            })  # fmt: skip
        return self.chunk(choices, usage=self.usage())


def _join(a: dict[str, Any], b: dict[str, Any], shift: int) -> dict[str, Any]:
    return {
        "tokens": a["tokens"] + b["tokens"],
        "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
        "top_logprobs": a["top_logprobs"] + b["top_logprobs"],
        "text_offset": a["text_offset"] + [o + shift for o in b["text_offset"]],
    }


def build_router(service: Service) -> APIRouter:
    router = APIRouter()
    limits = service.config

    @router.get("/health")
    async def health() -> JSONResponse:
        if service.failed is not None:
            return JSONResponse({"status": "failed", "error": service.failed}, status_code=503)
        if not service.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [service.describe()]}

    @router.post("/v1/chat/completions")
    async def chat() -> Response:
        raise bad("txlm serves plain language models, which have no chat format: use "
                  "POST /v1/completions with a prompt")  # fmt: skip

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        engine = service.require("lm")
        req = parse_completion(await read_json(request, limits.max_body_bytes), limits)
        prompts = [service.encode(p) for p in req.prompts]
        check_prompt_tokens(sum(len(p) for p in prompts), limits)
        sampling = service.sampling(req.sampling, prompts)
        if len(prompts) * req.n > limits.max_batch:
            raise bad(f"{len(prompts)} prompt(s) x n {req.n} = {len(prompts) * req.n} rows, over "
                      f"--max-batch {limits.max_batch}", "n")  # fmt: skip
        session = service.sessions.acquire(req.session) if req.session else None
        seed = req.seed if req.seed is not None else random.SystemRandom().randrange(2**31)
        job = Job(
            prompts=prompts, n=req.n, max_tokens=req.max_tokens, sampling=sampling,
            seed=seed, stop=req.stop, logprobs=req.logprobs, echo=req.echo,
            outbox=Outbox(asyncio.get_running_loop()), session=session,
        )  # fmt: skip
        try:
            engine.submit(job)
        except APIError:
            if session is not None:
                service.sessions.release(session)
            raise
        answer = Completion(service, req, prompts)
        if req.stream:
            return StreamingResponse(_stream(service, job, answer),
                                     media_type="text/event-stream")  # fmt: skip
        finished = False
        try:
            await _collect(job, answer, limits.request_timeout)
            finished = True
        finally:
            if not finished:
                engine.cancel(job)
        return JSONResponse(answer.whole())

    # -- sessions -----------------------------------------------------------------------
    @router.post("/v1/sessions")
    async def new_session(request: Request) -> JSONResponse:
        service.require("lm")
        raw = await request.body()
        if len(raw) > limits.max_body_bytes:
            raise APIError(413, f"the body is over the cap of {limits.max_body_bytes} bytes")
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError) as exc:
            raise bad(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict) or set(body) - {"id"}:
            raise bad("POST /v1/sessions takes an optional 'id' only")
        sid = body.get("id")
        if sid is not None and (not isinstance(sid, str) or not sid or len(sid) > 128):
            raise bad("'id' must be a string of 1 to 128 characters", "id")
        return JSONResponse(service.sessions.create(sid).describe(), status_code=201)

    @router.get("/v1/sessions")
    async def list_sessions() -> dict[str, Any]:
        return {"object": "list", "data": [s.describe() for s in service.sessions.list()]}

    @router.get("/v1/sessions/{sid}")
    async def get_session(sid: str) -> dict[str, Any]:
        return service.sessions.get(sid).describe()

    @router.delete("/v1/sessions/{sid}")
    async def delete_session(sid: str) -> dict[str, Any]:
        service.sessions.delete(sid)
        return {"id": sid, "object": "session", "deleted": True}

    # -- classification -----------------------------------------------------------------
    @router.post("/v1/classify")
    async def classify(request: Request) -> JSONResponse:
        engine = service.require("classify")
        body = await read_json(request, limits.max_body_bytes)
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        unknown = sorted(set(body) - {"input", "model"})
        if unknown:
            raise bad(f"unknown field '{unknown[0]}'", unknown[0])
        inputs = body.get("input")
        inputs = [inputs] if isinstance(inputs, str) else inputs
        if (
            not isinstance(inputs, list)
            or not inputs
            or not all(isinstance(x, str) and x for x in inputs)
        ):
            raise bad("'input' must be a non-empty string or a list of them", "input")
        docs = [service.encode(x, "input") for x in inputs]
        check_prompt_tokens(sum(len(d) for d in docs), limits)
        from txlm.classify.predict import predict

        call = Call(lambda: predict(service.model, docs).tolist(),
                    Outbox(asyncio.get_running_loop()))  # fmt: skip
        engine.submit(call)
        try:
            kind, probs = await asyncio.wait_for(call.outbox.queue.get(), limits.request_timeout)
        except TimeoutError:
            engine.cancel(call)
            raise APIError(504, f"over the {limits.request_timeout:g} s cap (--request-timeout)"
                           ) from None  # fmt: skip
        if kind == "error":
            raise probs
        labels = service.model.labels
        data = []
        for i, row in enumerate(probs):
            best = max(range(len(labels)), key=lambda k, row=row: row[k])
            data.append({"index": i, "label": labels[best],
                         "probs": dict(zip(labels, row, strict=True))})  # fmt: skip
        tokens = sum(len(d) for d in docs)
        return JSONResponse(
            {
                "object": "list",
                "model": service.name,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    # -- metrics and the page -----------------------------------------------------------
    @router.get("/metrics")
    async def metrics() -> Response:
        payload, kind = service.metrics.render()
        return Response(payload, media_type=kind)

    @router.get("/")
    async def page() -> HTMLResponse:
        return HTMLResponse(_static("index.html"))

    @router.get("/static/{name}")
    async def static(name: str) -> Response:
        kinds = {".js": "text/javascript", ".css": "text/css"}
        kind = next((v for k, v in kinds.items() if name.endswith(k)), None)
        if kind is None or "/" in name or name.startswith("."):
            raise APIError(404, f"no static file '{name}'")
        try:
            return Response(_static(name), media_type=kind)
        except FileNotFoundError:
            raise APIError(404, f"no static file '{name}'") from None

    return router


def _static(name: str) -> str:
    return resources.files("txlm.serve").joinpath("static", name).read_text(encoding="utf-8")


async def _next(job: Job, deadline: float) -> tuple[str, Any]:
    left = deadline - time.monotonic()
    try:
        return await asyncio.wait_for(job.outbox.queue.get(), max(left, 0.0))
    except TimeoutError:
        raise APIError(504, "the request ran over the server's cap of "
                       f"{deadline - job.arrived:g} s (--request-timeout)") from None  # fmt: skip


async def _collect(job: Job, answer: Completion, timeout: float) -> None:
    job.arrived = time.monotonic()
    deadline = job.arrived + timeout
    while True:
        kind, data = await _next(job, deadline)
        if kind == "prompt":
            answer.echoed = data
        elif kind == "tokens":
            for token in data:
                answer.tokens[token.row].append(token)
        elif kind == "done":
            answer.finish = data
            return
        elif kind == "error":
            raise data


async def _stream(service: Service, job: Job, answer: Completion) -> AsyncIterator[str]:
    """Server-sent events: a chunk per token of each choice (the echoed prompt first), one
    with each choice's finish_reason, usage if asked, then ``data: [DONE]``."""
    engine = service.engine
    assert engine is not None
    job.arrived = time.monotonic()
    deadline = job.arrived + service.config.request_timeout
    finished = False
    try:
        while True:
            try:
                kind, data = await _next(job, deadline)
            except APIError as exc:
                kind, data = "error", exc
            if kind == "prompt":
                answer.echoed = data
                if answer.req.echo:
                    for r in range(answer.rows):
                        yield _sse(answer.chunk([{"text": answer.echo_text(r), "index": r,
                                                  "logprobs": answer.echo_logprobs(r),
                                                  "finish_reason": None}]))  # fmt: skip
            elif kind == "tokens":
                for token in data:
                    answer.tokens[token.row].append(token)
                    if token.text or answer.req.logprobs is not None:
                        yield _sse(answer.chunk([{
                            "text": token.text, "index": token.row,
                            "logprobs": answer.token_logprobs([token]), "finish_reason": None,
                        }]))  # fmt: skip
            elif kind == "done":
                answer.finish = data
                for r in range(answer.rows):
                    yield _sse(answer.chunk([{"text": "", "index": r, "logprobs": None,
                                              "finish_reason": data[r]}]))  # fmt: skip
                if answer.req.include_usage:
                    yield _sse(answer.chunk([], usage=answer.usage()))
                finished = True
                yield "data: [DONE]\n\n"
                return
            elif kind == "error":
                finished = True
                yield _sse(data.body())
                yield "data: [DONE]\n\n"
                return
    finally:
        if not finished:
            engine.cancel(job)
