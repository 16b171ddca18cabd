"""Fill-in-the-middle requests as both front ends take them: the editor protocol's `complete`
(docs/protocol.md) and the HTTP server's llama.cpp-style `/infill` (docs/http.md). Field checks
and the buffer rules (no NUL bytes, cut to the context) live here once; the engine side is
fim.py.
"""

from __future__ import annotations

from typing import Optional

from .checks import Checks
from .edit import Region
from .fim import FimRequest

DEFAULT_MAX_TOKENS = 64
# The protocol's `complete` params, and what each means in FimRequest.
COMPLETE_PARAMS = ("prefix", "suffix", "extra", "filename", "max_tokens", "max_lines",
                   "time_budget_ms", "min_indent", "prefix_lines", "suffix_lines", "temperature",
                   "top_k", "top_p", "min_p", "repeat_penalty", "seed", "speculate", "stream", "k")
REWRITE_PARAMS = ("text", "instruction", "region", "filename", "max_tokens", "temperature",
                  "top_k", "top_p", "min_p", "repeat_penalty", "seed", "speculate", "stream", "k")
# llama.cpp server's /infill fields that localspec honours, and those it accepts and ignores
# (they tune llama.cpp's own slots and samplers; see docs/http.md).
INFILL_FIELDS = ("input_prefix", "input_suffix", "input_extra", "prompt", "n_predict",
                 "max_tokens", "t_max_predict_ms", "n_indent", "temperature", "top_k", "top_p",
                 "min_p", "repeat_penalty", "seed", "stream", "response_fields", "model",
                 "localspec")
INFILL_IGNORED = ("id_slot", "cache_prompt", "samplers", "t_max_prompt_ms", "n_probs",
                  "return_tokens", "timings_per_token", "post_sampling_probs", "n_keep")


def buffer_text(check: Checks, value, name: str) -> str:
    """A piece of an editor buffer: a string without NUL characters (a binary file)."""
    text = check.text(value, name)
    if "\x00" in text:
        raise check.fail(name, f"'{name}' contains NUL characters: this looks like a binary "
                               "file, not text to complete")
    return text


def extra_chunks(check: Checks, value, name: str) -> tuple:
    """[{"text": ..., "filename": ...}] -> ((filename, text), ...)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise check.fail(name, f"'{name}' must be a list of {{\"text\", \"filename\"}} objects")
    out = []
    for i, chunk in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(chunk, dict):
            raise check.fail(where, f"'{where}' must be an object with 'text'")
        fname = chunk.get("filename", "chunk")
        fname = "chunk" if fname is None else check.text(fname, f"{where}.filename")
        out.append((fname.replace("\n", " ") or "chunk",
                    buffer_text(check, chunk.get("text"), f"{where}.text")))
    return tuple(out)


def _lines(check: Checks, params: dict, name: str, default: int) -> int:
    return check.number(params, name, default, 0, integer=True)


def parse_complete(check: Checks, params: dict) -> FimRequest:
    """The protocol's `complete` params -> FimRequest (sampling, speculate, stream apart)."""
    if "prefix" not in params:
        raise check.fail("prefix", "'prefix' is required: the buffer's text before the cursor")
    name = params.get("filename")
    return FimRequest(
        prefix=buffer_text(check, params["prefix"], "prefix"),
        suffix=buffer_text(check, params.get("suffix", ""), "suffix"),
        extra=extra_chunks(check, params.get("extra"), "extra"),
        filename=(check.text(name, "filename").replace("\n", " ") or "file") if name else "file",
        max_tokens=check.number(params, "max_tokens", DEFAULT_MAX_TOKENS, 1, integer=True),
        max_lines=_lines(check, params, "max_lines", 0),
        time_ms=check.number(params, "time_budget_ms", 0.0, 0.0),
        min_indent=check.number(params, "min_indent", None, 0, integer=True),
        prefix_lines=_lines(check, params, "prefix_lines", FimRequest.prefix_lines),
        suffix_lines=_lines(check, params, "suffix_lines", FimRequest.suffix_lines))


def parse_rewrite(check: Checks, params: dict) -> dict:
    """The protocol's `rewrite` params: the buffer `text`, the `instruction`, an optional
    `region` [START, END] of 1-based lines, and `filename` (its extension names the language)."""
    for name in ("text", "instruction"):
        if name not in params:
            raise check.fail(name, f"'{name}' is required")
    region = params.get("region")
    if region is not None:
        if not (isinstance(region, list) and len(region) == 2 and
                all(isinstance(n, int) and not isinstance(n, bool) for n in region)
                and 1 <= region[0] <= region[1]):
            raise check.fail("region", "'region' must be [START, END], 1-based line numbers "
                                       "with START <= END")
        region = Region(*region)
    name = params.get("filename")
    return {"text": buffer_text(check, params["text"], "text"),
            "instruction": check.text(params["instruction"], "instruction"), "region": region,
            "filename": check.text(name, "filename") if name else "text",
            "max_tokens": check.number(params, "max_tokens", None, 1, integer=True)}


def parse_infill(check: Checks, body: dict, n_ctx: int) -> FimRequest:
    """llama.cpp's /infill body -> FimRequest. `prompt` (the cursor's line up to the cursor, as
    llama.vim sends it) continues `input_prefix`; n_indent 0 means off, as there."""
    if "input_prefix" not in body:
        raise check.fail("input_prefix", "'input_prefix' is required: the text before the cursor")
    limits = [check.number(body, n, None, -1, integer=True) for n in ("n_predict", "max_tokens")]
    limit = next((n for n in limits if n is not None and n > 0), DEFAULT_MAX_TOKENS)
    if any(n == -1 for n in limits):
        limit = max(1, n_ctx // 4)                      # llama.cpp's -1: until the model stops
    indent: Optional[int] = check.number(body, "n_indent", 0, 0, integer=True)
    return FimRequest(
        prefix=buffer_text(check, body["input_prefix"], "input_prefix")
        + buffer_text(check, body.get("prompt") or "", "prompt"),
        suffix=buffer_text(check, body.get("input_suffix") or "", "input_suffix"),
        extra=extra_chunks(check, body.get("input_extra"), "input_extra"),
        max_tokens=limit, time_ms=check.number(body, "t_max_predict_ms", 0.0, 0.0),
        min_indent=indent or None, prefix_lines=0, suffix_lines=0)


def flatten_fields(response: dict, fields) -> dict:
    """llama.cpp's `response_fields`: only the named fields, nested ones as "a/b" keys."""
    out = {}
    for path in fields:
        value, ok = response, True
        for part in str(path).split("/"):
            if isinstance(value, dict) and part in value:
                value = value[part]
            else:
                ok = False
                break
        if ok:
            out[str(path)] = value
    return out
