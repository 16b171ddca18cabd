"""Request checks shared by the front ends that take JSON (the editor protocol and the HTTP API):
the one JSON parser (no NaN/Infinity, bounded nesting), numbers in range, Unicode text,
true/false flags, the sampling fields, stop strings, chat messages, a draft length within
K_LIMIT, and what a client is told about the model. Each front end passes the exception it
answers with; the rules and their messages live here once, so both refuse the same requests
with the same words.
"""

from __future__ import annotations

import json
import math
from typing import Callable, Optional

from ..policy.config import K_LIMIT
from ..speculative.config import PROPOSERS
from ..speculative.sampling import SamplingParams

Fail = Callable[[str, str], Exception]    # (field, message) -> the front end's error
MAX_DEPTH = 100     # arrays/objects inside each other; requests need ~10, recursion dies at ~1000
MAX_STOPS = 16
# A message's role as sent -> as the chat template takes it ("developer" is OpenAI's newer name).
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def no_constants(name: str):
    """json.loads(parse_constant=...): NaN, Infinity and -Infinity are not JSON."""
    raise ValueError(f"{name} is not valid JSON")


def parse_json(data):
    """A request's JSON (bytes or str) -> its value; ValueError (UnicodeDecodeError is one) for
    anything that is not JSON we take: not UTF-8, NaN/Infinity, or nested deeper than MAX_DEPTH.
    json recurses per level, so 5000 '[' would otherwise end the reading thread with a
    RecursionError, and a value nested just below that would reach code that recurses again.

    Example: parse_json(b"[" * 5000) raises ValueError("... nested deeper than 100 levels").
    """
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    deep = ValueError(f"arrays and objects are nested deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise deep from None
    stack = [(value, 1)]               # walked without recursion: the depth is the question
    while stack:
        node, level = stack.pop()
        if level > MAX_DEPTH:
            raise deep
        children = node.values() if isinstance(node, dict) else \
            node if isinstance(node, list) else ()
        stack.extend((child, level + 1) for child in children
                     if isinstance(child, (dict, list)))
    return value


def number_problem(v, lo=None, hi=None, integer=False, lo_open=False) -> Optional[str]:
    """What is wrong with `v` as a number of this range ("must be ..."), or None. The one rule
    for numbers from JSON requests and command-line options alike: finite, in range.

    Example: number_problem(float("nan"), 0.0) == "must be a finite number".
    """
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) \
            or not math.isfinite(v):
        return "must be an integer" if integer else "must be a finite number"
    if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        return f"must be between {lo} and {hi}" if hi is not None else \
            f"must be {'above' if lo_open else 'at least'} {lo}"
    return None


