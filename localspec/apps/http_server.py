"""`localspec serve --http`: the OpenAI-compatible server (starlette routes on uvicorn). One engine on
its own worker thread runs generations one at a time from a bounded FIFO queue; the async side only
parses requests, queues jobs and streams their pieces. Request/response shapes: openai_api.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import queue
import sys
import threading
import time
import traceback
import uuid
from dataclasses import replace
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..spec.engine import Engine
from ..errors import LocalspecError
from ..llama.rpc import attached as rpc_attached, on_lost as rpc_on_lost
from ..spec.fim import infill
from .supervise import ready_signal
from .checks import model_info, no_constants, speculation_info
from .infill_api import infill_body, infill_chunk, parse_infill_request
from .openai_api import (ApiError, GenRequest, HttpSettings, chunk, closing_chunks, full_response,
                         model_card, model_names, models_list, parse_chat, parse_completion)
from ..spec.stats import GenerationStats

DRAIN_LIMIT = 64 << 20     # bytes of an oversized body read and dropped before the 413



# -- the engine side ------------------------------------------------------------------------------
class Job:
    """One request on its way through the queue. The worker thread reports to the event loop
    with emit(): ("start",), ("piece", text), ("done", text, stats) or ("error", ApiError)."""

    def __init__(self, req: GenRequest, loop: asyncio.AbstractEventLoop):
        self.req, self.loop = req, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.admitted = time.monotonic()
        self.started: Optional[float] = None
        self.shutdown = False           # cancelled because the server is stopping

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:            # the event loop has closed (shutdown): nobody listens
            self.cancel.set()

    @property
    def queued_ms(self) -> float:
        return 1000 * ((self.started or time.monotonic()) - self.admitted)


class Worker:
    """Owns the engine: one thread takes jobs in arrival order and runs each to its end."""

    def __init__(self, engine: Engine, max_queue: int):
        self.engine = engine
        self._queue: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=max_queue)
        self._pending: set = set()          # queued or running, for cancel_all()
        self._lock = threading.Lock()
        self._mean_s = 1.0                  # running mean of a job's duration, for Retry-After
        self._running = False
        self.closing = False                # SIGTERM/Ctrl-C seen: no new work
        self.lost: Optional[ApiError] = None    # the engine's RPC server is gone: this error
        self._thread = threading.Thread(target=self._loop, name="localspec-engine", daemon=True)
        self.max_queue = max_queue

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`, or answer 503 with a Retry-After estimate when the queue is full."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            if self.closing:
                raise shutting_down()
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                wait = math.ceil(self._mean_s * (self._queue.qsize() + 1))
                raise ApiError(503, f"the server is busy: {self.max_queue} requests are already "
                                    "waiting; retry later", code="queue_full",
                               headers={"Retry-After": str(min(60, max(1, wait)))}) from None
            self._pending.add(job)

    def waiting(self) -> int:
        return self._queue.qsize()

    def busy(self) -> bool:
        return self._running

    def cancel_all(self) -> None:
        """The server is stopping: refuse new jobs; queued and running ones end at once with a
        503 their clients see (in-band on a stream), never as a finished answer."""
        with self._lock:
            self.closing = True
            for job in self._pending:
                job.shutdown = True
                job.cancel.set()

    def fail_all(self, why: str, wait_s: float = 2.0) -> None:
        """The engine is lost (its RPC server): running and queued jobs, and any that arrive
        now, end with a 503 that says why, sent by the event loop while this thread waits; then
        the process may end (`serve --http --rpc` starts another)."""
        error = ApiError(503, f"{why} The engine is restarting.", code="backend_unavailable",
                         headers={"Retry-After": "2"})
        with self._lock:
            self.lost = error
            jobs = list(self._pending)
        for job in jobs:
            job.emit("error", error)
        time.sleep(wait_s if jobs else 0)

    def stop(self, timeout: float = 30.0) -> None:
        self.cancel_all()
        self._queue.put(None)               # after the jobs already queued (each ends at once)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._running = True
            try:
                self._run(job)
            finally:
                self._running = False
                with self._lock:
                    self._pending.discard(job)
                self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - job.started)

    def _run(self, job: Job) -> None:
        job.started = time.monotonic()
        if job.shutdown:
            return job.emit("error", shutting_down())
        if job.cancel.is_set():             # its client left while it waited: never started
            return job.emit("done", "", GenerationStats(stop_reason="cancelled"), None)
        try:
            gen = self._start(job)
        except ApiError as e:
            return job.emit("error", e)
        except LocalspecError as e:         # the request cannot run: say why (no chat template...)
            return job.emit("error", ApiError(400, str(e)))
        except Exception as e:              # a bug: traceback on stderr, 500, keep serving
            return job.emit("error", internal_error(e))
        job.emit("start")
        try:
            for piece in gen:
                job.emit("piece", piece)
        except Exception as e:
            return job.emit("error", internal_error(e))
        if job.shutdown:                    # cut short: not an answer that merely ended early
            return job.emit("error", shutting_down())
        job.emit("done", gen.text, gen.stats, gen)

    def _start(self, job: Job):
        req, engine = job.req, self.engine
        policy = None if req.fixed_k is None else \
            replace(engine.config.policy, fixed_k=req.fixed_k)
        if req.fim is not None:
            return infill(engine, req.fim, req.sampling, req.speculate, job.cancel, policy)
        tokens = engine.tokenize_prompt(req.prompt)
        where = "messages" if req.kind == "chat" else "prompt"
        if not tokens:
            raise ApiError(400, "the prompt is empty: it has no tokens for this model",
                           param=where, code="invalid_value")
        n_ctx = engine.ctx.n_ctx
        if len(tokens) >= n_ctx:
            raise ApiError(400, f"this model's context holds {n_ctx} tokens, but the prompt has "
                                f"{len(tokens)}; shorten it or restart the server with a larger "
                                "--ctx", param=where, code="context_length_exceeded")
        return engine.generate(tokens, req.sampling, max_tokens=req.max_tokens or n_ctx,
                               stop=req.stop, document=req.document, speculate=req.speculate,
                               cancel=job.cancel, policy=policy)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; this request was not completed",
                    code="server_shutting_down")


def internal_error(e: Exception) -> ApiError:
    if not isinstance(e, LocalspecError):
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    return ApiError(500, f"the generation failed: {type(e).__name__}: {e}", code="server_error")


# -- the HTTP side --------------------------------------------------------------------------------
def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _watch_disconnect(receive, job: Job) -> None:
    """Cancel `job` as soon as its client hangs up; the engine checks the flag every step."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel.set()
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
        return JSONResponse({"status": "ok", "model": self.names[0],
                             "queue": {"running": self.worker.busy(),
                                       "waiting": self.worker.waiting(),
                                       "max": self.worker.max_queue}})

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
            return json.loads(bytes(data), parse_constant=no_constants)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}",
                           code="invalid_json") from None

    async def _generate(self, request, req: GenRequest):
        job = Job(req, asyncio.get_running_loop())
        self.worker.submit(job)
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, job))
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


def serve_http(engine: Engine, sock, settings: HttpSettings, say=print) -> None:
    """Serve `engine` on the listening socket until Ctrl-C/SIGTERM (which cancel running work),
    then keep the live prompt state for the next start."""
    import uvicorn

    engine.prepare()      # calibrate now, not inside the first request
    worker = Worker(engine, settings.max_queue)
    service = Service(worker, model_names(settings.model_arg, engine.model.path),
                      {**model_info(engine), **speculation_info(engine)}, settings.api_key,
                      settings.max_body)
    config = uvicorn.Config(build_app(service), log_level="warning", access_log=False,
                            lifespan="off", http="h11", ws="none", loop="asyncio",
                            timeout_graceful_shutdown=5)
    server = _server_class(uvicorn)(config, on_exit=worker.cancel_all)
    host, bound = settings.host, sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    say(f"localspec: serving {service.names[0]} at http://{shown}:{bound}/v1 "
        "(OpenAI-compatible; Ctrl-C stops)")
    if rpc_attached():                  # a lost server ends this process: answer clients first
        rpc_on_lost(worker.fail_all)
    worker.start()
    ready_signal()
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        engine.keep_live_state()


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
