"""The editor protocol's server: the request table and queue, the slot threads that run the
engines, and the responses. Messages and params as data are protocol_requests.py, the transport
(lines on stdio) stdio.py, the command cli/serve.py.

A reader thread parses incoming lines and answers `initialize`, `status`, `cancel` and
`shutdown` at once; generation requests queue for the slots (`--parallel N`: N engines over one
model, each running one request at a time; slot 0 runs on the caller of Server.serve), and
start in arrival order. docs/protocol.md is the specification; examples/editor_client.py a
client.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import replace
from typing import Iterable, Optional

from .. import __version__
from ..speculative.engine import Engine
from ..errors import LocalspecError
from ..files import internal_error_line
from ..speculative.sampling import SamplingParams
from ..speculative.stats import GenerationStats
from .checks import model_info, speculation_info
from .heal import Healed
from .job_queue import JobQueue
from .protocol_requests import (DEFAULT_MAX_TOKENS, GENERATION_ERROR, INTERNAL_ERROR,
                                INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, NOTE,
                                DuplicateId, Job, RpcError, parse_envelope, parse_generate,
                                parse_task)

PROTOCOL_VERSION = 1
PROGRESS = "generate/progress"     # notification method carrying streamed text
METHODS = ("initialize", "generate", "complete", "prefill", "rewrite", "cancel", "status",
           "shutdown")
DEFERRED = object()                # a handler's result: the worker responds later


def _bug(e: Exception) -> str:
    """One stderr line for a bug (the traceback goes to a file) and the message for the client."""
    line = internal_error_line(e)
    print(f"localspec: {line}", file=sys.stderr)
    return line


def answer(job: Job, gen) -> dict:
    """The response of a finished job: the text and statistics, and what its kind adds."""
    if job.kind == "complete":
        return {**result(gen.text, gen.stats), "finish_reason": gen.finish_reason,
                "truncated": gen.truncated, "note": gen.note}
    if job.kind == "prefill":
        return gen.result
    if job.kind == "rewrite":           # the cleaned rewrite, or a LocalspecError
        return result(gen.result(), gen.stats)
    return result(gen.text, gen.stats)


# -- the server ----------------------------------------------------------------------------------
class Server:
    """Owns the request queue and the table of unfinished requests. Only slot i's thread uses
    engines[i]; the reader thread touches the queue, the table and the writer (anything with
    send(message) -> bool, False once the client is gone: stdio.Writer)."""

    def __init__(self, engines: list, writer):
        self.engines, self.writer = engines, writer
        self._queue = JobQueue(len(engines))
        self._jobs: dict = {}               # request id -> Job, queued or running
        self._lock = threading.RLock()      # guards _jobs, _closing and _stop_id
        self._closing = False
        self._stop_id = NOTE                # the `shutdown` to answer last (NOTE: EOF, none)
        self._info = describe(engines[0], len(engines))   # the reader never calls an engine

    def serve(self, lines: Iterable[bytes]) -> None:
        """Read `lines` on a daemon thread; run generations on slot 0 here and on the other
        slots' threads until shutdown or EOF, then answer the `shutdown` (the last message)."""
        threading.Thread(target=self._read, args=(lines,), name="localspec-stdin",
                         daemon=True).start()
        others = [threading.Thread(target=self._slot, args=(i,), name=f"localspec-slot-{i}",
                                   daemon=True) for i in range(1, len(self.engines))]
        for thread in others:
            thread.start()
        self._slot(0)
        for thread in others:
            thread.join()
        if self._stop_id is not NOTE:
            self._send({"jsonrpc": "2.0", "id": self._stop_id, "result": None})

    def _slot(self, slot: int) -> None:
        while True:
            job = self._queue.take(slot)
            if job is None:
                return
            self._run(job, self.engines[slot])

    # -- reader thread ---------------------------------------------------------------------------
    def _read(self, lines: Iterable[bytes]) -> None:
        try:
            for line in lines:
                if line.strip() and not self.handle_line(line):
                    return                  # shutdown received: stop reading
        finally:
            self._stop(NOTE)                # EOF (or a bug here): finish like a silent shutdown

    def handle_line(self, line: bytes) -> bool:
        """Handle one message; False after `shutdown`."""
        try:
            rid, method, params = parse_envelope(line)
        except RpcError as e:
            self._error(e.id, e.code, e.message)
            return True
        if rid is NOTE and method not in ("cancel", "shutdown"):
            return True                     # other notifications are accepted and ignored
        handler = {"initialize": self._initialize, "generate": self._generate,
                   "complete": self._task, "prefill": self._task, "rewrite": self._task,
                   "cancel": self._cancel, "status": self._status,
                   "shutdown": self._stop_request}.get(method)
        try:
            if handler is None:
                raise RpcError(METHOD_NOT_FOUND, f"unknown method '{method}' (this server has: "
                                                 f"{', '.join(METHODS)})")
            result = handler(rid, params, method) if handler == self._task else \
                handler(rid, params)
        except Exception as e:
            if not isinstance(e, RpcError):     # a bug: say so on stderr, keep serving
                e = RpcError(INTERNAL_ERROR, _bug(e))
            if rid is not NOTE:
                self._error(None if isinstance(e, DuplicateId) else rid, e.code, e.message)
            return True
        if result is not DEFERRED and rid is not NOTE:
            self._send({"jsonrpc": "2.0", "id": rid, "result": result})
        return method != "shutdown"

    def _initialize(self, rid, params) -> dict:
        return self._info

    def _generate(self, rid, params, job: Optional[Job] = None):
        job = job or parse_generate(rid, params)
        with self._lock:                    # queued before a `shutdown` can close the queue
            self._admissible(rid)
            self._jobs[rid] = job
            self._queue.put(job)
        return DEFERRED

    def _task(self, rid, params, method: str):
        """A completion replaces any earlier completion or prefill still queued or running
        (the cursor moved; the chunks a prefill has read stay in the KV cache, so the new
        prompt reuses them where it shares them), and a prefill any earlier prefill. A refused
        request (a bad or duplicate id, shutting down) changes nothing."""
        job = parse_task(rid, method, params)
        replaces = {"complete": ("complete", "prefill"), "prefill": ("prefill",)}.get(method, ())
        with self._lock:                    # the checks and the cancel as one step
            self._admissible(rid)
            skipped = [other for other in list(self._jobs.values())
                       if other.kind in replaces and self._cancel_job(other)]
            done = self._generate(rid, params, job)
        for other in skipped:
            self._finish(other, cancelled_answer(other))
        return done

    def _admissible(self, rid) -> None:
        """Raise the error a new request with this id gets, if any (call under the lock)."""
        if self._closing:
            raise RpcError(GENERATION_ERROR, "the server is shutting down")
        if rid in self._jobs:          # answered with id null: that id is the running one's
            raise DuplicateId(INVALID_REQUEST, f"request id {json.dumps(rid)} is already "
                                               "used by an unfinished request")

    def _cancel(self, rid, params) -> dict:
        target = params.get("id") if isinstance(params, dict) else None
        if isinstance(target, bool) or not isinstance(target, (int, str)):
            raise RpcError(INVALID_PARAMS, "'id' must be the string or integer id of a generate "
                                           "request")
        with self._lock:
            job = self._jobs.get(target)
            skipped = job is not None and self._cancel_job(job)
        if not skipped:
            return {"cancelled": job is not None}
        if rid is not NOTE:                 # this answer first, then the request's, as before
            self._send({"jsonrpc": "2.0", "id": rid, "result": {"cancelled": True}})
        self._finish(job, cancelled_answer(job))
        return DEFERRED

    def _cancel_job(self, job: Job) -> bool:
        """Set `job`'s stop flag; True when it was still queued and has left the queue (the
        caller answers it, outside the lock), so that `status` no longer lists it as waiting."""
        job.cancel.set()
        return self._queue.withdraw(job)

    def _status(self, rid, params) -> dict:
        """What runs and waits now: the slots, how many are busy, the queue, the requests' ids
        (unanswered ones only: a request is off the table before its answer is sent)."""
        with self._lock:
            jobs = list(self._jobs.values())        # in arrival order
        running = [job.id for job in jobs if job.started]
        waiting = [job.id for job in jobs if not job.started]
        return {"slots": len(self.engines), "busy": len(running), "queued": len(waiting),
                "running": running, "waiting": waiting}

    def _stop_request(self, rid, params):
        self._stop(rid)
        return DEFERRED

    def _stop(self, rid) -> None:
        """Cancel everything unfinished; the slots answer those, then serve() answers `rid`
        and returns."""
        with self._lock:
            if self._closing:
                return
            self._closing, self._stop_id = True, rid
            for job in self._jobs.values():
                job.cancel.set()
        self._queue.close()

    # -- slots -----------------------------------------------------------------------------------
    def _run(self, job: Job, engine: Engine) -> None:
        job.started = True
        if job.cancel.is_set():             # cancelled while queued: never started
            return self._finish(job, cancelled_answer(job))
        policy = None if job.fixed_k is None else \
            replace(engine.config.policy, fixed_k=job.fixed_k)
        try:
            if job.task is not None:
                gen = job.task(engine, job, policy)
            elif job.heal:
                gen = Healed(engine, self._tokens(job, engine), _text_start(engine), job.sampling,
                             max_tokens=job.max_tokens, cancel=job.cancel, stop=job.stop,
                             document=job.document, speculate=job.speculate, policy=policy)
            else:
                gen = engine.generate(self._tokens(job, engine), job.sampling,
                                           max_tokens=job.max_tokens,
                                           stop=job.stop, document=job.document,
                                           speculate=job.speculate, cancel=job.cancel,
                                           policy=policy)
            for piece in gen:
                if job.stream:
                    self._send({"jsonrpc": "2.0", "method": PROGRESS,
                                "params": {"id": job.id, "text": piece}})
            done = answer(job, gen)
        except LocalspecError as e:
            return self._finish(job, error=(GENERATION_ERROR, str(e)))
        except Exception as e:              # a bug: say so on stderr, keep serving
            return self._finish(job, error=(INTERNAL_ERROR, _bug(e)))
        self._finish(job, done)

    def _tokens(self, job: Job, engine: Engine) -> list:
        """The prompt's tokens, or the error a client can act on (its fields, not our flags)."""
        tokens = engine.tokenize_prompt(job.prompt)
        where = "'messages'" if isinstance(job.prompt, list) else "'prompt'"
        if not tokens:
            raise LocalspecError(f"the prompt is empty: {where} has no tokens for this model.")
        n_ctx, n_train = engine.ctx.n_ctx, engine.model.n_ctx_train
        if len(tokens) >= n_ctx:
            more = "--ctx" if len(self.engines) == 1 else \
                f"--ctx or a lower --parallel (each of its {len(self.engines)} slots holds {n_ctx})"
            raise LocalspecError(
                f"the prompt is {len(tokens)} tokens but the server's context holds {n_ctx}; "
                f"shorten {where}, or start the server with a larger {more} (the model was "
                f"trained on {n_train}).")
        return tokens

    def _finish(self, job: Job, result=None, error=None) -> None:
        with self._lock:                    # from here on, cancel answers {"cancelled": false}
            self._jobs.pop(job.id, None)
        if error:
            self._error(job.id, *error)
        else:
            self._send({"jsonrpc": "2.0", "id": job.id, "result": result})

    # -- output ----------------------------------------------------------------------------------
    def _error(self, rid, code: int, message: str) -> None:
        self._send({"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}})

    def _send(self, msg: dict) -> None:
        if not self.writer.send(msg):
            self._stop(NOTE)                # the client is gone: stop work and exit


def cancelled_answer(job: Job) -> dict:
    """The response of a job cancelled before it started."""
    return {"cancelled": True} if job.kind == "prefill" else \
        result("", GenerationStats(stop_reason="cancelled"))


def result(text: str, stats: GenerationStats) -> dict:
    """The generate result; times rounded to the microsecond."""
    d = {k: round(v, 3) if isinstance(v, float) else v for k, v in stats.to_dict().items()}
    return {"text": text, "finish_reason": stats.stop_reason, "stats": d}


def _text_start(engine: Engine) -> int:
    """Where a raw prompt's text begins in its tokens (after BOS)."""
    model = engine.model
    return 1 if model.add_bos and model.bos >= 0 else 0


def describe(engine: Engine, slots: int = 1) -> dict:
    """The `initialize` result (`model.n_ctx` is what one request may use: a slot's context)."""
    d = SamplingParams()
    return {
        "protocol_version": PROTOCOL_VERSION,
        "server": {"name": "localspec", "version": __version__},
        "model": model_info(engine),
        "capabilities": {"streaming": True, "cancel": True, "document": True, "slots": slots,
                         "complete": engine.model.fim_tokens() is not None,
                         "messages": engine.model.chat_template() is not None,
                         **speculation_info(engine)},
        "defaults": {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": d.temperature,
                     "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                     "repeat_penalty": d.repeat_penalty, "speculate": True, "stream": True},
    }
