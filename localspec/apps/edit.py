"""Rewrites: an instruction applied to a text (a whole file or a range of its lines), with the
whole file as the n-gram document, and the reply cleaned to the rewritten text alone. Used by
`localspec edit` (cli/edit.py) and the editor protocol's clients through `generate`.

How the reply is kept clean: the assistant's turn is opened with a code fence, so the model
writes the code at once and its closing fence is a stop string; where the text itself holds
fences (Markdown), no fence is opened and strip_reply() takes the reply apart instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from ..errors import LocalspecError
from ..speculative.sampling import SamplingParams
from ..speculative.stats import GenerationStats
from .lines import split_lines

SYSTEM = ("You are a careful code and text editor. Apply the user's instruction to the text "
          "and reply with the complete rewritten text only: no explanation, no commentary.")
FENCE = re.compile(r"^```[^\n`]*\n(.*?)(?:^```[ \t]*$|\Z)", re.S | re.M)
LANGS = {".py": "python", ".js": "javascript", ".ts": "typescript", ".rs": "rust", ".go": "go",
         ".c": "c", ".h": "c", ".cpp": "cpp", ".java": "java", ".rb": "ruby", ".sh": "bash",
         ".lua": "lua", ".el": "elisp", ".md": "markdown", ".json": "json", ".toml": "toml",
         ".yaml": "yaml", ".yml": "yaml", ".html": "html", ".css": "css", ".sql": "sql"}


@dataclass(frozen=True)
class Wording:
    """How an error names what its reader can change: `localspec edit`'s options, or the
    protocol's fields (a client cannot pass -n; it can send max_tokens)."""

    region: str = "--region"
    max_tokens: str = "-n"
    context: str = "the context (--ctx)"


CLI = Wording()
PROTOCOL = Wording("'region'", "'max_tokens'", "the server's context (its --ctx)")


@dataclass(frozen=True)
class Region:
    """Lines START..END of a text, 1-based and inclusive."""

    start: int
    end: int


def parse_region(value: str) -> Region:
    """"START:END" -> Region; raises ValueError with the reason."""
    a, sep, b = value.partition(":")
    if not sep or not a.strip().isdigit() or not b.strip().isdigit():
        raise ValueError(f"expected START:END line numbers (e.g. 10:25), got {value!r}")
    region = Region(int(a), int(b))
    if region.start < 1 or region.end < region.start:
        raise ValueError(f"lines run from 1 and START must not be past END, got {value!r}")
    return region


def split_region(text: str, region: Optional[Region], wording: Wording = CLI) -> tuple:
    """(before, part, after) of `text`; part is the whole text without a region. Lines are
    what '\\n' separates, as editors number them (lines.py).

    Example: split_region("a\\n\\x0c\\nb\\n", Region(3, 3)) == ("a\\n\\x0c\\n", "b\\n", "").
    """
    if region is None:
        return "", text, ""
    lines = split_lines(text)
    if region.end > len(lines):
        raise LocalspecError(f"{wording.region} ends at line {region.end}, past the end of the "
                             f"text ({len(lines)} lines).")
    return ("".join(lines[:region.start - 1]), "".join(lines[region.start - 1:region.end]),
            "".join(lines[region.end:]))


def check_edit(instruction: str, text: str, part: str, wording: Wording = CLI) -> str:
    """The bad inputs of a rewrite, each one line; returns the instruction stripped."""
    instruction = instruction.strip()
    if not instruction:
        raise LocalspecError("the instruction is empty: say what to change, e.g. "
                             "`localspec edit \"add type hints\" file.py`.")
    if "\x00" in text:
        raise LocalspecError("the input contains NUL bytes: this looks like a binary file, "
                             "not text to edit.")
    if not part.strip():
        raise LocalspecError(f"nothing to edit: the text (or the {wording.region}) is empty.")
    return instruction


def build_messages(instruction: str, text: str, part: str, region: Optional[Region],
                   name: str) -> list:
    """The whole file first (it stays the same across instructions: the prompt cache keeps it),
    then what to rewrite and how."""
    if region is None:
        user = f"File {name}:\n{text}\n\nInstruction: {instruction}\nRewrite the whole file."
    else:
        user = (f"File {name}:\n{text}\n\nInstruction: {instruction}\nRewrite only lines "
                f"{region.start}-{region.end} of the file, which are:\n{part}\n"
                "Reply with those lines rewritten, nothing else.")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def fence_opening(text: str, name: str) -> str:
    """The fence the reply is opened with ("" where the text has fences of its own)."""
    if "```" in text:
        return ""
    lang = next((v for k, v in LANGS.items() if name.endswith(k)), "")
    return f"```{lang}\n"


