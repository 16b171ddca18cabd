"""A chat session and its command loop: history, system prompt, trimming to fit the context, stats.

No terminal here: ChatSession is driven by method calls, ChatLoop by a line-reading callable and two
text streams, so both are tested directly. Terminal specifics (readline, `> `) live in cli/chat.py.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, List, Optional, TextIO, Tuple

from ..speculative.engine import Engine
from ..errors import LocalspecError
from ..speculative.sampling import SamplingParams
from ..speculative.stats import GenerationStats


@dataclass(frozen=True)
class ChatConfig:
    """max_tokens: reply budget. headroom: when old turns must go, drop enough that this fraction
    of the context is left spare beyond max_tokens, so the next turns reuse the KV cache instead
    of re-evaluating the whole (shifted) conversation after every single trim."""

    max_tokens: int = 512
    stop: Tuple[str, ...] = ()
    headroom: float = 0.25


@dataclass
class Reply:
    text: str
    stats: GenerationStats
    interrupted: bool = False     # Ctrl-C or the cancel event stopped it
    dropped_turns: int = 0        # oldest turns dropped to make room for this one
    budget: int = 0               # tokens it was allowed: max_tokens, or less where the context
                                  # had less room left


class ChatSession:
    """The conversation: an optional system prompt plus (user, assistant) turns.

    An interrupted reply is kept in history as it stands, unmarked: the model then sees exactly
    what the user saw, and its tokens are still in the KV cache for the next turn to reuse. A reply
    interrupted before any text leaves no turn behind (the user message is not recorded).
    """

    def __init__(self, engine: Engine, sampling: SamplingParams = SamplingParams(),
                 config: ChatConfig = ChatConfig(), system: Optional[str] = None,
                 notify: Callable[[str], None] = lambda msg: None):
        self.engine, self.sampling, self.config = engine, sampling, config
        self.set_system(system)
        self.turns: List[Tuple[str, str]] = []
        self.notify = notify
        self.last: Optional[GenerationStats] = None
        self.total = GenerationStats()
        self.n_replies = 0

    @property
    def messages(self) -> list:
        """The history as chat messages, system prompt first."""
        return self._render(self.turns)

    def _render(self, turns: List[Tuple[str, str]], extra: Optional[str] = None) -> list:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for user, assistant in turns:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return msgs + ([{"role": "user", "content": extra}] if extra is not None else [])

    def reset(self) -> None:
        """Forget the turns; keep the system prompt and the session statistics."""
        self.turns = []

    def save(self, name: str) -> None:
        """Keep the conversation and its KV rows under `name` (the prompt cache's sessions), so
        `localspec chat --resume NAME` continues it without re-reading it."""
        cache = self.engine.cache
        if cache is None or cache.disk_dir is None:
            raise LocalspecError("saving a chat needs the prompt cache on disk: start the chat "
                                 "with --save NAME or --resume NAME.")
        cache.save_named(name, self.engine.ctx, {"system": self.system,
                                                 "turns": [list(t) for t in self.turns]})

    def resume(self, name: str) -> str:
        """Load the conversation saved as `name`; its KV rows come back when the model and
        settings match (else the next message re-reads it). Returns a line for the user."""
        cache = self.engine.cache
        if cache is None or cache.disk_dir is None:
            raise LocalspecError("resuming a chat needs the prompt cache (drop --cache-mb 0).")
        session = cache.load_named(name, self.engine.ctx)
        turns, system = session.meta.get("turns"), session.meta.get("system")
        if not (isinstance(turns, list) and all(isinstance(t, list) and len(t) == 2 and
                                                all(isinstance(x, str) for x in t) for t in turns)
                and (system is None or isinstance(system, str))):
            raise LocalspecError(f"the saved chat {name!r} does not hold a conversation; start "
                                 "a new one or pick another name.")
        self.turns, self.system = [tuple(t) for t in turns], system
        how = (f"its {session.reuse.reused} tokens of KV restored in "
               f"{session.reuse.restore_ms:.0f} ms" if session.reuse.reused else
               "the next message re-reads it")
        return f"resumed {name!r}: {_plural(len(self.turns), 'turn')}, {how}."

    def set_system(self, text: Optional[str]) -> None:
        self.system = text.replace("\0", "") if text else None

    def count_tokens(self, extra: Optional[str] = None) -> int:
        """Prompt tokens of the history (+ a new user message), as the engine would render it."""
        return self._count(self.turns, extra.replace("\0", "") if extra is not None else None)

    def _count(self, turns: List[Tuple[str, str]], extra: Optional[str] = None) -> int:
        msgs = self._render(turns, extra)
        return len(self.engine.tokenize_prompt(msgs)) if msgs else 0

    def send(self, text: str, on_piece: Callable[[str], None] = lambda piece: None,
             cancel: Optional[threading.Event] = None) -> Reply:
        """Ask `text`; stream the reply through `on_piece`; record the turn; return the reply.

        KeyboardInterrupt while the reply runs (or `cancel` set) stops it and returns normally
        with interrupted=True. A message that cannot fit the context even alone raises
        LocalspecError and changes nothing; dropped turns and a shortened budget go to notify.
        """
        text = text.replace("\0", "")   # a NUL would cut the message short in the C template API
        dropped, budget = self._make_room(text)
        msgs = self._render(self.turns, text)
        try:
            gen = self.engine.generate(msgs, self.sampling, max_tokens=budget,
                                       stop=self.config.stop, cancel=cancel)
        except KeyboardInterrupt:     # before the first token (tokenizing, calibrating)
            return Reply("", GenerationStats(stop_reason="cancelled"), True, dropped, budget)
        interrupted = False
        try:
            for piece in gen:
                on_piece(piece)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            gen.close()      # runs the engine's cleanup now: KV = prompt + emitted tokens
            self._record(gen.stats)
        interrupted = interrupted or gen.stats.stop_reason == "cancelled"
        if gen.text or not interrupted:
            self.turns.append((text, gen.text.replace("\0", "")))
        return Reply(gen.text, gen.stats, interrupted, dropped, budget)

    def _record(self, stats: GenerationStats) -> None:
        self.last = stats
        self.total.merge(stats)
        self.n_replies += 1

    def _make_room(self, text: str) -> Tuple[int, int]:
        """Drop the oldest turns until prompt + max_tokens fits n_ctx. Returns (dropped, budget).

        Example: n_ctx 1024, max_tokens 256, headroom 0.25: a prompt of 900 tokens does not fit
        (900 + 256 > 1024), so turns go until the prompt is <= 1024 - 256 - 256 = 512 tokens.
        """
        n_ctx, max_tokens = self.engine.ctx.n_ctx, self.config.max_tokens
        n_prompt = self._count(self.turns, text)
        dropped = 0
        if n_prompt + max_tokens > n_ctx:
            limit = n_ctx - max_tokens
            target = limit - int(self.config.headroom * n_ctx) if limit > 0 else limit
            while dropped < len(self.turns) and n_prompt > target:
                dropped += 1
                n_prompt = self._count(self.turns[dropped:], text)
        if n_prompt + 1 >= n_ctx:     # the engine needs n_prompt < n_ctx, and room for a token
            raise LocalspecError(
                f"this message takes {n_prompt} tokens with the system prompt but the context "
                f"holds {n_ctx}; it was not sent. Shorten it or raise --ctx.")
        del self.turns[:dropped]
        if dropped:
            self.notify(f"context full ({n_ctx} tokens): dropped the {_plural(dropped, 'oldest turn')}"
                        f"; {len(self.turns)} kept.")
        budget = min(max_tokens, n_ctx - n_prompt)
        if budget < max_tokens:
            self.notify(f"only {budget} tokens of context left for this reply (raise --ctx or "
                        f"lower -n).")
        return dropped, budget

    # -- statistics ----------------------------------------------------------------------------
    def stats_report(self) -> str:
        """Lines for /stats: the last reply, the session totals, the context in use."""
        if self.last is None:
            return "no replies yet."
        t = self.total
        session = (f"{_plural(self.n_replies, 'reply')}, {t.generated_tokens} tokens, "
                   f"{t.decode_tokens_per_s:.1f} tok/s decode, "
                   f"accepted {t.accepted}/{t.drafted} ({100 * t.acceptance_rate:.0f}%), "
                   f"{t.mean_accepted_len:.2f} tokens/step; prompt tokens evaluated "
                   f"{t.prefill_tokens} of {t.prompt_tokens} ({t.prefill_ms:.0f} ms)")
        used, n_ctx = self.count_tokens(), self.engine.ctx.n_ctx
        context = f"{used} of {n_ctx} tokens in history ({_plural(len(self.turns), 'turn')})"
        if used >= n_ctx:   # a reply that filled the context, plus the template's end of turn
            context = (f"the history ({used} tokens, {_plural(len(self.turns), 'turn')}) has "
                       f"outgrown the {n_ctx}-token context: the oldest turns go with the next "
                       "message")
        return (f"last reply: {self.last.summary()}\n"
                f"session:    {session}\n"
                f"context:    {context}")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun[:-1] + 'ies' if noun.endswith('y') else noun + 's'}"


HELP = """\
commands:
  /stats         acceptance and speed of the last reply and of the whole session
  /system TEXT   replace the system prompt (the history is kept); /system alone shows it,
                 /system - removes it
  /reset         forget the conversation (the system prompt and session stats stay)
  /save [NAME]   save the chat and its KV state (`localspec chat --resume NAME` continues it)
  /exit          quit (or Ctrl-D)
  /help          this list
Ctrl-C stops a reply (what was written stays in the history); //text sends "/text"."""


@contextmanager
def sigint_cancels(cancel: threading.Event, escalate_after_s: float = 0.5) -> Iterator[None]:
    """While a reply runs, Ctrl-C sets `cancel`: the engine stops within one speculative step and
    keeps its KV consistent. SIGINT arriving inside a llama.cpp call is handled when that call
    returns. Only if the reply is still running `escalate_after_s` later (a long prefill does not
    look at `cancel`) does another Ctrl-C raise KeyboardInterrupt; a quick double press must not
    land in the middle of the engine's cleanup."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed_at: list = []            # monotonic time of the first Ctrl-C

    def on_sigint(_signum, _frame):
        if not pressed_at:
            pressed_at.append(time.monotonic())
            cancel.set()
        elif time.monotonic() - pressed_at[0] >= escalate_after_s:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatLoop:
    """Reads lines, runs commands or sends messages; replies to `out`, everything else to `err`.

    read_line() returns a line, or None at end of input; it may raise KeyboardInterrupt. With
    interactive=True, Ctrl-C at the prompt discards the line and reads again, and Ctrl-C during a
    reply returns to the prompt. Otherwise (piped input) either one stops the reply cleanly and
    then ends the loop with KeyboardInterrupt.
    """

    def __init__(self, session: ChatSession, read_line: Callable[[], Optional[str]],
                 out: TextIO, err: TextIO, interactive: bool = False, show_stats: bool = False,
                 guard: Callable[[threading.Event], ContextManager] = sigint_cancels):
        self.session, self.read_line, self.out, self.err = session, read_line, out, err
        self.interactive, self.show_stats, self.guard = interactive, show_stats, guard
        self.save_as: Optional[str] = None     # where /save (no name) and the exit save go
        self.replies = self.failed = 0         # messages sent, and those that got no reply

    def run(self) -> None:
        while True:
            reading = True
            try:
                line = self.read_line()
                reading = False
                if line is None or not self.handle(line):
                    break
            except LocalspecError as e:  # a line that cannot be read as text: say so, go on
                self._say(f"error: {e} It was not sent.")
            except KeyboardInterrupt:   # at the prompt, or a late second Ctrl-C after a reply
                if not self.interactive:
                    raise
                self._say("\n(line discarded; /exit or Ctrl-D quits)" if reading
                          else "\n[interrupted]")
        if self.show_stats and self.session.last is not None:
            self._say(self.session.stats_report())

    def handle(self, line: str) -> bool:
        """One input line. Returns False when the session should end."""
        line = line.rstrip("\r\n")
        if not line.strip():
            return True
        if line.startswith("/") and not line.startswith("//"):
            return self._command(line)
        self._reply(line[1:] if line.startswith("//") else line)
        return True

    def _command(self, line: str) -> bool:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        s = self.session
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self._say(HELP)
        elif name == "/stats":
            self._say(s.stats_report())
        elif name == "/reset":
            s.reset()
            self._say("conversation cleared.")
        elif name == "/save":
            target = arg or self.save_as
            if not target:
                self._say("/save NAME saves the chat (resume it with `localspec chat --resume "
                          "NAME`).")
            else:
                try:
                    s.save(target)
                    self.save_as = target
                    self._say(f"saved as {target!r}.")
                except LocalspecError as e:
                    self._say(f"error: {e}")
        elif name == "/system":
            if not arg:
                self._say(f"system prompt: {s.system}" if s.system else "no system prompt.")
            else:
                s.set_system(None if arg == "-" else arg)
                self._say("system prompt removed." if arg == "-" else "system prompt set.")
        else:
            self._say(f"unknown command {name}; /help lists them (//text sends a message "
                      "starting with /).")
        return True

    def _reply(self, text: str) -> None:
        cancel = threading.Event()
        wrote = False

        def write(piece: str) -> None:
            nonlocal wrote
            self.out.write(piece)
            self.out.flush()
            wrote = True

        self.replies += 1
        try:
            with self.guard(cancel):
                reply = self.session.send(text, write, cancel)
        except LocalspecError as e:     # e.g. the message alone does not fit: say so, carry on
            self.failed += 1
            self.out.write("\n")        # one line per message on stdout, as a reply would end
            self.out.flush()
            self._say(f"error: {e}")
            return
        if wrote or not reply.interrupted:
            self.out.write("\n")
            self.out.flush()
        if reply.interrupted:
            self._say("[interrupted]" + ("" if reply.text else " (nothing written; turn dropped)"))
        elif reply.stats.stop_reason == "length" and reply.budget >= self.session.config.max_tokens:
            self._say(f"[reply cut at {reply.stats.generated_tokens} tokens; raise -n for more]")
        elif reply.stats.stop_reason in ("length", "context"):
            self._say(f"[reply cut at {reply.stats.generated_tokens} tokens: the context "
                      f"({self.session.engine.ctx.n_ctx} tokens) is full; raise --ctx, or /reset "
                      "to start over]")
        if self.show_stats:
            self._say(reply.stats.summary())
        if reply.interrupted and not self.interactive:
            raise KeyboardInterrupt   # a script's Ctrl-C means stop the run, not the next line

    def _say(self, msg: str) -> None:
        self.err.write(msg + "\n")
        self.err.flush()
