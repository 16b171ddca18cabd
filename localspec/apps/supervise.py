"""Servers that outlive their RPC servers. With --rpc, a lost or silent `localspec rpc-server`
ends the process that uses it (ggml aborts inside llama.cpp, see llama/rpc.py), so `serve --rpc`
runs its engine in a child process and stays up itself:

- `--stdio`: this process owns stdin and stdout and passes each line through to the child and
  back, noting which requests are unanswered. When the child dies, each of them is answered with
  an error; the next request starts a new child (the model is loaded again: a recovered backend,
  or, if the server is still gone, that request's error).
- `--http`: this process owns the listening socket and hands it to each child; the child
  answers its own running and queued requests with an error before it exits (http_server.py).
  Until a new child serves, this process answers 503 with the reason and Retry-After.

A child that fails before it ever served is not restarted: its error line (a missing model, a
server never reachable) ends this process with its exit status, as without --rpc.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Iterable, Optional

from .checks import parse_json
from .protocol_requests import NOTE, RpcError, parse_envelope
from .stdio import Writer

SUPERVISED = "LOCALSPEC_SUPERVISED"     # set in the child: serve, do not supervise again
LISTEN_FD = "LOCALSPEC_LISTEN_FD"       # --http: the listening socket the child serves on
READY_FD = "LOCALSPEC_READY_FD"         # --http: the child writes one byte there once serving
LOST = -32003                           # the protocol's error code for "the backend was lost"
_BACKOFF_S = (1, 2, 4, 8, 15, 30)


def supervised() -> bool:
    return bool(os.environ.get(SUPERVISED))


def child_command(argv: Iterable[str]) -> list:
    return [sys.executable, "-m", "localspec", *argv]


class _StderrTap:
    """Copies a child's stderr to ours, remembering its last `error:` line for the answers."""

    def __init__(self, stream):
        self.last_error = ""
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith("error: "):
                self.last_error = line[len("error: "):]
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def join(self) -> None:
        self._thread.join(5)


def _request_id(line: bytes):
    """The id of a request that expects an answer, else None (notifications, garbage: the
    child answers those itself, at once)."""
    try:
        rid = parse_envelope(line)[0]
    except RpcError:
        return None
    return None if rid is NOTE else rid


class StdioSupervisor:
    """`serve --stdio --rpc`: the module's docstring."""

    def __init__(self, argv: list, writer: Writer):
        self._cmd, self._writer = child_command(argv), writer
        self._lock = threading.Lock()
        self._child: Optional[subprocess.Popen] = None
        self._pending: set = set()           # ids (as JSON) sent to the child, unanswered
        self._served = False                 # some child answered something: restart them
        self._stopping = False               # EOF or a signal: the child's end is this one's

    def run(self, lines: Iterable[bytes]) -> int:
        _forward_signals(lambda: self._child, self._stop)
        for line in lines:
            if not line.strip():
                continue
            with self._lock:
                child = self._child or self._spawn()
                rid = _request_id(line)
                if rid is not None:
                    self._pending.add(json.dumps(rid))
            try:
                child.stdin.write(line + b"\n")
                child.stdin.flush()
            except OSError:
                pass                         # it died: its waiter answers what it had
        with self._lock:
            child, self._stopping = self._child, True
        if child is None:
            return 0
        try:
            child.stdin.close()              # EOF: the child ends its work and exits 0
        except OSError:
            pass
        while True:
            time.sleep(60)                   # the waiter ends this process with its status

    def _stop(self) -> None:
        self._stopping = True

    def _spawn(self) -> subprocess.Popen:
        child = subprocess.Popen(self._cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env={**os.environ, SUPERVISED: "1"},
                                 start_new_session=True)   # signals reach it through us only
        self._child = child
        tap = _StderrTap(child.stderr)
        out = threading.Thread(target=self._pump, args=(child,), daemon=True)
        out.start()
        threading.Thread(target=self._wait, args=(child, out, tap), daemon=True).start()
        return child

    def _pump(self, child: subprocess.Popen) -> None:
        """The child's protocol messages, passed on whole; answered ids leave the pending set."""
        for raw in iter(child.stdout.readline, b""):
            line = raw.rstrip(b"\n")
            try:
                msg = parse_json(line)
            except ValueError:
                msg = None
            if isinstance(msg, dict) and ("result" in msg or "error" in msg):
                with self._lock:
                    self._pending.discard(json.dumps(msg.get("id")))
                    self._served = True
            self._writer.send_raw(line)

    def _wait(self, child: subprocess.Popen, out: threading.Thread, tap: _StderrTap) -> None:
        code = child.wait()
        out.join(5)
        tap.join()
        with self._lock:
            self._child = None
            if code == 0 or not self._served or self._stopping:
                os._exit(code if code >= 0 else 128 - code)   # its end is ours; all was written
            why = tap.last_error or f"the engine process ended (status {code})"
            for key in sorted(self._pending):
                self._writer.send({"jsonrpc": "2.0", "id": json.loads(key), "error": {
                    "code": LOST, "message": f"{why} The next request loads the model again."}})
            self._pending.clear()