def strip_reply(reply: str, opened: bool) -> str:
    """The rewritten text out of a model's reply: what precedes a closing fence when the reply
    was opened with one; else the first fenced block if there is one (commentary around it
    dropped); else the reply itself.

    Example: strip_reply("Here it is:\\n```py\\nx = 1\\n```\\nDone.", False) == "x = 1\\n".
    """
    if opened:
        end = re.search(r"^```[ \t]*$", reply, re.M)
        return reply[:end.start()] if end else reply
    m = FENCE.search(reply)
    return m.group(1) if m else reply


def keep_newlines(original: str, rewritten: str) -> str:
    """The rewrite with the original's trailing-newline convention (none, or as many)."""
    tail = len(original) - len(original.rstrip("\n"))
    return rewritten.rstrip("\n") + "\n" * tail


def finish(part: str, reply: str, opened: bool, stats: GenerationStats, max_tokens: int,
           wording: Wording = CLI) -> str:
    """The rewritten part, or a one-line error when the reply cannot be a whole rewrite."""
    if stats.stop_reason in ("length", "context"):
        what = f"{wording.max_tokens} {max_tokens}" if stats.stop_reason == "length" else \
            wording.context
        raise LocalspecError(f"the rewrite was cut off at {stats.generated_tokens} tokens by "
                             f"{what}; nothing was written. Raise it, or edit a smaller "
                             f"{wording.region}.")
    if stats.stop_reason == "cancelled":
        raise LocalspecError("the rewrite was cancelled; nothing was written.")
    body = strip_reply(reply, opened)
    if not body.strip():
        raise LocalspecError("the model replied with no text; nothing was written.")
    return keep_newlines(part, body)


class Rewrite:
    """One rewrite running on an engine: iterate for the reply's pieces as they stream (clean
    unless the text has fences of its own); then result() is the rewritten part or a one-line
    LocalspecError. `before` + result() + `after` is the whole edited text."""

    def __init__(self, engine, instruction: str, text: str, region: Optional[Region] = None,
                 name: str = "text", sampling: SamplingParams = SamplingParams(),
                 max_tokens: Optional[int] = None, speculate: bool = True, cancel=None,
                 policy=None, stop: Sequence[str] = (), wording: Wording = CLI):
        self.wording = wording
        self.before, self.part, self.after = split_region(text, region, wording)
        instruction = check_edit(instruction, text, self.part, wording)
        model = engine.model
        if model.chat_template() is None:
            raise LocalspecError(f"{model.path.name} has no chat template, so it cannot follow "
                                 "an instruction; use an instruct model (e.g. -m default).")
        self.opening = fence_opening(text, name)
        rendered = model.apply_chat_template(
            build_messages(instruction, text, self.part, region, name)) + self.opening
        tokens = model.tokenize(rendered, add_special=True, parse_special=True)
        if len(tokens) >= engine.ctx.n_ctx:
            raise LocalspecError(f"the text and instruction are {len(tokens)} tokens but "
                                 f"{wording.context} holds {engine.ctx.n_ctx}; rewrite a "
                                 "shorter text or raise it.")
        if max_tokens is None:          # room for the part twice over, as the context allows
            n_part = len(model.tokenize(self.part, add_special=False))
            max_tokens = max(64, min(2 * n_part + 64, engine.ctx.n_ctx - len(tokens) - 1))
        self.max_tokens = max_tokens
        self.gen = engine.generate(tokens, sampling, max_tokens=max_tokens,
                                   stop=list(stop) + (["\n```"] if self.opening else []),
                                   document=text, speculate=speculate, cancel=cancel,
                                   policy=policy)

    def __iter__(self) -> Iterator[str]:
        return iter(self.gen)

    def result(self) -> str:
        self.gen.complete()
        return finish(self.part, self.gen.text, bool(self.opening), self.gen.stats,
                      self.max_tokens, self.wording)

    @property
    def stats(self) -> GenerationStats:
        return self.gen.stats
