"""`POST /infill` of `serve --http`, in the shape of llama.cpp server's endpoint (the one
llama.vim and other FIM plugins call): request body -> GenRequest, and the response and stream
bodies. Pure functions like openai_api.py; the fields are checked in completion.py.
"""

from __future__ import annotations

from dataclasses import replace

from ..speculative.stats import GenerationStats
from .completion import INFILL_FIELDS, INFILL_IGNORED, flatten_fields, parse_infill
from .openai_api import CHECK, GenRequest, _check_names, bad, check_model, extension

# localspec's finish reasons as llama.cpp's stop_type: eos, limit (a budget) or word.
STOP_TYPE = {"eos": "eos", "length": "limit", "context": "limit", "lines": "limit",
             "time": "limit", "indent": "limit", "cancelled": "none", "stop": "word"}


def parse_infill_request(body, names, n_ctx: int) -> GenRequest:
    """The /infill body -> GenRequest carrying a FimRequest; raises ApiError naming the field."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    _check_names(body, INFILL_FIELDS + INFILL_IGNORED)
    check_model(body, names)
    fields = body.get("response_fields") or []
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise bad("response_fields", "'response_fields' must be a list of strings")
    ext = body.get("localspec") or {}
    if not isinstance(ext, dict):
        raise bad("localspec", "'localspec' must be an object")
    _check_names(ext, ("speculate", "k", "max_lines"), "localspec.")
    ext = {f"localspec.{k}": v for k, v in ext.items()}
    fim = parse_infill(CHECK, body, n_ctx)
    lines = CHECK.number(ext, "localspec.max_lines", 0, 0, integer=True)
    if lines:
        fim = replace(fim, max_lines=lines)
    # n_predict 0 is how llama.vim warms the cache ("don't generate anything"): a prefill
    warm = any(body.get(n) == 0 and not isinstance(body.get(n), bool)
               for n in ("n_predict", "max_tokens"))
    return GenRequest(kind="infill", prompt="", sampling=CHECK.sampling(body, 2.0),
                      max_tokens=0 if warm else fim.max_tokens,
                      stream=CHECK.flag(body, "stream", False),
                      speculate=CHECK.flag(ext, "localspec.speculate", True),
                      fixed_k=CHECK.draft_length(ext, "localspec.k"), fim=fim,
                      fields=tuple(fields))


def timings(stats: GenerationStats) -> dict:
    decode_ms = max(0.0, stats.total_ms - stats.prefill_ms)
    n_pre, n_out = stats.prefill_tokens, stats.generated_tokens
    return {"prompt_n": n_pre, "prompt_ms": round(stats.prefill_ms, 3),
            "prompt_per_token_ms": round(stats.prefill_ms / n_pre, 3) if n_pre else 0.0,
            "prompt_per_second": round(1000 * n_pre / stats.prefill_ms, 2)
            if stats.prefill_ms > 0 else 0.0,
            "predicted_n": n_out, "predicted_ms": round(decode_ms, 3),
            "predicted_per_token_ms": round(decode_ms / n_out, 3) if n_out else 0.0,
            "predicted_per_second": round(1000 * n_out / decode_ms, 2) if decode_ms > 0 else 0.0}


def infill_body(req: GenRequest, gen, queued_ms: float, model: str) -> dict:
    """The final body (the whole answer, or the stream's last event with "stop": true)."""
    if gen is None:                     # cancelled before it started: its client has gone
        return {"index": 0, "content": "", "stop": True, "stop_type": "none"}
    stats = gen.stats
    body = {"index": 0, "content": "" if req.stream else gen.text, "stop": True,
            "model": model, "stop_type": STOP_TYPE.get(gen.finish_reason, "none"),
            "stopping_word": "", "tokens_predicted": stats.generated_tokens,
            "tokens_evaluated": stats.prompt_tokens, "tokens_cached": stats.reused_tokens,
            "has_new_line": "\n" in gen.text, "truncated": gen.truncated,
            "timings": timings(stats),
            "localspec": {**extension(stats, queued_ms), "finish_reason": gen.finish_reason,
                          "note": gen.note}}
    return flatten_fields(body, req.fields) if req.fields else body


def infill_chunk(text: str) -> dict:
    """One streamed piece, as llama.cpp streams /infill (no OpenAI envelope, no [DONE])."""
    return {"index": 0, "content": text, "stop": False}