def _forward_signals(child, stop) -> None:
    """SIGINT and SIGTERM to this process go on to the child (in its own session, it gets no
    terminal signal of its own), whose exit then ends this process."""
    def forward(signum, _frame):
        stop()
        proc = child()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            sys.exit(128 + signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)


def serve_stdio_supervised(argv: list, protocol_fd: int, stdin_fd: int) -> int:
    from .stdio import read_lines
    return StdioSupervisor(argv, Writer(protocol_fd)).run(read_lines(stdin_fd))


class HttpSupervisor:
    """`serve --http --rpc`: the module's docstring."""

    def __init__(self, argv: list, sock: socket.socket, say=print):
        self._cmd, self._sock, self._say = child_command(argv), sock, say
        self._reason = "the model is loading"

    def run(self) -> int:
        served, attempt = False, 0
        self._child: Optional[subprocess.Popen] = None
        self._stopping = False
        _forward_signals(lambda: self._child, lambda: setattr(self, "_stopping", True))
        while True:
            code, ready = self._run_child()
            if self._stopping:
                return code
            if not ready and not served:
                return code                   # never served: its error line said why
            if code == 0 or code in (130, 143):
                return code                   # stopped on purpose
            served = served or ready
            attempt = 0 if ready else attempt + 1
            wait = _BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)]
            self._say(f"localspec: the engine process ended (status {code}); serving 503 and "
                      f"starting it again in {wait} s.")
            self._answer_503_for(wait)

    def _run_child(self) -> tuple:
        r, w = os.pipe()
        env = {**os.environ, SUPERVISED: "1", LISTEN_FD: str(self._sock.fileno()),
               READY_FD: str(w)}
        self._child = child = subprocess.Popen(
            self._cmd, env=env, pass_fds=(self._sock.fileno(), w), stderr=subprocess.PIPE,
            start_new_session=True)
        os.close(w)
        tap = _StderrTap(child.stderr)
        code = child.wait()
        self._child = None
        tap.join()
        ready = bool(select.select([r], [], [], 0)[0] and os.read(r, 1))
        os.close(r)
        self._reason = tap.last_error or f"the engine process ended (status {code})"
        return (code if code >= 0 else 128 - code), ready

    def _answer_503_for(self, seconds: float) -> None:
        """Answer whoever connects, for `seconds`: 503, why, and when to retry."""
        body = json.dumps({"error": {"message": f"{self._reason} (restarting the engine)",
                                     "type": "server_error", "code": "backend_unavailable"}})
        reply = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                 f"Retry-After: {max(1, round(seconds))}\r\nConnection: close\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if not select.select([self._sock], [], [], left)[0]:
                continue
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    head = b""
                    while b"\r\n\r\n" not in head and len(head) < 65536:
                        data = conn.recv(4096)
                        if not data:
                            break
                        head += data
                    conn.sendall(reply)
                except OSError:
                    pass


def ready_signal() -> None:
    """In an --http child: tell the supervisor that the server is up."""
    fd = os.environ.pop(READY_FD, None)
    if fd:
        try:
            os.write(int(fd), b"1")
            os.close(int(fd))
        except (OSError, ValueError):
            pass
