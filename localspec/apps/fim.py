"""Fill-in-the-middle (infill): complete the text between a prefix and a suffix with the model's
own FIM tokens, speculatively, with stop rules that suit completion in an editor.

The prompt is ordered so that what stays the same while someone types comes first, and the
prompt cache (whole 64-token chunks) keeps it between requests:

    [BOS] [REP]project\\n ([SEP]name\\n chunk)* [SEP]file\\n          <- extra chunks (the ring)
    [PRE] prefix up to the cursor's line [SUF] suffix [MID] cursor line up to the cursor

The cursor's line goes after [MID], as the start of the middle (llama.cpp's early /infill put
its `prompt` field there too), so typing within a line changes only the prompt's last tokens: a
warm request re-reads those and at most one 64-token chunk before them. Where the cursor is
inside a token (after a space, half a word, indentation alone), the prompt is healed (heal.py):
its last tokens are taken off and the completion's first tokens must spell them again. A new line moves text
from the middle into the prefix and re-reads the suffix. The n-gram proposer sees the prompt
(buffer and chunks) plus anything cut off to fit, so code that copies nearby code drafts well.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from ..errors import LocalspecError
from ..policy.config import PolicyConfig
from ..speculative.sampling import SamplingParams
from ..speculative.stats import GenerationStats
from .heal import Healed, back_up, prefill
from .lines import head_lines, tail_lines

SLACK = 8                # tokens kept free beyond prompt + max_tokens


@dataclass(frozen=True)
class FimRequest:
    """One completion at a cursor. `prefix` is all text before the cursor, `suffix` all after;
    `extra` is (filename, text) chunks from elsewhere (other buffers, yanks), oldest first so
    that new ones append to a prompt whose beginning stays cached. Line limits bound how much
    of the buffer is read (0: all); the token budget of the context comes on top."""

    prefix: str
    suffix: str = ""
    extra: tuple = ()
    filename: str = "file"
    max_tokens: int = 128
    max_lines: int = 0               # stop before the n-th newline of the completion (0: off)
    time_ms: float = 0.0             # past this, stop at the next line end (0: off)
    min_indent: Optional[int] = None  # stop before a later line indented less than this
    prefix_lines: int = 256
    suffix_lines: int = 64


@dataclass
class FimPrompt:
    tokens: list
    document: str                    # text the prompt had to leave out: still worth copying
    truncated: bool
    note: str = ""
    start: int = 0                   # where the cursor's line begins in `tokens`: healed after


def fim_tokens(model) -> dict:
    """The model's FIM tokens, or a one-line error saying which models have them."""
    found = model.fim_tokens()
    if found is None:
        raise LocalspecError(
            f"{model.path.name} has no fill-in-the-middle tokens (llama.cpp's vocabulary "
            "reports no FIM prefix/suffix/middle), so it cannot complete between a prefix and a "
            "suffix; use a coder model trained for it, e.g. -m default (Qwen2.5-Coder).")
    return found


