"""Bounded waits on RPC servers. ggml's RPC client waits for ever on a server that stops
answering (stopped, swapped out, a network that drops packets), inside a llama.cpp call where
Python, and so Ctrl-C, cannot run. A watcher thread, started when the first server is attached:
- puts a receive and send timeout (LOCALSPEC_RPC_TIMEOUT seconds, default 120) on ggml's sockets
  to the servers, so a silent server makes ggml's wait fail and end in its abort hook (C, armed
  by rpc.py), which writes one error line; this thread then runs the on_lost callbacks;
- takes Ctrl-C through a wakeup fd; when the main thread has not come back to Python a few
  seconds after it, it is stuck in such a call: one error line and exit 130.

Example: LOCALSPEC_RPC_TIMEOUT=30 localspec generate --rpc 10.0.0.2:50052 ...
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading
import time
from typing import Callable, Iterable, Optional

from ..files import env_number
from . import native

TIMEOUT_ENV = "LOCALSPEC_RPC_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0
GRACE_S = 3.0               # Ctrl-C unanswered this long: the main thread is stuck in llama.cpp
_SCAN_S = 0.25              # how often new sockets of ggml's are looked for


def timeout_s() -> float:
    """LOCALSPEC_RPC_TIMEOUT, checked: seconds a server may stay silent in one exchange."""
    return env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, "seconds",
                      "how long an RPC server may stay silent")


def peers_of(endpoints: Iterable[str], split: Callable[[str], tuple]) -> set:
    """(address, port) pairs the endpoints resolve to: what ggml's sockets are connected to."""
    peers = set()
    for endpoint in endpoints:
        host, port = split(endpoint)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            continue
        peers.update((info[4][0], port) for info in infos)
    return peers


class Watch:
    """The watcher thread of one process (see the module's docstring)."""

    def __init__(self, describe: Callable[[], str], timeout: float,
                 on_lost: Callable[[str], None]):
        self._describe = describe        # "RPC server a:1, b:2", read when a line is written
        self._on_lost = on_lost          # called here with ggml's reason once its hook ran
        self.timeout = timeout
        self._peers: set = set()
        self._seen: set = set()          # socket inodes already looked at
        self._lock = threading.Lock()
        self._wake_r: Optional[socket.socket] = None
        self.interrupted = False         # set once Ctrl-C arrived: the abort hook says so

    def add_peers(self, peers: set) -> None:
        with self._lock:
            self._peers |= peers
            self._seen.clear()           # look again: a socket seen earlier may be to these

    def start(self) -> None:
        self._wake_r = self._take_sigint()
        threading.Thread(target=self._run, name="localspec-rpc-watch", daemon=True).start()

    def _take_sigint(self) -> Optional[socket.socket]:
        """Python's C-level handler writes each signal's number to the wakeup fd even while the
        main thread is inside llama.cpp. Only the main thread may set it, and only when nobody
        else (an asyncio loop) has."""
        if threading.current_thread() is not threading.main_thread():
            return None
        r, w = socket.socketpair()
        w.setblocking(False)
        previous = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            r.close(), w.close()
            return None
        self._wake_w = w                 # kept open for the life of the process
        return r

    def _run(self) -> None:
        while True:
            self.secure()
            why = native.lost_pending()
            if why is not None:
                self._on_lost(why)       # ggml's thread exits the process after this
                return
            if self._wake_r is None:
                time.sleep(_SCAN_S)
                continue
            self._wake_r.settimeout(_SCAN_S)
            try:
                data = self._wake_r.recv(64)
            except socket.timeout:
                continue
            except OSError:
                return
            if signal.SIGINT in data:
                self._after_sigint()

    def secure(self) -> None:
        """Put the timeouts on every socket to a server that has not been looked at yet. A wait
        that began before is not bounded, so the llama layer also calls this as soon as loading
        a model or making a context may have opened one (rpc.secure())."""
        limit = struct.pack("ll", int(self.timeout), int(self.timeout % 1 * 1e6))
        try:
            fds = os.listdir("/proc/self/fd")
        except OSError:
            return                       # not Linux: no bound, as before
        with self._lock:
            for name in fds:
                try:
                    link = os.readlink(f"/proc/self/fd/{name}")
                except OSError:
                    continue
                if not link.startswith("socket:") or link in self._seen:
                    continue
                self._seen.add(link)
                try:
                    with socket.socket(fileno=os.dup(int(name))) as s:
                        if s.family in (socket.AF_INET, socket.AF_INET6) and \
                                tuple(s.getpeername()[:2]) in self._peers:
                            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
                            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
                except OSError:
                    continue

    def _after_sigint(self) -> None:
        """A Ctrl-C normally reaches Python's handler as soon as the current llama.cpp call
        returns, which moves the main thread on. Still at the same instruction of the llama
        layer GRACE_S later, it is waiting on a server: end the process, nothing else can."""
        self.interrupted = True
        native.interrupted()             # the abort hook's line says "interrupted" now
        main = threading.main_thread().ident
        before = _where(main)
        time.sleep(GRACE_S)
        if before is None or _where(main) != before or not before[2].startswith(_HERE):
            return                       # moved on, or waiting elsewhere (a prompt's input())
        sys.stderr.write(f"error: interrupted while llama.cpp waited for {self._describe()}; "
                         "it may be stalled (check `localspec rpc-server` there).\n")
        sys.stderr.flush()
        os._exit(130)


_HERE = os.path.dirname(os.path.abspath(__file__))    # the llama layer: where its C calls are


def _where(thread_id) -> Optional[tuple]:
    """(frame, instruction, file) the thread is at: unchanged while it is inside one C call."""
    frame = sys._current_frames().get(thread_id)
    return None if frame is None else (id(frame), frame.f_lasti, frame.f_code.co_filename)
