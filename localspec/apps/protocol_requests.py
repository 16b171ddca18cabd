"""The editor protocol's requests as data: the JSON-RPC envelope and its error codes, and the
params of `generate`, `complete`, `prefill` and `rewrite` checked into a Job (the field rules are
checks.py's, shared with HTTP). What runs the jobs is protocol.py; docs/protocol.md specifies.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ..speculative.engine import Prompt
from ..speculative.sampling import SamplingParams
from .checks import Checks, parse_json
from .completion import COMPLETE_PARAMS, REWRITE_PARAMS, parse_complete, parse_rewrite
from .edit import PROTOCOL, Rewrite
from .fim import Prefill, infill

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND = -32700, -32600, -32601
INVALID_PARAMS, INTERNAL_ERROR, GENERATION_ERROR = -32602, -32603, -32000
DEFAULT_MAX_TOKENS = 256
GENERATE_PARAMS = ("prompt", "messages", "max_tokens", "temperature", "top_k", "top_p", "min_p",
                   "repeat_penalty", "seed", "stop", "document", "speculate", "stream", "k",
                   "heal")
NOTE = object()                    # the "id" of a notification: it never gets a response

RequestId = Union[int, str]


class RpcError(Exception):
    """A JSON-RPC error response; `id` is the request id to answer (None when unknown)."""

    def __init__(self, code: int, message: str, id: Optional[RequestId] = None):
        super().__init__(message)
        self.code, self.message, self.id = code, message, id


class DuplicateId(RpcError):
    """A generate whose id an unfinished generate holds: the error response carries id null, so
    a client routing responses by id cannot mistake it for the running request's answer."""



@dataclass
class Job:
    """One generate request, queued or running. `cancel` is the engine's per-step stop flag."""

    id: RequestId
    prompt: Prompt
    sampling: SamplingParams
    max_tokens: int
    stop: list
    document: Optional[str]
    speculate: bool
    stream: bool
    fixed_k: Optional[int] = None        # draft exactly k tokens per step (None: adaptive)
    kind: str = "generate"               # or "complete", "prefill", "rewrite": `task` runs it
    task: Optional[Callable] = None      # (engine, job, policy) -> the running task
    cancel: threading.Event = field(default_factory=threading.Event)
    heal: bool = False                   # a raw prompt ending inside a token: heal it (heal.py)
    started: bool = False                # a slot has taken it (for `status`)


# -- params --------------------------------------------------------------------------------------
CHECK = Checks(lambda field, message: RpcError(INVALID_PARAMS, message))


def _prompt(params: dict) -> Prompt:
    if ("prompt" in params) == ("messages" in params):
        raise RpcError(INVALID_PARAMS, "give exactly one of 'prompt' (a string) or 'messages' "
                                       "(a list of {role, content})")
    if "prompt" in params:
        return CHECK.text(params["prompt"], "prompt")
    return CHECK.messages(params["messages"])       # the same rules as HTTP's chat


def parse_generate(rid: RequestId, params) -> Job:
    """Validate generate params into a Job; any problem is -32602 naming the field."""
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, "generate takes params as an object")
    unknown = sorted(set(params) - set(GENERATE_PARAMS))
    if unknown:
        raise RpcError(INVALID_PARAMS, f"unknown parameter '{unknown[0]}' (generate accepts: "
                                       f"{', '.join(GENERATE_PARAMS)})")
    prompt, sampling = _prompt(params), CHECK.sampling(params)
    stop = list(CHECK.stop(params))
    document = params.get("document")
    heal = CHECK.flag(params, "heal", False)
    if heal and not isinstance(prompt, str):
        raise RpcError(INVALID_PARAMS, "'heal' applies to a raw 'prompt' (text that ends where "
                                       "the completion goes on), not to 'messages'")
    return Job(rid, prompt, sampling, heal=heal,
               max_tokens=CHECK.number(params, "max_tokens", DEFAULT_MAX_TOKENS, 1, integer=True),
               stop=stop, document=None if document is None else CHECK.text(document, "document"),
               speculate=CHECK.flag(params, "speculate", True),
               stream=CHECK.flag(params, "stream", True), fixed_k=CHECK.draft_length(params, "k"))


def parse_task(rid: RequestId, method: str, params) -> Job:
    """Validate `complete` or `rewrite` params into a Job (docs/protocol.md)."""
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, f"{method} takes params as an object")
    allowed = REWRITE_PARAMS if method == "rewrite" else COMPLETE_PARAMS
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise RpcError(INVALID_PARAMS, f"unknown parameter '{unknown[0]}' ({method} accepts: "
                                       f"{', '.join(allowed)})")
    sampling = CHECK.sampling(params)
    if method == "complete":
        fim = parse_complete(CHECK, params)
        task = lambda engine, job, policy: infill(  # noqa: E731
            engine, fim, sampling, job.speculate, job.cancel, policy)
    elif method == "prefill":               # the buffer of a later `complete`, read ahead
        fim = parse_complete(CHECK, params)
        task = lambda engine, job, policy: Prefill(engine, fim, job.cancel)  # noqa: E731
    else:
        rw = parse_rewrite(CHECK, params)
        task = lambda engine, job, policy: Rewrite(  # noqa: E731
            engine, rw["instruction"], rw["text"], rw["region"], rw["filename"], sampling,
            rw["max_tokens"], job.speculate, job.cancel, policy, wording=PROTOCOL)
    return Job(rid, "", sampling, 0, [], None, speculate=CHECK.flag(params, "speculate", True),
               stream=CHECK.flag(params, "stream", True), fixed_k=CHECK.draft_length(params, "k"),
               kind=method, task=task)


def parse_envelope(line: bytes):
    """One stdin line -> (id, method, params); id is NOTE for a notification.

    Example: b'{"jsonrpc":"2.0","id":7,"method":"cancel","params":{"id":3}}'
    -> (7, "cancel", {"id": 3}). Raises RpcError carrying the id to answer with (None if unknown).
    """
    try:
        msg = parse_json(line)
    except ValueError as e:
        raise RpcError(PARSE_ERROR, f"parse error: {e}") from None
    if not isinstance(msg, dict):
        what = "batches (arrays) are not supported" if isinstance(msg, list) else \
            "a message must be a JSON object"
        raise RpcError(INVALID_REQUEST, f"invalid request: {what}")
    rid = msg.get("id", NOTE)
    if rid is not NOTE and (isinstance(rid, bool) or not isinstance(rid, (int, str))):
        raise RpcError(INVALID_REQUEST, "invalid request: 'id' must be a string or an integer")
    err = None
    if msg.get("jsonrpc") != "2.0":
        err = "'jsonrpc' must be \"2.0\""
    elif not isinstance(msg.get("method"), str):
        err = "'method' must be a string" if "method" in msg else "'method' is missing"
    elif not isinstance(msg.get("params", {}), (dict, list)):
        err = "'params' must be an object"
    if err:
        raise RpcError(INVALID_REQUEST, f"invalid request: {err}", None if rid is NOTE else rid)
    return rid, msg["method"], msg.get("params", {})