def build_prompt(model, req: FimRequest, n_ctx: int) -> FimPrompt:
    """The prompt tokens for `req`, cut to fit n_ctx around the cursor: chunks go first, then
    the start of the prefix, then the end of the suffix. Raises LocalspecError (no FIM tokens;
    not even the cursor's line fits)."""
    fim = fim_tokens(model)
    tok = (lambda s: model.tokenize(s, add_special=False, parse_special=False) if s else [])
    nl = req.prefix.rfind("\n")
    head, line = req.prefix[:nl + 1], req.prefix[nl + 1:]
    head, cut_pre = tail_lines(head, req.prefix_lines + 1 if req.prefix_lines > 0 else 0)
    suffix, cut_suf = head_lines(req.suffix, req.suffix_lines)
    pre, suf, mid = tok(head), tok(suffix), tok(line)
    extra: list = []
    if "rep" in fim:
        extra += [fim["rep"]] + tok("project\n")
    for name, text in req.extra:
        extra += ([fim["sep"]] + tok(f"{name}\n") if "sep" in fim else tok("\n\n--- snippet ---\n\n"))
        extra += tok(text)
    if "sep" in fim:
        extra += [fim["sep"]] + tok(f"{req.filename}\n")
    bos = [model.bos] if model.add_bos and model.bos >= 0 else []
    reserve = min(req.max_tokens, n_ctx // 4)      # a longer completion stops at the context
    room = n_ctx - reserve - SLACK - len(bos) - 3
    fixed = len(mid)
    if fixed > room:
        raise LocalspecError(
            f"the cursor's line alone is {fixed} tokens and the context holds {n_ctx} with "
            f"{reserve} for the completion; shorten the line, or give the server a larger "
            "context (its --ctx).")
    truncated, notes = False, []       # the line limits are the client's choice, not a cut
    n_suf = min(len(suf), max(0, (room - fixed) // 4))       # suffix: up to a quarter
    n_pre = min(len(pre), room - fixed - n_suf)
    n_suf = min(len(suf), room - fixed - n_pre)               # give back what the prefix left
    n_extra = min(len(extra), room - fixed - n_pre - n_suf)
    if n_pre < len(pre) or n_suf < len(suf) or n_extra < len(extra):
        truncated = True
        notes.append(f"the buffer is larger than the context ({n_ctx} tokens): kept "
                     f"{n_pre + n_suf} tokens around the cursor and {n_extra} of context chunks")
    n_pre, n_suf = _whole_lines(model, pre, n_pre, True), _whole_lines(model, suf, n_suf, False)
    tokens = bos + extra[len(extra) - n_extra:] + [fim["pre"]] + pre[len(pre) - n_pre:] + \
        [fim["suf"]] + suf[:n_suf] + [fim["mid"]] + mid
    left_out = cut_pre + model.detokenize(pre[:len(pre) - n_pre]) + "\n" + \
        model.detokenize(suf[n_suf:]) + cut_suf
    return FimPrompt(tokens, left_out if left_out.strip() else "", truncated, "; ".join(notes),
                     len(tokens) - len(mid))


def _whole_lines(model, toks: list, n: int, tail: bool) -> int:
    """n, or fewer so that the kept tokens (the last n when `tail`, else the first n) start or
    end at a line break: a cut buffer begins and ends with whole lines."""
    if n >= len(toks) or n <= 0:
        return n
    if tail:
        for i in range(len(toks) - n, len(toks)):
            if b"\n" in model.token_piece(toks[i]):
                return len(toks) - i - 1
        return n
    for i in range(n - 1, -1, -1):
        if b"\n" in model.token_piece(toks[i]):
            return i + 1
    return n


class LineRules:
    """The completion's stop rules over streamed text: a line budget, a time budget that ends
    the completion at the next line end, and an indentation floor (llama.cpp's n_indent). Text
    after a newline is held back until its line shows a non-blank character, so a cut never
    takes back what was already shown. A line ends at "\\n" or "\\r\\n" (a CRLF file): a "\\r"
    waits for the next character, so a cut at a line end never leaves a lone "\\r".

    Example: LineRules(max_lines=1).feed("x = 1\\ny = 2") == "x = 1", .reason == "lines";
    LineRules(max_lines=1).feed("x = 1\\r\\ny = 2") == "x = 1" too.
    """

    def __init__(self, max_lines: int = 0, min_indent: Optional[int] = None):
        self.max_lines, self.min_indent = max_lines, min_indent
        self.held, self.newlines, self.reason = "", 0, ""
        self.cr = False                # "\r" came last: a line end if "\n" follows

    def feed(self, piece: str, over_time: bool = False) -> str:
        out: list = []
        for ch in piece:
            if self.reason:
                break
            if ch == "\n":
                self._line_end("\r\n" if self.cr else "\n", over_time, out)
                self.cr = False
                continue
            if self.cr:                # "\r" inside a line: an ordinary character
                self.cr = False
                self._char("\r", out)
                if self.reason:
                    break
            if ch == "\r":
                self.cr = True
            else:
                self._char(ch, out)
        return "".join(out)

    def _line_end(self, end: str, over_time: bool, out: list) -> None:
        if self.max_lines and self.newlines + 1 >= self.max_lines:
            self.reason = "lines"
        elif over_time and (self.newlines or out or self.held):
            self.reason = "time"
        else:                          # blank lines wait with the line end before them
            self.held, self.newlines = self.held + end, self.newlines + 1

    def _char(self, ch: str, out: list) -> None:
        if self.held and ch in " \t":
            self.held += ch
        elif self.held:
            indent = len(self.held) - self.held.rfind("\n") - 1
            if self.min_indent is not None and indent < self.min_indent:
                self.reason, self.held = "indent", ""
            else:
                out.append(self.held + ch)
                self.held = ""
        else:
            out.append(ch)

    def finish(self) -> str:
        """What is still held when generation ends by itself (a trailing line end). A last
        "\\r" is dropped: it is half of a line end that the generation stopped inside."""
        held = "" if self.reason else self.held
        self.held, self.cr = "", False
        return held


class Infill:
    """One running completion: iterate for text pieces; afterwards `.text`, `.stats`,
    `.finish_reason` (eos, length, lines, time, indent, cancelled, context), `.truncated`."""

    def __init__(self, engine, req: FimRequest, sampling: SamplingParams = SamplingParams(),
                 speculate: bool = True, cancel: Optional[threading.Event] = None,
                 policy: Optional[PolicyConfig] = None):
        self.request, self.started = req, time.perf_counter()
        self.prompt = build_prompt(engine.model, req, engine.ctx.n_ctx)
        self.truncated, self.note = self.prompt.truncated, self.prompt.note
        self._gen = Healed(engine, self.prompt.tokens, self.prompt.start, sampling,
                           max_tokens=req.max_tokens, cancel=cancel,
                           document=self.prompt.document or None, speculate=speculate,
                           policy=policy)
        self._rules = LineRules(req.max_lines, req.min_indent)
        self.text, self.finish_reason = "", ""

    def __iter__(self) -> Iterator[str]:
        limit = self.request.time_ms / 1000 if self.request.time_ms > 0 else None
        try:
            for piece in self._gen:
                over = limit is not None and time.perf_counter() - self.started > limit
                out = self._rules.feed(piece, over)
                if out:
                    self.text += out
                    yield out
                if self._rules.reason:
                    break
            tail = self._rules.finish()
            if tail:
                self.text += tail
                yield tail
        finally:
            self._gen.close()
            self.finish_reason = self._rules.reason or self._gen.stats.stop_reason or "cancelled"

    def complete(self) -> str:
        for _ in self:
            pass
        return self.text

    @property
    def stats(self) -> GenerationStats:
        return self._gen.stats


class Prefill:
    """The protocol's `prefill` (and /infill with n_predict 0, llama.vim's warm-up): the prompt
    that a completion at `req`'s cursor would read, evaluated now into the KV cache (healed as
    the completion will be), so that the first keystroke's completion finds it warm; the prompt
    cache keeps it when another buffer comes next. It generates nothing: iterating yields no
    text; `.result` says what was read, `.stats` the same as a completion's."""

    def __init__(self, engine, req: FimRequest, cancel: Optional[threading.Event] = None):
        started = time.perf_counter()
        prompt = build_prompt(engine.model, req, engine.ctx.n_ctx)
        n, _ = back_up(engine.model, prompt.tokens, prompt.start)
        tokens = prompt.tokens[:len(prompt.tokens) - n]
        read = prefill(engine, tokens, cancel)
        ms = 1000 * (time.perf_counter() - started)
        self.text, self.truncated, self.note = "", prompt.truncated, prompt.note
        self.finish_reason = "cancelled" if read.logits is None else "length"
        self.stats = GenerationStats(prompt_tokens=len(tokens), prefill_tokens=read.evaluated,
                                     prefill_ms=ms, total_ms=ms,
                                     stop_reason=self.finish_reason)
        self.stats.record_reuse(read.source, read.reused, read.restore_ms)
        self.result = {"prompt_tokens": len(tokens), "reused_tokens": read.reused,
                       "prefill_tokens": read.evaluated, "reuse_source": read.source,
                       "prefill_ms": round(ms, 3), "cancelled": read.logits is None,
                       "truncated": prompt.truncated, "note": prompt.note}

    def __iter__(self) -> Iterator[str]:
        return iter(())


def infill(engine, req: FimRequest, sampling: SamplingParams = SamplingParams(),
           speculate: bool = True, cancel: Optional[threading.Event] = None,
           policy: Optional[PolicyConfig] = None) -> Infill:
    """Start a completion at the cursor of `req` on `engine`; iterate the result for text."""
    return Infill(engine, req, sampling, speculate, cancel, policy)


def split_extra(chunks: Sequence) -> tuple:
    """[(filename, text)] from [{"filename", "text"}] as both protocols send them."""
    return tuple((c.get("filename") or "chunk", c["text"]) for c in chunks)
