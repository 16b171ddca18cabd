"""The editor protocol's transport: whole JSON lines on a file descriptor, read and written safely
from two threads, with the real stdout reserved for protocol messages."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Iterator


class Writer:
    """Protocol messages to one file descriptor: whole lines, under a lock, written at once."""

    def __init__(self, fd: int):
        self._fd, self._lock = fd, threading.Lock()
        self.broken = False

    def send(self, msg: dict) -> bool:
        """False when the client has gone (closed its end of the pipe)."""
        try:
            data = json.dumps(msg, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        except UnicodeEncodeError:
            data = json.dumps(msg, separators=(",", ":")).encode("ascii")
        return self.send_raw(data)

    def send_raw(self, data: bytes) -> bool:
        """One message already encoded (no newline): as send()."""
        view = memoryview(data + b"\n")
        with self._lock:
            try:
                while view and not self.broken:
                    view = view[os.write(self._fd, view):]
            except OSError:
                self.broken = True
            return not self.broken


def read_lines(fd: int) -> Iterator[bytes]:
    """Lines of `fd` without '\\n', until EOF. os.read, not sys.stdin: a daemon thread blocked
    here holds no Python-level lock that interpreter shutdown would wait for."""
    buf = bytearray()
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            if buf:
                yield bytes(buf)
            return
        buf += data
        if b"\n" in data:
            *lines, rest = bytes(buf).split(b"\n")
            buf = bytearray(rest)
            yield from lines


def take_stdout() -> int:
    """Reserve the real stdout for protocol messages and return its fd. From here on fd 1 and
    sys.stdout lead to stderr, so a stray print() or a C library's printf cannot corrupt it."""
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return fd
