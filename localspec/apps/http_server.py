"""`localspec serve --http`: the OpenAI-compatible server (starlette routes on uvicorn). One engine
per slot (`--parallel N`), each on its own thread, runs generations from one bounded FIFO queue
(http_worker.py); the async side only parses requests, queues jobs and streams their pieces.
Request/response shapes: openai_api.py, infill_api.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..llama.rpc import attached as rpc_attached, on_lost as rpc_on_lost
from .checks import model_info, parse_json, speculation_info
from .http_worker import Job, Worker
from .infill_api import infill_body, infill_chunk, parse_infill_request
from .openai_api import (ApiError, GenRequest, HttpSettings, chunk, closing_chunks, full_response,
                         model_card, model_names, models_list, parse_chat, parse_completion)
from .supervise import ready_signal

DRAIN_LIMIT = 64 << 20     # bytes of an oversized body read and dropped before the 413


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _watch_disconnect(receive, job: Job, worker: Worker) -> None:
    """Cancel `job` as soon as its client hangs up: the engine checks the flag every step, and
    a job still queued leaves the queue at once."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel.set()
            worker.withdraw(job)
            return


class Service:
    """The endpoints. Holds only what the async side may touch: the worker's queue, not the
    engine (its description is taken once, at start-up)."""

    def __init__(self, worker: Worker, names: list, info: dict, api_key: Optional[str],
                 max_body: int):
        self.worker, self.names, self.info = worker, names, info
        self.api_key, self.max_body = api_key, max_body
        self.created = int(time.time())

    # -- endpoints ---------------------------------------------------------------------------
    async def health(self, request):
        busy, waiting = self.worker.busy(), self.worker.waiting()
        return JSONResponse({"status": "ok", "model": self.names[0],
                             "queue": {"running": busy > 0, "waiting": waiting,
                                       "max": self.worker.max_queue},
                             "slots": self.worker.slots, "busy": busy, "queued": waiting})

    async def models(self, request):
        self._auth(request)
        return JSONResponse(models_list(self.names[0], self.created, self.info))

    async def model(self, request):
        self._auth(request)
        name = request.path_params["model_id"]
        if name not in self.names:
            raise ApiError(404, f"The model '{name}' does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(model_card(self.names[0], self.created, self.info))

    async def chat(self, request):
        self._auth(request)
        return await self._generate(request, parse_chat(await self._json(request), self.names))

    async def completions(self, request):
        self._auth(request)
        body = await self._json(request)
        return await self._generate(request, parse_completion(body, self.names,
                                                              self.info["n_vocab"]))

    async def infill(self, request):
        self._auth(request)
        body = await self._json(request)
        return await self._generate(request, parse_infill_request(body, self.names,
                                                                  self.info["n_ctx"]))

    # -- helpers -----------------------------------------------------------------------------
    def _auth(self, request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode("utf-8", "replace"), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' "
                                "with the key the server was started with",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _json(self, request):
        """The body as JSON. One larger than --max-body is still read (and dropped) up to
        DRAIN_LIMIT beyond it, so that a client still sending gets the 413, not a reset."""
        declared = request.headers.get("content-length", "")
        too_large = declared.isdigit() and int(declared) > self.max_body
        data, size = bytearray(), 0
        if not (too_large and int(declared) > self.max_body + DRAIN_LIMIT):
            try:
                async for part in request.stream():
                    size += len(part)
                    too_large = too_large or size > self.max_body
                    if size > self.max_body + DRAIN_LIMIT:
                        break
                    if not too_large:
                        data += part
            except ClientDisconnect:
                raise ApiError(400, "the client left while sending the request") from None
        if too_large:
            raise ApiError(413, f"the request body is larger than {self.max_body} bytes (the "
                                "server's --max-body)", code="request_too_large")
        if not data.strip():
            raise ApiError(400, "the request body is empty: send a JSON object", code="invalid_json")
        try:
            return parse_json(bytes(data))
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}",
                           code="invalid_json") from None

    async def _generate(self, request, req: GenRequest):
        job = Job(req, asyncio.get_running_loop())
        self.worker.submit(job)
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, job, self.worker))
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        try:
            event = await job.events.get()
            if event[0] != "error" and not req.stream:
                while event[0] not in ("done", "error"):
                    event = await job.events.get()
            if event[0] == "error":
                raise event[1]
        except BaseException:
            watcher.cancel()
            job.cancel.set()
            raise
        if not req.stream:
            watcher.cancel()
            if req.kind == "infill":
                return JSONResponse(infill_body(req, event[3], job.queued_ms, self.names[0]))
            return JSONResponse(full_response(req.kind, rid, created, self.names[0], event[1],
                                              event[2], job.queued_ms))
        return EventStream(self._stream(job, watcher, event, rid, created))

    async def _stream(self, job: Job, watcher, event, rid: str, created: int):
        """Server-sent events: pieces as the engine makes them, the closing chunk(s), [DONE]."""
        req, model = job.req, self.names[0]
        usage_on = req.include_usage
        try:
            if req.kind == "chat":
                yield _sse(chunk("chat", rid, created, model, "", first=True, with_usage=usage_on))
            while True:
                if event[0] == "piece":
                    yield _sse(infill_chunk(event[1]) if req.kind == "infill" else
                               chunk(req.kind, rid, created, model, event[1],
                                     with_usage=usage_on))
                elif event[0] == "done" and req.kind == "infill":
                    yield _sse(infill_body(req, event[3], job.queued_ms, model))
                    return
                elif event[0] == "done":
                    for c in closing_chunks(req.kind, rid, created, model, event[2],
                                            job.queued_ms, usage_on):
                        yield _sse(c)
                    yield b"data: [DONE]\n\n"
                    return
                elif event[0] == "error":       # the status line has gone: report in-band
                    yield _sse(event[1].body())
                    return
                event = await job.events.get()
        finally:
            watcher.cancel()
            job.cancel.set()


