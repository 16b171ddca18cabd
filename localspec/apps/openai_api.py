"""The OpenAI-compatible API of `serve --http` as pure functions: request bodies -> GenRequest,
generation results -> response and stream-chunk bodies, and OpenAI-shaped errors. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

from ..errors import LocalspecError
from ..speculative.sampling import SamplingParams
from ..speculative.stats import GenerationStats
from .checks import Checks

# Accepted and ignored: they change nothing a local single-model server could honour.
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier", "reasoning_effort", "verbosity")
# Accepted only at their neutral value (the check names the value); anything else is a 400.
NEUTRAL = {
    "n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "suffix": ("",),
    "logit_bias": ({},), "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
    "function_call": ("none", "auto"), "modalities": (["text"],), "audio": (),
    "response_format": ({"type": "text"},), "web_search_options": (),
}
CHAT_NEUTRAL = ("n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
                "logit_bias", "tools", "tool_choice", "functions", "function_call", "modalities",
                "audio", "response_format", "web_search_options")
TEXT_NEUTRAL = ("n", "best_of", "presence_penalty", "frequency_penalty", "logprobs", "echo",
                "suffix", "logit_bias")
COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
          "stream_options", "top_k", "min_p", "repeat_penalty", "localspec")
EXTENSION = ("document", "speculate", "k")      # inside "localspec": {...}


DEFAULT_MAX_BODY = 8 << 20   # bytes: a request carrying a whole source file as its document fits
DEFAULT_QUEUE = 16           # requests waiting behind the running one


@dataclass(frozen=True)
class HttpSettings:
    """What `serve --http` was told besides the engine's settings (checked where the command
    line enters; docs/http.md)."""

    host: str = "127.0.0.1"
    port: int = 0
    api_key: Optional[str] = None        # require "Authorization: Bearer KEY" (None: open)
    max_body: int = DEFAULT_MAX_BODY     # bytes; larger request bodies are a 413
    max_queue: int = DEFAULT_QUEUE       # requests waiting behind the running one; more: 503
    model_arg: str = "default"           # how the model was named: the id clients send

    def __post_init__(self):
        problem = api_key_problem(self.api_key)
        if problem:
            raise LocalspecError(f"--api-key / LOCALSPEC_API_KEY: {problem}.")


def api_key_problem(key: Optional[str]) -> Optional[str]:
    """Why no client could ever send `key`, or None. A key travels in an HTTP header: printable
    ASCII (a header is read as Latin-1, so a UTF-8 key arrives as other characters), and
    without blanks around it (they are trimmed from the header). The CLI calls this to refuse
    the option; HttpSettings refuses such a key too, so no server starts with one.

    Example: api_key_problem(" k") == "the key has spaces around it, which no client sends";
    api_key_problem(None) is None (no key: the server is open).
    """
    if key is None:
        return None
    if not key.strip():
        return "an empty key would let no client in (or, trimmed, anyone); give a real key"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return "the key is not valid UTF-8 text; give one of printable ASCII characters"
    if key != key.strip():
        return "the key has spaces around it, which no client sends; remove them"
    if not all(" " <= ch <= "~" for ch in key):
        return ("the key has characters other than printable ASCII, which an HTTP header does "
                "not carry as they are; use letters, digits and punctuation")
    return None


def model_names(arg: str, path) -> list:
    """The id clients send as `model` (first), then the other spellings accepted for it."""
    looks_like_path = arg.endswith(".gguf") or "/" in arg or "\\" in arg
    first = path.stem if looks_like_path else arg
    return list(dict.fromkeys([first, arg, path.name, path.stem]))


class ApiError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


@dataclass(frozen=True)
class GenRequest:
    """One validated generation request, whichever endpoint it came from."""

    kind: str                           # "chat", "text" or "infill"
    prompt: Union[str, list]            # text, chat messages, or token ids
    sampling: SamplingParams
    max_tokens: Optional[int]           # None: until EOS or a full context; "infill": 0 reads
                                        # the prompt into the cache and generates nothing
    stop: tuple = ()
    stream: bool = False
    include_usage: bool = False
    document: Optional[str] = None
    speculate: bool = True
    fixed_k: Optional[int] = None
    fim: Optional[object] = None        # "infill": an apps.fim.FimRequest (infill_api.py)
    fields: tuple = ()                  # "infill": llama.cpp's response_fields


# -- field checks ---------------------------------------------------------------------------------
CHECK = Checks(bad, null_is_absent=True)


def _check_names(body: dict, allowed: Sequence[str], where: str = "") -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ApiError(400, f"unrecognized request argument '{where}{unknown[0]}' (docs/http.md "
                            "lists what this server accepts)", param=where + unknown[0],
                       code="unknown_parameter")


def _same(a, b) -> bool:
    """Equal, and true/false never stand in for 1/0 (Python's True == 1)."""
    return a == b and (isinstance(a, bool) == isinstance(b, bool))


def _neutral(body: dict, names: Sequence[str]) -> None:
    for name in names:
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in NEUTRAL[name]):
            allowed = " or ".join(repr(v) for v in NEUTRAL[name]) or "null"
            raise bad(name, f"'{name}' is not supported by this server (accepted: {allowed})")


