"""The engine side of `localspec serve --http`: one thread per slot (`--parallel N`; one engine
when N is 1) takes the queued jobs in arrival order and runs each to its end, reporting its
events to the event loop (http_server.py streams them). A bounded queue answers 503 with a
Retry-After estimate when full; a lost RPC server ends running and queued jobs with an error
their clients see, and so does shutdown, except that a running non-streamed job returns its text
so far. A job's failure stays its own: the other slots run on.
"""

from __future__ import annotations

import asyncio
import math
import queue
import sys
import threading
import time
import traceback
from dataclasses import replace
from typing import Optional

from ..errors import LocalspecError
from ..speculative.engine import Engine
from ..speculative.stats import GenerationStats
from .fim import Prefill, infill
from .job_queue import JobQueue
from .openai_api import ApiError, GenRequest


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
    """Owns the engines: slot i's thread runs jobs on engines[i], one at a time, taking them
    from one queue in arrival order."""

    def __init__(self, engines: list, max_queue: int):
        self.engines = engines
        self.jobs = JobQueue(len(engines), max_queue)
        self._pending: set = set()          # queued or running, for cancel_all()
        self._lock = threading.Lock()
        self._mean_s = 1.0                  # running mean of a job's duration, for Retry-After
        self.closing = False                # SIGTERM/Ctrl-C seen: no new work
        self.lost: Optional[ApiError] = None    # the engine's RPC server is gone: this error
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True,
                                          name=f"localspec-slot-{i}")
                         for i in range(len(engines))]
        self.max_queue = max_queue

    @property
    def slots(self) -> int:
        return len(self.engines)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`, or answer 503 with a Retry-After estimate when the queue is full: the
        waiting jobs and this one, spread over the slots, at the mean job's duration."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            if self.closing:
                raise shutting_down()
            try:
                self.jobs.put(job)
            except queue.Full:
                wait = math.ceil(self._mean_s * (self.jobs.waiting + 1) / self.slots)
                raise ApiError(503, f"the server is busy: {self.max_queue} requests are already "
                                    "waiting; retry later", code="queue_full",
                               headers={"Retry-After": str(min(60, max(1, wait)))}) from None
            self._pending.add(job)

    def withdraw(self, job: Job) -> None:
        """The client of `job` has left. One still queued leaves the queue now, so /health and
        --queue stop counting it, and ends as cancelled; a running one stops at its next step
        (job.cancel, which the caller has set)."""
        with self._lock:
            if not self.jobs.withdraw(job):
                return
            self._pending.discard(job)
        job.emit("done", "", GenerationStats(stop_reason="cancelled"), None)

    def waiting(self) -> int:
        return self.jobs.waiting

    def busy(self) -> int:
        """Slots running a job now."""
        return self.jobs.busy

    def cancel_all(self) -> None:
        """The server is stopping: refuse new jobs and end the others at once. A queued job
        gets a 503, a running stream an in-band 503 after the text it has sent, and a running
        non-streamed job its answer so far (stop_reason "cancelled"), not a 503 that would
        throw that text away."""
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
        self.jobs.close()                   # after the jobs already queued (each ends at once)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self, slot: int) -> None:
        engine = self.engines[slot]
        while True:
            job = self.jobs.take(slot)
            if job is None:
                return
            try:
                self._run(job, engine)
            finally:
                with self._lock:
                    self._pending.discard(job)
                    self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - job.started)

    def _run(self, job: Job, engine: Engine) -> None:
        job.started = time.monotonic()
        if job.shutdown:
            return job.emit("error", shutting_down())
        if job.cancel.is_set():             # its client left while it waited: never started
            return job.emit("done", "", GenerationStats(stop_reason="cancelled"), None)
        try:
            gen = self._start(job, engine)
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
        if job.shutdown and job.req.stream:     # its text is out: the error says it was cut
            return job.emit("error", shutting_down())
        job.emit("done", gen.text, gen.stats, gen)  # a shutdown's cut: its text, "cancelled"

    def _start(self, job: Job, engine: Engine):
        req = job.req
        policy = None if req.fixed_k is None else \
            replace(engine.config.policy, fixed_k=req.fixed_k)
        if req.fim is not None and req.max_tokens == 0:
            return Prefill(engine, req.fim, job.cancel)
        if req.fim is not None:
            return infill(engine, req.fim, req.sampling, req.speculate, job.cancel, policy)
        tokens = engine.tokenize_prompt(req.prompt)
        where = "messages" if req.kind == "chat" else "prompt"
        if not tokens:
            raise ApiError(400, "the prompt is empty: it has no tokens for this model",
                           param=where, code="invalid_value")
        n_ctx = engine.ctx.n_ctx
        if len(tokens) >= n_ctx:
            more = "--ctx" if self.slots == 1 else \
                f"--ctx or a lower --parallel (each of its {self.slots} slots holds {n_ctx})"
            raise ApiError(400, f"this model's context holds {n_ctx} tokens, but the prompt has "
                                f"{len(tokens)}; shorten it or restart the server with a larger "
                                f"{more}", param=where, code="context_length_exceeded")
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
