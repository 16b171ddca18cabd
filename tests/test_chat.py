"""`localspec chat` on the tiny GGUF: the session API (KV reuse, trimming, interruption), a piped
conversation through the real CLI, and keystrokes (Ctrl-C mid-reply, Ctrl-D) through a pseudo-terminal.

The tiny model's text is noise, so replies are compared with an in-process replay of the same
conversation (greedy decoding is deterministic) rather than with fixed strings.
"""

from __future__ import annotations

import io
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from localspec.apps.chat import ChatConfig, ChatLoop, ChatSession, sigint_cancels
from localspec.speculative.engine import Engine, EngineConfig
from localspec.errors import LocalspecError
from localspec.llama import PREFILL_GRID

# A system prompt and message whose greedy reply on the tiny model runs past 2000 tokens without an
# end-of-sequence token (found by search): long enough to interrupt mid-reply.
LONG_SYSTEM, LONG_MESSAGE = "explain how about how", "how a how sea"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """LOCALSPEC_HOME for this module: the cost curve is measured once, not in the user's cache."""
    path = tmp_path_factory.mktemp("home")
    old = os.environ.get("LOCALSPEC_HOME")
    os.environ["LOCALSPEC_HOME"] = str(path)
    yield path
    if old is None:
        del os.environ["LOCALSPEC_HOME"]
    else:
        os.environ["LOCALSPEC_HOME"] = old


def open_engine(path, n_ctx=4096):
    return Engine(path, EngineConfig(proposer="ngram", n_ctx=n_ctx, n_threads=1))


def replay(path, lines, n_ctx=4096, max_tokens=16, system=None):
    """Run lines through ChatLoop in-process; returns (stdout, stderr) text."""
    out, err = io.StringIO(), io.StringIO()
    feed = iter(lines)
    with open_engine(path, n_ctx) as engine:
        session = ChatSession(engine, config=ChatConfig(max_tokens=max_tokens), system=system,
                              notify=lambda msg: err.write(msg + "\n"))
        ChatLoop(session, lambda: next(feed, None), out, err).run()
    return out.getvalue(), err.getvalue()


def cli(path, *args):
    return [sys.executable, "-m", "localspec", "chat", "-m", str(path), "--threads", "1", *args]


def cli_env(home):
    return {**os.environ, "LOCALSPEC_HOME": str(home), "PYTHONIOENCODING": "utf-8"}


def run_piped(path, home, stdin, *args):
    proc = subprocess.run(cli(path, *args), input=stdin.encode(), capture_output=True,
                          env=cli_env(home), timeout=60)
    return proc.returncode, proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")


# -- the session API ---------------------------------------------------------------------------
def test_new_turn_evaluates_only_its_own_tokens(tiny_path, home):
    """Everything up to the previous reply comes from the KV cache: the tokens evaluated for a
    turn stay flat while the prompt grows with every turn."""
    messages = [f"turn {i}: " + "please summarise the following notes carefully. " * 8
                for i in range(5)]
    with open_engine(tiny_path) as engine:
        session = ChatSession(engine, config=ChatConfig(max_tokens=8), system="be brief")
        prompts, evaluated = [], []
        for text in messages:
            reply = session.send(text)
            prompts.append(reply.stats.prompt_tokens)
            evaluated.append(reply.stats.prefill_tokens)
    assert evaluated[0] == prompts[0]
    for n in range(1, len(messages)):
        # new = the previous reply as re-rendered + this user message + the template around them,
        # and the previous prompt's rows past its last whole prefill chunk (cached equals cold)
        tail = prompts[n - 1] % PREFILL_GRID
        assert evaluated[n] <= prompts[n] - prompts[n - 1] + tail, (prompts, evaluated)
    assert prompts[-1] > 3 * evaluated[-1], (prompts, evaluated)
    assert max(evaluated[1:]) - min(evaluated[1:]) < PREFILL_GRID + 40, evaluated   # no growth


