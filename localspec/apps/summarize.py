"""Offline summarisation: find the inputs, split long documents into chunks that fit the context,
summarise them map-reduce style, and write each output atomically so an interrupted batch resumes.
The click options and the progress display live in cli/summarize.py; chunks.py cuts the text,
summarize_parallel.py runs a batch N documents at a time (--parallel).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Callable, Iterable, Optional, Sequence

from ..errors import LocalspecError
from ..speculative.stats import GenerationStats
from .chunks import split_chunks

DEFAULT_GLOBS = ("*.md", "*.markdown", "*.txt", "*.rst", "*.py")
DEFAULT_INSTRUCTION = ("Summarize the following document in one short paragraph. Keep the key "
                       "facts, names and numbers.")
# Prefixed to the instruction when the model sees chunk summaries instead of the source.
REDUCE_NOTE = "The text below is the summaries of consecutive parts of one long document, in order."
MARGIN_TOKENS = 16        # slack for tokens merging differently at the prompt's seams
MIN_BUDGET_TOKENS = 32    # a chunk smaller than this is not worth a model call
SUFFIX = {"text": ".summary.md", "jsonl": ".summary.json"}


class DocumentError(LocalspecError):
    """A problem with one input (unreadable, binary, empty...): reported, skipped, batch goes on."""


# -- inputs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    display: str               # what the user sees: the path as given or found, "-" for stdin
    path: Optional[Path]       # None: stdin
    rel: PurePath              # where its output goes under -o DIR (mirrors a walked tree)
    walked: bool = False       # found by a directory walk: only regular files are read
    error: str = ""            # already known to be broken at discovery (missing path...)


def parse_globs(values: Iterable[str]) -> tuple:
    """--glob values, repeatable and comma-separated: ("*.md,*.txt", "*.py") -> 3 patterns."""
    out = tuple(p.strip() for v in values for p in v.split(",") if p.strip())
    return out or DEFAULT_GLOBS


def discover(inputs: Sequence[str], globs: Sequence[str] = DEFAULT_GLOBS,
             exclude: Optional[Path] = None) -> list:
    """One Source per input file: named files as given, directories walked recursively (sorted;
    hidden entries and `exclude`, the output directory, left out), "-" for stdin.
    Missing paths and directories without a match become Sources with `error` set."""
    sources, seen = [], set()
    for arg in inputs:
        if arg == "-":
            found = [Source("-", None, PurePath("stdin"))]
        elif os.path.isdir(arg):
            root = Path(arg)
            found = [Source(str(p), p, p.relative_to(root), walked=True)
                     for p in _walk(root, globs, exclude)]
            if not found:
                found = [Source(arg, root, PurePath(root.name), error="no files matching "
                                f"{','.join(globs)} (change --glob)")]
        elif os.path.lexists(arg):
            found = [Source(arg, Path(arg), PurePath(Path(arg).name))]
        else:
            found = [Source(arg, Path(arg), PurePath(Path(arg).name),
                            error="no such file or directory")]
        for src in found:
            key = "-" if src.path is None else os.path.abspath(src.path)
            if key not in seen or src.error:
                seen.add(key)
                sources.append(src)
    return sources


def _walk(root: Path, globs: Sequence[str], exclude: Optional[Path]):
    skip = os.path.realpath(exclude) if exclude is not None else None
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                             and os.path.realpath(os.path.join(dirpath, d)) != skip)
        for name in sorted(filenames):
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if not name.startswith(".") and any(fnmatch.fnmatch(name, g) or
                                                fnmatch.fnmatch(rel, g) for g in globs):
                yield path


def read_source(src: Source, stdin=None) -> str:
    """The text of one input, or DocumentError saying why it cannot be summarised.
    `stdin` is a binary stream, read when src is "-"."""
    if src.error:
        raise DocumentError(src.error)
    try:
        if src.path is None:
            if stdin is None:
                raise DocumentError("stdin is closed")
            data = stdin.read()
        else:
            if src.walked and not src.path.is_file():
                raise DocumentError("not a regular file" if src.path.exists()
                                    else "broken symbolic link")
            data = src.path.read_bytes()
    except OSError as e:
        raise DocumentError(f"cannot read it: {e.strerror or e}") from None
    if b"\0" in data:
        raise DocumentError("binary file (contains NUL bytes)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DocumentError(f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") \
            from None
    if not text.strip():
        raise DocumentError("empty")
    return text


# -- map-reduce ------------------------------------------------------------------------------------
@dataclass
class Summary:
    text: str
    stats: GenerationStats = field(default_factory=GenerationStats)   # merged over every call
    chunks: int = 1           # map calls (the number of chunks of the source)
    calls: int = 0            # map + reduce calls


class Summarizer:
    """Summarises one document at a time with an Engine: map over chunks, then reduce the chunk
    summaries (recursively, while they do not fit one prompt)."""

    def __init__(self, engine, sampling, max_tokens: int,
                 instruction: str = DEFAULT_INSTRUCTION, stop: Sequence[str] = (),
                 cancel: Optional[threading.Event] = None):
        self.engine, self.sampling, self.max_tokens = engine, sampling, max_tokens
        self.instruction, self.stop = instruction, tuple(stop)
        self.cancel = cancel            # set: the call running stops, summarize() raises
        self._budgets: dict = {}        # KeyboardInterrupt (a batch of slot threads stopping)

    def messages(self, body: str, reduce: bool = False) -> list:
        """One user message, the instruction first: every call of a run (each chunk, each
        document, the reduce step) then begins with the same tokens, whose KV rows the engine
        reuses instead of reading them again."""
        head = f"{self.instruction}\n\n{REDUCE_NOTE}" if reduce else self.instruction
        return [{"role": "user", "content": f"{head}\n\n{body}"}]

    def count(self, text: str) -> int:
        return len(self.engine.model.tokenize(text, add_special=False))

    def budget(self, reduce: bool = False) -> int:
        """Tokens of document text per call: prompt tokens + max_tokens <= n_ctx, with a margin."""
        if reduce not in self._budgets:
            n_ctx = self.engine.ctx.n_ctx
            overhead = len(self.engine.tokenize_prompt(self.messages("", reduce)))
            budget = n_ctx - self.max_tokens - overhead - MARGIN_TOKENS
            if budget < MIN_BUDGET_TOKENS:
                raise LocalspecError(
                    f"--max-tokens {self.max_tokens} and the instruction ({overhead} tokens) leave "
                    f"{max(budget, 0)} of the {n_ctx}-token context for the document; raise "
                    f"--ctx or lower --max-tokens.")
            self._budgets[reduce] = budget
        return self._budgets[reduce]

    def summarize(self, text: str, on_call: Optional[Callable[[Summary], None]] = None) -> Summary:
        """Map: one call per chunk. Reduce: the joined chunk summaries, re-chunked, until one call
        covers everything. Each round must shrink the number of parts, or it would never end.

        Example: 10,000 tokens of text, a 3,500-token budget, --max-tokens 256: 3 map calls,
        then their ~768 tokens of summaries fit one reduce call: 4 calls, chunks=3.
        """
        result = Summary("")
        parts = _nonblank(split_chunks(text.strip(), self.budget(), self.count))
        result.chunks, reduce = len(parts), False
        while True:
            outs = [self._call(part.strip(), reduce, result, on_call) for part in parts]
            if len(outs) == 1:
                result.text = outs[0]
                return result
            joined = "\n\n".join(o for o in outs if o)
            if not joined:
                return result                 # every call ended at once: nothing to combine
            merged = _nonblank(split_chunks(joined, self.budget(reduce=True), self.count))
            if len(merged) >= len(parts):
                raise DocumentError(
                    f"the chunk summaries ({self.count(joined)} tokens) are no shorter than the "
                    f"text they summarise; lower --max-tokens or raise --ctx.")
            parts, reduce = merged, True

    def _call(self, body: str, reduce: bool, result: Summary, on_call) -> str:
        # The body is also the n-gram proposer's lookup document: summaries copy names, terms
        # and phrases from it, and those copies are where drafts get accepted.
        stopper = {} if self.cancel is None else {"cancel": self.cancel}
        gen = self.engine.generate(self.messages(body, reduce), self.sampling,
                                   max_tokens=self.max_tokens, stop=self.stop, document=body,
                                   **stopper)
        text = gen.complete().strip()
        if self.cancel is not None and self.cancel.is_set():
            raise KeyboardInterrupt             # the batch stops: this summary is partial
        result.stats.merge(gen.stats)
        result.calls += 1
        if on_call is not None:
            on_call(result)
        return text


def _nonblank(chunks: list) -> list:
    return [c for c in chunks if c.strip()]


# -- outputs ---------------------------------------------------------------------------------------
def output_path(out_dir: Path, src: Source, fmt: str) -> Path:
    """OUT/<relative path of the input><suffix>: docs/a/b.md -> OUT/a/b.md.summary.md."""
    return out_dir / src.rel.parent / (src.rel.name + SUFFIX[fmt])


def check_collisions(sources: Sequence[Source], out_dir: Path, fmt: str) -> None:
    owner: dict = {}
    for src in sources:
        if src.error:
            continue
        out = output_path(out_dir, src, fmt)
        if out in owner:
            raise LocalspecError(f"{owner[out]} and {src.display} would both write {out}; "
                                 "summarise them in separate runs or to separate -o directories.")
        owner[out] = src.display


def render(src: Source, summary: Summary, fmt: str) -> str:
    if fmt == "jsonl":
        return json.dumps({"path": src.display, "summary": summary.text,
                           "finish_reason": summary.stats.stop_reason, "chunks": summary.chunks,
                           "calls": summary.calls, "stats": summary.stats.to_dict()},
                          ensure_ascii=False) + "\n"
    return summary.text + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename over it: a reader (or a resumed
    batch) sees the old file or the complete new one, never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())     # mkstemp makes 0600; outputs are ordinary files
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# -- the batch -------------------------------------------------------------------------------------
class Progress:
    """What the batch reports as it goes (no-ops here; cli/summarize.py draws them on stderr)."""

    def started(self, index: int, src: Source) -> None: ...
    def call_done(self, src: Source, summary: Summary) -> None: ...
    def done(self, index: int, src: Source, summary: Summary) -> None: ...
    def skipped(self, index: int, src: Source) -> None: ...
    def failed(self, index: int, src: Source, message: str) -> None: ...


@dataclass
class BatchResult:
    total: int
    summarized: int = 0
    chunked: int = 0            # documents that needed map-reduce
    calls: int = 0
    skipped: int = 0
    failed: int = 0
    interrupted: bool = False
    stats: GenerationStats = field(default_factory=GenerationStats)

    def totals_line(self) -> str:
        st = self.stats
        line = (f"{self.summarized} document{'s' * (self.summarized != 1)} summarized "
                f"({self.calls} model call{'s' * (self.calls != 1)}, {self.chunked} map-reduce): "
                f"{st.prompt_tokens} tokens in, {st.generated_tokens} out, "
                f"{st.decode_tokens_per_s:.1f} tok/s decode, acceptance "
                f"{100 * st.acceptance_rate:.0f}% ({st.accepted}/{st.drafted} drafts)")
        if self.skipped:
            line += f"; skipped {self.skipped} existing"
        if self.failed:
            line += f"; {self.failed} failed"
        return line


def run_batch(sources: Sequence[Source], open_summarizer: Callable[[], Summarizer],
              emit: Callable[[str], None], out_dir: Optional[Path] = None, fmt: str = "text",
              force: bool = False, progress: Progress = Progress(), stdin=None) -> BatchResult:
    """Summarise every source in order. Without out_dir, `emit` gets the text for stdout.
    The model is opened on the first document that needs it (a finished batch reruns instantly).
    Ctrl-C stops between or inside documents: finished outputs stay, the partial one is dropped.
    (--parallel N: summarize_parallel.py, N documents at a time.)"""
    result, summarizer = BatchResult(len(sources)), None
    deliver = Delivery(result, progress, emit, out_dir, fmt, force)
    try:
        for i, src in enumerate(sources, 1):
            if deliver.skip(i, src):
                continue
            progress.started(i, src)
            try:
                text = read_source(src, stdin)
                if summarizer is None:
                    summarizer = open_summarizer()
                summary = summarizer.summarize(text, lambda s: progress.call_done(src, s))
            except DocumentError as e:
                deliver.failed(i, src, str(e))
                continue
            deliver.done(i, src, summary)
    except KeyboardInterrupt:
        result.interrupted = True
    return result


class Delivery:
    """What happens to each document's outcome, in the batch's order: skipped when its output
    exists, written (-o) or emitted (stdout, with headers between several), counted, shown."""

    def __init__(self, result: BatchResult, progress: Progress, emit: Callable[[str], None],
                 out_dir: Optional[Path], fmt: str, force: bool):
        self.result, self.progress, self.emit = result, progress, emit
        self.out_dir, self.fmt, self.force = out_dir, fmt, force
        self.headers = out_dir is None and fmt == "text" and result.total > 1

    def target(self, src: Source) -> Optional[Path]:
        return output_path(self.out_dir, src, self.fmt) if self.out_dir is not None else None

    def exists(self, src: Source) -> bool:
        """Whether `src`'s output exists and --force was not given: nothing to do."""
        target = self.target(src)
        return target is not None and not self.force and not src.error and target.exists()

    def skip(self, i: int, src: Source) -> bool:
        """True (and counted) when `src`'s output exists and --force was not given."""
        if self.exists(src):
            self.skipped(i, src)
            return True
        return False

    def skipped(self, i: int, src: Source) -> None:
        self.result.skipped += 1
        self.progress.skipped(i, src)

    def failed(self, i: int, src: Source, message: str) -> None:
        self.result.failed += 1
        self.progress.failed(i, src, message)

    def done(self, i: int, src: Source, summary: Summary) -> None:
        """Write or emit the summary of the i-th source (1-based). A closed stdout (`| head`)
        ends the batch quietly (BrokenPipeError goes up); an output that cannot be written is
        that document's failure."""
        target, out = self.target(src), render(src, summary, self.fmt)
        try:
            if target is not None:
                write_atomic(target, out)
            else:
                self.emit((f"==> {src.display} <==\n" if self.headers else "") + out
                          + ("\n" if self.headers and i < self.result.total else ""))
        except BrokenPipeError:
            raise
        except OSError as e:
            return self.failed(i, src, f"cannot write {target}: {e.strerror or e}")
        result = self.result
        result.summarized += 1
        result.chunked += summary.chunks > 1
        result.calls += summary.calls
        result.stats.merge(summary.stats)
        self.progress.done(i, src, summary)