class EventStream(StreamingResponse):
    """text/event-stream without starlette's own disconnect listener: _watch_disconnect already
    cancels the job, and a send to a client that has gone just ends the stream."""

    def __init__(self, chunks):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for data in self.body_iterator:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass
        finally:
            await self.body_iterator.aclose()


# -- the application ------------------------------------------------------------------------------
async def _api_error(request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request, exc: HTTPException):
    """starlette's own 404/405 in OpenAI's shape."""
    what = f"{request.method} {request.url.path}"
    message = f"no such endpoint: {what}" if exc.status_code == 404 else \
        f"{what} is not allowed here ({exc.detail})"
    return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _crash(request, exc: Exception):
    """A bug in a handler: 500 in OpenAI's shape (uvicorn prints the traceback); serving goes on."""
    err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="server_error")
    return JSONResponse(err.body(), status_code=500)


def build_app(service: Service) -> Starlette:
    """The routes, with and without the /v1 prefix (clients differ on which base URL they take)."""
    routes = [Route("/health", service.health, methods=["GET"])]
    for prefix in ("/v1", ""):
        routes += [
            Route(f"{prefix}/models", service.models, methods=["GET"]),
            Route(prefix + "/models/{model_id:path}", service.model, methods=["GET"]),
            Route(f"{prefix}/chat/completions", service.chat, methods=["POST"]),
            Route(f"{prefix}/completions", service.completions, methods=["POST"]),
            Route(f"{prefix}/infill", service.infill, methods=["POST"]),
        ]
    return Starlette(routes=routes, exception_handlers={
        ApiError: _api_error, HTTPException: _http_error, Exception: _crash})


def serve_http(engines: list, sock, settings: HttpSettings, say=print) -> None:
    """Serve `engines` (one per slot, over one model, their cost curve measured) on the
    listening socket until Ctrl-C/SIGTERM (which cancel running work), then keep the live
    prompt states for the next start."""
    import uvicorn

    engine = engines[0]
    worker = Worker(engines, settings.max_queue)
    service = Service(worker, model_names(settings.model_arg, engine.model.path),
                      {**model_info(engine), **speculation_info(engine), "slots": len(engines)},
                      settings.api_key, settings.max_body)
    config = uvicorn.Config(build_app(service), log_level="warning", access_log=False,
                            lifespan="off", http="h11", ws="none", loop="asyncio",
                            timeout_graceful_shutdown=5)
    server = _server_class(uvicorn)(config, on_exit=worker.cancel_all)
    host, bound = settings.host, sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    slots = f", {len(engines)} slots of {engine.ctx.n_ctx} tokens" if len(engines) > 1 else ""
    say(f"localspec: serving {service.names[0]} at http://{shown}:{bound}/v1 "
        f"(OpenAI-compatible{slots}; Ctrl-C stops)")
    if rpc_attached():                  # a lost server ends this process: answer clients first
        rpc_on_lost(worker.fail_all)
    worker.start()
    ready_signal()
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        for each in engines:
            each.keep_live_state()


def _server_class(uvicorn):
    class _Server(uvicorn.Server):
        """uvicorn's server, which on Ctrl-C/SIGTERM first cancels every generation, so open
        streams end within one step instead of holding the graceful shutdown open."""

        def __init__(self, config, on_exit):
            super().__init__(config)
            self._on_exit = on_exit

        def handle_exit(self, sig, frame):
            self._on_exit()
            super().handle_exit(sig, frame)

    return _Server