def check_model(body: dict, names: Sequence[str]) -> None:
    """`model` may be left out (one model is served); a name it does not know is a 404."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    if model not in names:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{names[0]}' (GET /v1/models).", param="model",
                       code="model_not_found")


def _common(body: dict, kind: str, prompt, max_tokens_names: Sequence[str]) -> GenRequest:
    limits = [CHECK.number(body, n, None, 1, integer=True) for n in max_tokens_names]
    limits = [m for m in limits if m is not None]
    if len(set(limits)) > 1:
        raise bad(max_tokens_names[0], "'max_tokens' and 'max_completion_tokens' disagree")
    stream = CHECK.flag(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(options, dict):
            raise bad("stream_options", "'stream_options' must be an object")
        _check_names(options, ("include_usage", "include_obfuscation"), "stream_options.")
    ext = body.get("localspec")
    ext = {} if ext is None else ext
    if not isinstance(ext, dict):
        raise bad("localspec", "'localspec' must be an object")
    _check_names(ext, EXTENSION, "localspec.")
    ext = {f"localspec.{k}": v for k, v in ext.items()}     # error messages name the full path
    document = ext.get("localspec.document")
    return GenRequest(
        kind=kind, prompt=prompt,
        sampling=CHECK.sampling(body, temperature_max=2.0),
        max_tokens=limits[0] if limits else None, stop=CHECK.stop(body), stream=stream,
        include_usage=CHECK.flag(options or {}, "include_usage", False),
        document=None if document is None else CHECK.text(document, "localspec.document"),
        speculate=CHECK.flag(ext, "localspec.speculate", True),
        fixed_k=CHECK.draft_length(ext, "localspec.k"))


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    return body


# -- requests -------------------------------------------------------------------------------------
def _prediction(body: dict) -> Optional[str]:
    """OpenAI's Predicted Outputs ({"type": "content", "content": ...}) is exactly a lookup
    document: text the answer is expected to repeat."""
    pred = body.get("prediction")
    if pred is None:
        return None
    if not isinstance(pred, dict) or pred.get("type") != "content":
        raise bad("prediction", "'prediction' must be {\"type\": \"content\", \"content\": ...}")
    return CHECK.content(pred.get("content"), "prediction.content")


def parse_chat(body, model_names: Sequence[str]) -> GenRequest:
    """POST /v1/chat/completions body -> GenRequest; raises ApiError naming the bad field."""
    body = _object(body)
    _check_names(body, COMMON + CHAT_NEUTRAL + IGNORED + ("messages", "max_completion_tokens",
                                                          "prediction"))
    check_model(body, model_names)
    _neutral(body, CHAT_NEUTRAL)
    req = _common(body, "chat", CHECK.messages(body.get("messages")),
                  ("max_completion_tokens", "max_tokens"))
    doc = _prediction(body)
    if doc is not None and req.document is None:
        req = replace(req, document=doc)
    return req


def parse_completion(body, model_names: Sequence[str], n_vocab: int) -> GenRequest:
    """POST /v1/completions body -> GenRequest. `prompt`: a string, a list of one string, or
    token ids (a list of integers, or a list of one such list)."""
    body = _object(body)
    _check_names(body, COMMON + TEXT_NEUTRAL + IGNORED + ("prompt",))
    check_model(body, model_names)
    _neutral(body, TEXT_NEUTRAL)
    return _common(body, "text", _prompt(body.get("prompt"), n_vocab), ("max_tokens",))


def _prompt(prompt, n_vocab: int):
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                  # a batch of one
    if isinstance(prompt, str):
        return CHECK.text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < n_vocab for t in prompt):
            raise bad("prompt", f"'prompt' token ids must be in 0..{n_vocab - 1}")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "'prompt' must be one prompt: batches of prompts are not supported")
    raise bad("prompt", "'prompt' must be a string or a non-empty list of token ids")


# -- responses ------------------------------------------------------------------------------------
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
          "cancelled": "stop"}


def usage(stats: GenerationStats) -> dict:
    """OpenAI usage; cached_tokens = prompt tokens whose KV rows the previous request left."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {
                "cached_tokens": max(0, stats.prompt_tokens - stats.prefill_tokens)}}