def test_interrupted_reply_is_kept_and_session_goes_on(tiny_path, home):
    with open_engine(tiny_path) as engine:
        session = ChatSession(engine, config=ChatConfig(max_tokens=300), system=LONG_SYSTEM)
        pieces = []

        def interrupt_after_ten(piece):
            pieces.append(piece)
            if len(pieces) == 10:
                raise KeyboardInterrupt

        reply = session.send(LONG_MESSAGE, interrupt_after_ten)
        assert reply.interrupted and reply.stats.stop_reason == "cancelled"
        assert reply.text.startswith("".join(pieces)) and reply.stats.generated_tokens < 300
        assert session.turns == [(LONG_MESSAGE, reply.text.replace("\0", ""))]

        cancel = threading.Event()
        reply2 = session.send("and then?", lambda piece: cancel.set(), cancel)
        assert reply2.interrupted and reply2.stats.stop_reason == "cancelled"
        assert len(session.turns) == 2 and session.n_replies == 2

        prompt_before = session.count_tokens()
        reply3 = session.send("ok")
        assert not reply3.interrupted
        # the rows kept are the previous prompt's whole prefill chunks (cached equals cold)
        assert reply3.stats.prompt_tokens > prompt_before
        assert reply3.stats.reused_tokens == \
            reply2.stats.prompt_tokens // PREFILL_GRID * PREFILL_GRID
        assert session.total.generated_tokens == sum(
            r.stats.generated_tokens for r in (reply, reply2, reply3))


def test_full_context_drops_oldest_turns_keeps_system(tiny_path, home):
    notes = []
    with open_engine(tiny_path, n_ctx=256) as engine:
        session = ChatSession(engine, config=ChatConfig(max_tokens=16), system="be brief",
                              notify=notes.append)
        dropped = 0
        for i in range(6):
            reply = session.send(f"message {i}: tell me about the weather today")
            dropped += reply.dropped_turns
            assert session.count_tokens() <= 256
        assert dropped > 0 and any("dropped" in n for n in notes), notes
        assert session.messages[0] == {"role": "system", "content": "be brief"}
        assert session.turns[-1][0] == "message 5: tell me about the weather today"

        turns = list(session.turns)
        with pytest.raises(LocalspecError, match="not sent"):
            session.send("far too long " * 40)
        assert session.turns == turns                      # nothing changed
        assert not session.send("short again").interrupted  # and the session goes on


def test_sigint_sets_cancel_then_escalates():
    before = signal.getsignal(signal.SIGINT)
    cancel = threading.Event()
    with sigint_cancels(cancel, escalate_after_s=0.2):
        signal.raise_signal(signal.SIGINT)
        assert cancel.is_set()
        signal.raise_signal(signal.SIGINT)      # a quick double press is absorbed
        time.sleep(0.25)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # the reply is still stuck: now it interrupts
    assert signal.getsignal(signal.SIGINT) is before


def test_commands(tiny_path, home):
    out, err = replay(tiny_path, ["/help", "/system", "/system be terse", "/system", "hi",
                                  "/stats", "/reset", "/stats", "/nope", "//slash", "", "/exit",
                                  "never sent"])
    assert "/reset" in err and "no system prompt." in err and "system prompt: be terse" in err
    assert "conversation cleared." in err and "unknown command /nope" in err
    assert err.count("last reply:") == 2 and err.count("session:    1 reply,") == 2
    assert re.search(r"context: +\d+ of 4096 tokens in history \(0 turns\)", err)
    assert out.count("\n") >= 2    # "hi" and "/slash" were answered; "never sent" was not


# -- the real CLI, piped -----------------------------------------------------------------------
def test_piped_conversation(tiny_path, home):
    rc, out, err = run_piped(tiny_path, home, "hello\n/stats\nagain\n/exit\nnever sent\n", "-n", "16")
    assert rc == 0, err
    expected, _ = replay(tiny_path, ["hello", "again"], max_tokens=16)
    assert out == expected and out.endswith("\n")   # two replies, no prompt decorations
    assert "last reply:" in err and "session:" in err and "accepted" in err
    assert "> " not in out and "localspec chat:" not in err   # no banner without a terminal


