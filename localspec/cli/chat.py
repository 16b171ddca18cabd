"""`localspec chat`: options and terminal wiring (prompt, readline, piped stdin). The logic is chat.py."""

from __future__ import annotations

import sys
from typing import Callable, Optional

import click

from ..apps.chat import ChatConfig, ChatLoop, ChatSession
from ..cache.prompt_cache import check_session_name
from ..errors import LocalspecError
from ..text import check_utf8, decode_utf8
from .options import (COMMAND, build_sampling, learn_option, model_options, open_engine,
                      sampling_options, stdin, write_out)

MAX_TOKENS = 512     # a chat reply may run longer than a one-shot generate's 256


class _StdoutFailed(Exception):
    """write_out's error, carried past the loop's handling of a reply's own errors."""


class _Stdout:
    """The loop's stdout, written through write_out: a write the system refuses (`> /dev/full`)
    ends the chat with one line that names stdout, instead of blaming LOCALSPEC_HOME."""

    def write(self, text: str) -> None:
        try:
            write_out(text)
        except LocalspecError as e:
            raise _StdoutFailed(e) from None

    def flush(self) -> None:
        """write_out flushed already."""


def _terminal_reader(prompt: str) -> Callable[[], Optional[str]]:
    """Lines from a terminal. The prompt goes where it cannot pollute data: to the terminal through
    readline when stdout is one too, else to stderr."""
    if sys.stdout.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass

    def read() -> Optional[str]:
        try:
            if sys.stdout.isatty():
                return input(prompt)
            sys.stderr.write(prompt)
            sys.stderr.flush()
            return input()
        except EOFError:
            sys.stderr.write("\n")
            return None
        except UnicodeDecodeError as e:     # the terminal sent bytes that are not UTF-8
            raise LocalspecError(f"that line is not valid UTF-8 (byte 0x{e.object[e.start]:02x} "
                                 f"at offset {e.start}); set the terminal to UTF-8.") from None

    return read


def _pipe_reader() -> Callable[[], Optional[str]]:
    """One message per line, no decorations."""

    def read() -> Optional[str]:
        line = sys.stdin.buffer.readline()
        return decode_utf8(line, "that line") if line else None

    return read


def _session_name(_ctx, _param, value: Optional[str]) -> Optional[str]:
    """--save/--resume NAME checked before the chat starts, not after it ends."""
    try:
        return None if value is None else check_session_name(value)
    except LocalspecError as e:
        raise click.BadParameter(str(e)) from None


@click.command(context_settings=COMMAND)
@click.option("--system", default=None, help="System prompt (change it in the chat with /system).")
@click.option("--stats", "show_stats", is_flag=True,
              help="Print acceptance and speed after every reply, and session totals at the end "
                   "(stderr). /stats shows them at any time.")
@click.option("--save", "save_as", metavar="NAME", default=None, callback=_session_name,
              help="At the end, save the chat and its KV state as NAME (letters, digits, "
                   "'.', '_', '-'); /save does it at any time.")
@click.option("--resume", metavar="NAME", default=None, callback=_session_name,
              help="Continue the chat saved as NAME: its turns come back, and with the same "
                   "model and settings its KV state too, so nothing is re-read. Saves back to "
                   "NAME at the end unless --save names another.")
@model_options()
@learn_option(True, "On by default: one user's replies shape the drafts of their next "
                    "turns and chats (--resume included).")
@sampling_options(max_tokens=MAX_TOKENS)
def chat(system, show_stats, save_as, resume, **kw):
    """Chat with MODEL in the terminal, replies streamed as they are generated.

    Speculative decoding is on (n-gram prompt lookup by default): the text is what plain decoding
    gives, sooner. Earlier turns stay in the KV cache, so a new turn only evaluates its own tokens.
    When the context fills up, the oldest turns are dropped (the system prompt stays) with a note
    on stderr.

    \b
    In the chat: /stats, /system TEXT, /reset, /save [NAME], /exit, /help.
    Ctrl-C stops a reply and keeps what was written in the history; Ctrl-C at the
    prompt discards the line; Ctrl-D or /exit quits.

    With stdin not a terminal, each line is one user message, replies go to stdout (each one
    newline-terminated) and everything else to stderr; Ctrl-C there ends the run (exit 130) after
    stopping the reply cleanly.

    \b
    Examples:
      localspec chat --system "You are a terse assistant."
      localspec chat -m smollm2-135m -t 0.7 --stats
      printf 'Name three primes.\\nNow three more.\\n' | localspec chat > replies.txt
      localspec chat --save work        # later: localspec chat --resume work
    """
    interactive = stdin("use generate for one message").isatty()
    system = None if system is None else check_utf8(system, "--system")
    save_as = save_as or resume
    kw["cache_disk"] = bool(save_as)
    with open_engine(kw, learn=kw["learn"]) as engine:
        engine.prepare()    # measure the cost curve now, not inside (and interruptible in) a reply
        config = ChatConfig(max_tokens=kw["max_tokens"], stop=tuple(kw["stop"]))
        session = ChatSession(engine, build_sampling(kw), config, system=system,
                              notify=lambda msg: click.echo(msg, err=True))
        if resume:
            click.echo(session.resume(resume), err=True)
            if system is not None:
                session.set_system(system)
        if interactive:
            click.echo(f"localspec chat: {engine.model.path.name}, context {engine.ctx.n_ctx} "
                       f"tokens, proposer {kw['proposer']}. /help for commands, Ctrl-D to quit.",
                       err=True)
        read = _terminal_reader("> ") if interactive else _pipe_reader()
        loop = ChatLoop(session, read, _Stdout(), sys.stderr, interactive=interactive,
                        show_stats=show_stats)
        loop.save_as = save_as
        try:
            loop.run()
        except _StdoutFailed as e:
            raise e.args[0] from None
        finally:
            if loop.save_as:
                session.save(loop.save_as)
                click.echo(f"saved the chat as {loop.save_as!r} (continue it with `localspec "
                           f"chat --resume {loop.save_as}`).", err=True)
        if not interactive and loop.failed:     # a script must see that replies are missing
            which = "no message" if loop.failed == loop.replies else \
                f"{loop.replies - loop.failed} of {loop.replies} messages"
            raise LocalspecError(f"{which} got a reply ({loop.failed} failed; the reasons are "
                                 "above).")