class Checks:
    """One front end's field checks. `null_is_absent`: a field sent as null takes its default
    (OpenAI's convention); otherwise null is a wrong type like any other.

    Example: number({"top_p": 2}, "top_p", 0.95, 0.0, 1.0) raises fail("top_p", "'top_p' must
    be between 0.0 and 1.0, got 2").
    """

    def __init__(self, fail: Fail, null_is_absent: bool = False):
        self.fail, self.null_is_absent = fail, null_is_absent

    def _absent(self, params: dict, name: str) -> bool:
        return name not in params or (self.null_is_absent and params[name] is None)

    def number(self, params: dict, name: str, default, lo=None, hi=None, integer=False,
               lo_open=False):
        """params[name] as a finite number (an integer if `integer`) in range, or `default`."""
        if self._absent(params, name):
            return default
        v = params[name]
        problem = number_problem(v, lo, hi, integer, lo_open)
        if problem:
            raise self.fail(name, f"'{name}' {problem}, got {json.dumps(v)}")
        return v

    def text(self, value, name: str) -> str:
        if not isinstance(value, str):
            raise self.fail(name, f"'{name}' must be a string")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:   # a lone surrogate escape such as "\ud800"
            raise self.fail(name, f"'{name}' contains an unpaired surrogate (not valid "
                                  "Unicode text)") from None
        return value

    def flag(self, params: dict, name: str, default: bool) -> bool:
        if self._absent(params, name):
            return default
        if not isinstance(params[name], bool):
            raise self.fail(name, f"'{name}' must be true or false")
        return params[name]

    def seed(self, params: dict, name: str = "seed") -> Optional[int]:
        v = params.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise self.fail(name, f"'{name}' must be an integer or null")
        return v

    def sampling(self, params: dict, temperature_max: Optional[float] = None) -> SamplingParams:
        """The sampler chain's fields, each checked, with SamplingParams' defaults."""
        d = SamplingParams()
        return SamplingParams(
            temperature=self.number(params, "temperature", d.temperature, 0.0, temperature_max),
            top_k=self.number(params, "top_k", d.top_k, 0, integer=True),
            top_p=self.number(params, "top_p", d.top_p, 0.0, 1.0),
            min_p=self.number(params, "min_p", d.min_p, 0.0, 1.0),
            repeat_penalty=self.number(params, "repeat_penalty", d.repeat_penalty, 0.0,
                                       lo_open=True),
            seed=self.seed(params))

    def stop(self, params: dict) -> tuple:
        """`stop`: one string or a list of at most MAX_STOPS, none of them empty (an empty one
        would stop before the first token).

        Example: stop({"stop": [""]}) raises fail("stop", "'stop' strings must not be empty").
        """
        if self._absent(params, "stop"):
            return ()
        value = params["stop"]
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list):
            raise self.fail("stop", "'stop' must be a string or a list of strings")
        if len(stops) > MAX_STOPS:
            raise self.fail("stop", f"'stop' takes at most {MAX_STOPS} strings")
        out = tuple(self.text(s, f"stop[{i}]" if stops is value else "stop")
                    for i, s in enumerate(stops))
        if any(s == "" for s in out):
            raise self.fail("stop", "'stop' strings must not be empty")
        return out

    def content(self, content, name: str) -> str:
        """A message's content: a string, or a list of text parts (what newer clients send)."""
        if isinstance(content, str):
            return self.text(content, name)
        if not isinstance(content, list):
            raise self.fail(name, f"'{name}' must be a string or a list of text parts")
        texts = []
        for j, part in enumerate(content):
            where = f"{name}[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                raise self.fail(where, f"'{where}': only text parts are supported "
                                       "({\"type\": \"text\", \"text\": ...})")
            texts.append(self.text(part.get("text"), f"{where}.text"))
        return "".join(texts)

    def messages(self, messages) -> list:
        """Chat `messages` -> [{role, content}] with the roles the chat template takes.

        Example: messages([{"role": "x", "content": "hi"}]) raises fail("messages[0].role",
        "'messages[0].role' must be one of system, developer, user, assistant (...), got 'x'").
        """
        if not isinstance(messages, list) or not messages:
            raise self.fail("messages", "'messages' must be a non-empty list of {role, content} "
                                        "objects")
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise self.fail(where, f"'{where}' must be an object with 'role' and 'content'")
            role = m.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise self.fail(f"{where}.role", f"'{where}.role' must be one of "
                                                 f"{', '.join(ROLES)} (tools are not "
                                                 f"supported), got {role!r}")
            if m.get("tool_calls"):
                raise self.fail(f"{where}.tool_calls", "tool calls are not supported by this "
                                                       "server")
            content = m.get("content")
            if content is None and role == "assistant":
                content = ""
            out.append({"role": ROLES[role], "content": self.content(content, f"{where}.content")})
        return out

    def draft_length(self, params: dict, name: str) -> Optional[int]:
        """A fixed number of drafts per step (None: adaptive), at most K_LIMIT: a longer one is
        an error, never a silent cap."""
        if params.get(name) is None:
            return None
        return self.number(params, name, None, 0, K_LIMIT, integer=True)


def model_info(engine) -> dict:
    """What a client is told about the served model."""
    model = engine.model
    return {"path": str(model.path), "description": model.describe(),
            "n_ctx": engine.ctx.n_ctx, "n_ctx_train": model.n_ctx_train,
            "n_vocab": model.n_vocab, "chat_template": model.chat_template() is not None}


def speculation_info(engine) -> dict:
    """How the server speculates: its --proposer, what drafts tokens, the draft length."""
    cfg = engine.config
    return {"proposer": cfg.proposer, "proposers": list(PROPOSERS[cfg.proposer]),
            "k_max": cfg.policy.k_max, "fixed_k": cfg.policy.fixed_k}