def test_piped_overflow_drops_turns_and_skips_too_long(tiny_path, home):
    """The message too long for the context is skipped and the chat goes on; the run then exits
    1, so a script sees that one of its messages got no reply."""
    lines = [f"message {i}: tell me about the weather today" for i in range(5)]
    lines += ["far too long " * 40, "short again"]
    rc, out, err = run_piped(tiny_path, home, "\n".join(lines) + "\n", "--ctx", "256", "-n", "16",
                             "--system", "be brief")
    assert rc == 1, err
    assert "dropped the" in err and "it was not sent" in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("error: 6 of 7 messages got a reply (1 failed; the "
                                            "reasons are above).")
    expected, _ = replay(tiny_path, lines, n_ctx=256, max_tokens=16, system="be brief")
    assert out == expected


def test_piped_sigint_stops_the_reply_and_the_run(tiny_path, home):
    proc = subprocess.Popen(cli(tiny_path, "-n", "2000", "--stats", "--system", LONG_SYSTEM),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env(home))
    try:
        proc.stdin.write(LONG_MESSAGE.encode() + b"\nnever answered\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "no reply started"
        first = os.read(proc.stdout.fileno(), 64)       # the reply is under way
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert b"[interrupted]" in err and b"Traceback" not in err
    n_tokens = int(re.search(rb"(\d+) tokens in [\d.]+s.*stop: cancelled", err).group(1))
    assert 0 < n_tokens < 2000 and err.count(b"stop:") == 1      # one partial reply, then exit
    assert (first + out).endswith(b"\n")


# -- a real terminal ---------------------------------------------------------------------------
class Terminal:
    """A child process on a pseudo-terminal; every read has a deadline, so a test cannot hang."""

    def __init__(self, argv, env):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:   # child: the pty is its controlling terminal, so \x03 is SIGINT
            try:
                # A runner started in the background of a non-interactive shell has SIGINT
                # ignored, and Python then never installs its KeyboardInterrupt handler: undo
                # that, as a person's terminal would have it.
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.screen, self.pos = b"", 0

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:     # EIO: the child closed the terminal
            data = b""
        self.screen += data
        return bool(data)

    def expect(self, pattern: bytes, timeout: float = 20.0) -> re.Match:
        """Wait for `pattern` (a regex) after everything matched so far."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.screen, self.pos)
            if m:
                self.pos = m.end()
                return m
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.2)):
                tail = self.screen[-600:].decode("utf-8", "replace")
                raise AssertionError(f"no {pattern!r} on the screen; it ends with:\n{tail}")

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            self._read(0.1)
        raise AssertionError("the chat did not exit")

    def close(self) -> None:
        try:
            if os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        os.close(self.fd)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_terminal_ctrl_c_mid_reply_then_ctrl_d(tiny_path, home):
    argv = cli(tiny_path, "-n", "2000", "--stats", "--system", LONG_SYSTEM)
    term = Terminal(argv, {**cli_env(home), "TERM": "dumb"})
    try:
        term.expect(rb"/help for commands")
        term.expect(rb"> ")
        term.send(LONG_MESSAGE.encode() + b"\r")
        term.expect(re.escape(LONG_MESSAGE.encode()) + rb"\r?\n[\s\S]{100}")  # reply under way
        term.send(b"\x03")
        term.expect(rb"\[interrupted\]", timeout=10)
        n_tokens = int(term.expect(rb"(\d+) tokens in [\d.]+s.*stop: cancelled").group(1))
        assert 0 < n_tokens < 2000
        term.expect(rb"> ")

        term.send(b"hello\r")                    # the session is intact: the next turn answers
        term.expect(rb"hello\r?\n")
        # The prompt right after the stats line (the reply itself is noise and may hold "> ").
        term.expect(rb"tokens in [\d.]+s.*stop: (eos|length)[^\n]*\n(\r)?> ", timeout=30)

        # Ctrl-C at the prompt discards the line. Wait for the echo first: CPython's readline
        # loop only notices a signal that interrupts its select(), as a person's Ctrl-C does;
        # on a loaded machine the first one can still land early, so press again if needed.
        term.send(b"half a line")
        term.expect(rb"half a line")
        for attempt in range(3):
            time.sleep(0.3)
            term.send(b"\x03")
            try:
                term.expect(rb"line discarded; /exit or Ctrl-D quits", timeout=5)
                break
            except AssertionError:
                if attempt == 2:
                    raise
        term.expect(rb"> ")
        term.send(b"/stats\r")
        term.expect(rb"session:    2 replies")
        term.expect(rb"> ")

        term.send(b"\x04")                       # Ctrl-D quits cleanly
        assert term.wait() == 0
    finally:
        term.close()


def test_save_and_resume_continue_without_rereading(tiny_path, home):
    """--save keeps the turns and the KV rows; --resume brings both back, so the next message
    does not re-read the whole conversation, and the reply is the one an uninterrupted chat
    would have given."""
    first = ["tell me about the sea " * 4, "and about rivers " * 4]
    rc, out1, err = run_piped(tiny_path, home, "\n".join(first) + "\n", "-n", "12",
                              "--save", "notes")
    assert rc == 0 and "saved the chat as 'notes'" in err, err
    rc, out2, err = run_piped(tiny_path, home, "and lakes?\n/stats\n", "-n", "12", "--stats",
                              "--resume", "notes")
    assert rc == 0, err
    assert "resumed 'notes': 2 turns, its" in err and "tokens of KV restored" in err, err
    expected, _ = replay(tiny_path, first + ["and lakes?"], max_tokens=12)
    assert out1 + out2 == expected
    last = next(line for line in err.splitlines() if line.startswith("last reply:"))
    prompt, evaluated, reused = map(int, re.search(
        r"prompt (\d+) \((\d+) evaluated, (\d+) reused", last).groups())
    # read again: the new message with its template, and the conversation's tail past its last
    # whole prefill chunk (byte tokens on the tiny model; cached equals cold)
    assert evaluated == prompt - reused and reused > 0 and reused % PREFILL_GRID == 0, last
    assert evaluated < PREFILL_GRID + 12 + 60, last    # tail + the last reply + the message
    rc, _, err = run_piped(tiny_path, home, "", "--resume", "no-such-chat")
    assert rc == 1 and "no saved session named 'no-such-chat'" in err and "notes" in err


def test_piped_chat_whose_replies_all_fail_exits_non_zero_with_a_line_each(tiny_path, home):
    """Each message gets its line on stdout, even an empty one, so a script can pair input
    and output lines; no reply at all is a failure of the run."""
    too_long = "far too long " * 40
    rc, out, err = run_piped(tiny_path, home, f"{too_long}\n{too_long}\n", "--ctx", "64", "-n", "8")
    assert rc == 1 and out == "\n\n", (rc, out, err)
    assert err.count("it was not sent") == 2 and "error: no message got a reply (2 failed" in err
    assert "Traceback" not in err


def test_chat_save_on_a_full_disk_is_one_error_line(tiny_path, home):
    """A file-size limit makes every write past 2 KB fail as a full disk does (EFBIG, as ENOSPC
    would): the save fails with one error line and exit 1, never "this is a bug"."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    proc = subprocess.run(cli(tiny_path, "-n", "8", "--save", "full"),
                          input=b"hello there, a message long enough\n", capture_output=True,
                          env=cli_env(home), timeout=60, preexec_fn=small_files)
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "could not save 'full'" in lines[0] and "bug" not in err, err
    assert not list((home / "prompt-cache" / "sessions").glob(".*.tmp"))   # nothing half-written