def extension(stats: GenerationStats, queued_ms: float) -> dict:
    """The "localspec" field: speculation statistics (clients that do not know it ignore it)."""
    d = {k: round(v, 3) if isinstance(v, float) else v for k, v in stats.to_dict().items()}
    d["queued_ms"] = round(queued_ms, 3)
    return d


def _envelope(kind: str, rid: str, created: int, model: str, chunk: bool) -> dict:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if kind == "chat" \
        else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model,
            "system_fingerprint": None}


def full_response(kind: str, rid: str, created: int, model: str, text: str,
                  stats: GenerationStats, queued_ms: float) -> dict:
    choice = {"index": 0, "logprobs": None, "finish_reason": FINISH[stats.stop_reason]}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text, "refusal": None}
    else:
        choice["text"] = text
    return {**_envelope(kind, rid, created, model, False), "choices": [choice],
            "usage": usage(stats), "localspec": extension(stats, queued_ms)}


def chunk(kind: str, rid: str, created: int, model: str, text: Optional[str],
          finish: Optional[str] = None, first: bool = False, with_usage: bool = False) -> dict:
    """One stream chunk with a text piece (or the closing one when `finish` is given)."""
    if kind == "chat":
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", **delta}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    out = {**_envelope(kind, rid, created, model, True), "choices": [choice]}
    if with_usage:
        out["usage"] = None
    return out


def closing_chunks(kind: str, rid: str, created: int, model: str, stats: GenerationStats,
                   queued_ms: float, include_usage: bool) -> list:
    """The finish_reason chunk (carrying the "localspec" statistics), then, when asked for with
    stream_options.include_usage, the usage chunk with no choices (OpenAI's shape)."""
    last = chunk(kind, rid, created, model, None, FINISH[stats.stop_reason],
                 with_usage=include_usage)
    last["localspec"] = extension(stats, queued_ms)
    out = [last]
    if include_usage:
        out.append({**_envelope(kind, rid, created, model, True), "choices": [],
                    "usage": usage(stats)})
    return out


def models_list(model_id: str, created: int, info: dict) -> dict:
    return {"object": "list", "data": [model_card(model_id, created, info)]}


def model_card(model_id: str, created: int, info: dict) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "localspec",
            "localspec": info}
