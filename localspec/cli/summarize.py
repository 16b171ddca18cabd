"""`localspec summarize`: options, progress on stderr, the exit code. The logic is summarize.py."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click

from .options import (COMMAND, build_sampling, learn_option, model_options, open_engine,
                      open_engines, parallel_option, parallel_slots, sampling_options, write_out)
from ..errors import LocalspecError
from ..text import check_utf8
from ..apps.summarize import (DEFAULT_GLOBS, DEFAULT_INSTRUCTION, Progress, Summarizer, Summary,
                        check_collisions, discover, parse_globs, run_batch)
from ..apps.summarize_parallel import run_parallel


@click.command(context_settings=COMMAND)
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Write one file per input here, mirroring the input tree "
                                 "(docs/a/b.md -> DIR/a/b.md.summary.md); default: stdout.")
@click.option("--format", "fmt", type=click.Choice(["text", "jsonl"]), default="text",
              show_default=True, help="jsonl: one object per document with path, summary, "
                                      "chunks, calls and stats (files: .summary.json).")
@click.option("-g", "--glob", "globs", multiple=True,
              help=f"File patterns for directories, comma-separated or repeated "
                   f"[default: {','.join(DEFAULT_GLOBS)}]. Named files are always read.")
@click.option("-i", "--instruction", default=DEFAULT_INSTRUCTION,
              help="What to ask for; the document follows it after a blank line "
                   f"[default: \"{DEFAULT_INSTRUCTION}\"].")
@click.option("-f", "--force", is_flag=True,
              help="Summarise again inputs whose output file already exists.")
@model_options(default_proposer="ngram")
@parallel_option
@learn_option(True, "On by default: summaries of similar files share their shape.")
@sampling_options()
def summarize(inputs, output_dir, fmt, globs, instruction, force, **kw):
    """Summarise files, directories (recursively) or stdin (`-`).

    Documents longer than the context are split on paragraph boundaries; each chunk is summarised,
    then the chunk summaries are summarised together. The text being summarised is the n-gram
    proposer's lookup document, so speculation accepts the names and phrases the summary copies.

    With -o, each output is written atomically and a rerun skips inputs whose output exists, so an
    interrupted batch resumes where it stopped. An unreadable, binary or empty input is reported
    and skipped; the exit code is then 1. Progress and totals go to stderr.

    --parallel N summarises N documents at a time over one loaded model (each in a slot of
    --ctx/N tokens, so long documents split into more chunks); outputs keep the input order and
    each summary is the one a lone run writes.

    \b
    Examples:
      localspec summarize -m smollm2-135m README.md
      localspec summarize docs/ -o summaries/ --glob '*.md,*.rst'
      git log -p -3 | localspec summarize -i "Summarize these changes as a bullet list." -
      localspec summarize notes/ --format jsonl > summaries.jsonl
      localspec summarize docs/ -o summaries/ --parallel 4 --ctx 16384
    """
    out_dir = output_dir
    instruction = check_utf8(instruction, "--instruction")
    if inputs.count("-") > 1:
        raise click.BadParameter("stdin (-) can be read only once.", param_hint="INPUTS")
    parallel = parallel_slots(kw)
    sources = discover(inputs, parse_globs(globs), exclude=out_dir)
    if out_dir is not None:
        check_collisions(sources, out_dir, fmt)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LocalspecError(f"cannot create the output directory {out_dir}: "
                                 f"{e.strerror or e}.") from None

    with contextlib.ExitStack() as stack:
        def open_summarizer() -> Summarizer:
            engine = stack.enter_context(open_engine(kw, learn=kw["learn"]))
            return Summarizer(engine, build_sampling(kw), kw["max_tokens"], instruction, kw["stop"])

        def open_summarizers(cancel) -> list:
            engines = stack.enter_context(open_engines(kw, learn=kw["learn"], prepare=True))
            return [Summarizer(engine, build_sampling(kw), kw["max_tokens"], instruction,
                               kw["stop"], cancel=cancel) for engine in engines]

        progress = _Bar(len(sources)) if sys.stderr.isatty() else _Lines(len(sources))
        stdin = getattr(sys.stdin, "buffer", sys.stdin)
        with progress:
            if parallel == 1:
                result = run_batch(sources, open_summarizer, _emit, out_dir, fmt, force,
                                   progress, stdin=stdin)
            else:
                result = run_parallel(sources, open_summarizers, _emit, out_dir, fmt, force,
                                      progress, stdin=stdin)
    click.echo(("interrupted: " if result.interrupted else "") + result.totals_line(), err=True)
    # sys.exit, not ctx.exit: cli.main() runs click with standalone_mode=False, which turns
    # ctx.exit(n) into a return value that it then drops (the process would exit 0).
    if result.interrupted:
        done = result.summarized + result.skipped
        click.echo(f"stopped after {done} of {result.total} documents"
                   + ("; the finished outputs are complete, rerun the same command to resume."
                      if out_dir is not None else "."), err=True)
        sys.exit(130)
    if result.failed:
        sys.exit(1)


def _emit(text: str) -> None:
    write_out(text)


def _counts(summary: Summary) -> str:
    st = summary.stats
    return (f"{summary.calls} call{'s' * (summary.calls != 1)}, {st.prompt_tokens} -> "
            f"{st.generated_tokens} tokens, {st.decode_tokens_per_s:.1f} tok/s, "
            f"accepted {100 * st.acceptance_rate:.0f}%")


CUT = ("length", "context")


def _note_if_cut(src, summary: Summary) -> None:
    """A summary that ran out of tokens may end mid-sentence: say so rather than save it quietly."""
    if summary.stats.stop_reason in CUT:
        limit = "-n/--max-tokens" if summary.stats.stop_reason == "length" else "the context"
        click.echo(f"note: the summary of {src.display} was cut by {limit} and may end "
                   f"mid-sentence; raise -n (or --ctx) for a complete one.", err=True)


class _Lines(Progress):
    """stderr is not a terminal (a log, a test): one line per document."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def done(self, index, src, summary) -> None:
        click.echo(f"[{index}/{self.n}] {src.display}: {_counts(summary)}", err=True)
        _note_if_cut(src, summary)

    def skipped(self, index, src) -> None:
        click.echo(f"[{index}/{self.n}] {src.display}: output exists, skipped", err=True)

    def failed(self, index, src, message) -> None:
        click.echo(f"[{index}/{self.n}] {src.display}: {message}; skipped", err=True)


class _Bar(_Lines):
    """stderr is a terminal: a bar over documents whose label follows the model calls."""

    def __init__(self, n: int):
        super().__init__(n)
        self._bar = click.progressbar(length=n, label="summarizing", file=sys.stderr,
                                      show_pos=True, item_show_func=lambda s: s)
        self._tokens = 0

    def __enter__(self):
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def _show(self, text: str, step: int = 0) -> None:
        self._bar.current_item = text
        self._bar.update(step) if step else self._bar.render_progress()

    def started(self, index, src) -> None:
        self._show(f"{src.display}, {self._tokens} tokens out")

    def call_done(self, src, summary) -> None:
        self._show(f"{src.display}, call {summary.calls}, "
                   f"{self._tokens + summary.stats.generated_tokens} tokens out")

    def done(self, index, src, summary) -> None:
        self._tokens += summary.stats.generated_tokens
        if summary.stats.stop_reason in CUT:
            click.echo("\r\x1b[K", err=True, nl=False)        # clear the bar's line first
            _note_if_cut(src, summary)
        self._show(f"{src.display}, {self._tokens} tokens out", step=1)

    def skipped(self, index, src) -> None:
        self._show(f"{src.display}, exists", step=1)

    def failed(self, index, src, message) -> None:
        click.echo(f"\r\x1b[K{src.display}: {message}; skipped", err=True)  # clear the bar's line
        self._show(f"{src.display}, failed", step=1)
