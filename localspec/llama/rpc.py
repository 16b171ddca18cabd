"""llama.cpp's RPC backend (ggml-rpc): run a model's layers on `localspec rpc-server` processes on
other hosts (`--rpc HOST:PORT,...`), and run such a server. The protocol is unauthenticated: anyone
who can reach a server's port can allocate its memory and run computations on it.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
from typing import Callable, Iterable, Optional

from ..errors import LocalspecError
from . import native
from . import backend as _b
from .backend import OFFLOAD_TYPES, device_handles
from .registry import backend_proc, backend_reg
from .rpc_watch import TIMEOUT_ENV, Watch, peers_of, timeout_s

PROTOCOL_MAJOR = 7          # RPC_PROTO_MAJOR_VERSION of the pinned build: both ends must agree
_HELLO, _CAPS = 14, 24      # RPC_CMD_HELLO and RPC_CONN_CAPS_SIZE in that source
DEFAULT_PORT = 50052        # llama.cpp's rpc-server default
_attached: list = []        # endpoints whose devices llama.cpp has, in order
_watch: Optional[Watch] = None   # bounds the waits on them (rpc_watch.py), once one is attached
_on_lost: list = []              # callbacks(message) run before a lost server ends the process


def parse_servers(value: str) -> tuple:
    """'a:1,b:2' -> ('a:1', 'b:2'), each checked to be HOST:PORT."""
    servers = tuple(s.strip() for s in value.split(",") if s.strip())
    for s in servers:
        split_endpoint(s)
    return servers


def split_endpoint(endpoint: str) -> tuple:
    host, _, port = endpoint.rpartition(":")
    if not host or ":" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LocalspecError(f"RPC server {endpoint!r} is not HOST:PORT (e.g. 192.168.1.7:50052; "
                             "ggml's RPC client takes IPv4 addresses and host names).")
    return host, int(port)


def probe(endpoint: str, timeout: float = 10.0) -> tuple:
    """Connect and exchange HELLO; returns the server's protocol version (major, minor, patch).

    ggml aborts the whole process when a server cannot be reached or answers wrongly, so each
    one is checked here first, where a failure can still be one line."""
    host, port = split_endpoint(endpoint)
    hint = f"start one there with `localspec rpc-server --port {port}`"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(bytes([_HELLO]) + struct.pack("<Q", _CAPS) + bytes(_CAPS))
            reply = b""
            while len(reply) < 8 + 4 + _CAPS:
                data = sock.recv(256)
                if not data:
                    break
                reply += data
    except socket.timeout:
        raise LocalspecError(f"RPC server {endpoint} did not answer within {timeout:.0f} s (it "
                             "serves one client at a time: is another one using it?).") from None
    except OSError as e:
        raise LocalspecError(f"cannot reach RPC server {endpoint}: {e.strerror or e}; {hint}.") \
            from None
    if len(reply) < 11 or struct.unpack("<Q", reply[:8])[0] != 4 + _CAPS:
        raise LocalspecError(f"{endpoint} does not answer as a ggml RPC server of this version; "
                             f"{hint}.")
    version = tuple(reply[8:11])
    if version[0] != PROTOCOL_MAJOR:
        raise LocalspecError(f"RPC server {endpoint} speaks protocol {'.'.join(map(str, version))}"
                             f", this build {PROTOCOL_MAJOR}.x: run the same localspec there.")
    return version


def _entry(name: str, prototype):
    """An RPC backend function, looked up as llama.cpp's own tools do: through the registry."""
    reg = backend_reg("RPC")
    if not reg:
        raise LocalspecError("this llama.cpp build has no RPC backend (GGML_RPC=ON); reinstall "
                             "with ./install.sh, which builds it.")
    addr = backend_proc(reg, name)
    if not addr:
        raise LocalspecError(f"the RPC backend of this llama.cpp build lacks {name}.")
    return prototype(addr)


_LOST_HINT = "; check that `localspec rpc-server` still runs there."
_LOST_WAIT_MS = 10_000      # how long ggml's thread waits for the on_lost callbacks, at most
_lost_line = [""]           # what the abort hook says before ggml's reason


def _arm_lost_hook(limit: float) -> None:
    """ggml aborts the process when a server dies, answers garbage or stays silent past the
    timeout mid-decode, with no way back into Python. Its abort hook is C (native_guard): it
    writes the one line prepared here (with ggml's reason), flags it, and exits 1 once the
    watcher thread has run the on_lost callbacks (or after _LOST_WAIT_MS); after a Ctrl-C the
    line says "interrupted" and the exit is 130. No Python runs on ggml's thread."""
    where = f"{limit:g} s, {TIMEOUT_ENV}" if limit else "no timeout"
    _lost_line[0] = (f"lost {_servers()}: it closed the connection, answered garbage or stayed "
                     f"silent ({where})")
    native.set_lost(_lost_line[0], _LOST_HINT, f"interrupted while llama.cpp used {_servers()}",
                    _LOST_WAIT_MS)
    _b.ggml_function("ggml_set_abort_callback", ctypes.c_void_p, ctypes.c_void_p)(
        native.address("lsn_abort_hook"))


def _report_lost(why: str) -> None:
    """On the watcher thread, once ggml's abort hook has written its line: tell the callbacks
    (a server answers its clients), then let the hook end the process."""
    line = f"{_lost_line[0]} ({why}){_LOST_HINT}"     # the line the hook wrote, less "error: "
    for callback in _on_lost:
        try:
            callback(line)
        except Exception:                # nothing may stop the exit
            pass
    sys.stderr.flush()
    native.release()


def on_lost(callback: Callable[[str], None]) -> None:
    """Run callback(message) on the watcher thread (a Python thread) just before a lost server
    ends the process: a server answers its clients there (it must return within a few
    seconds)."""
    _on_lost.append(callback)


def _servers() -> str:
    return "RPC server " + ", ".join(_attached)


def attach(endpoints: Iterable[str]) -> None:
    """Give llama.cpp the devices of these servers, as its own --rpc does. It is process-wide:
    every model loaded afterwards puts its offloaded layers (n_gpu_layers) on them, first. A
    server lost or silent later ends the process with one error line (_arm_lost_hook,
    rpc_watch)."""
    global _watch
    endpoints = tuple(endpoints)
    limit = timeout_s() if endpoints else 0.0     # a bad LOCALSPEC_RPC_TIMEOUT: before anything
    for endpoint in endpoints:
        if endpoint in _attached:
            continue
        probe(endpoint)
        add = _entry("ggml_backend_rpc_add_server", ctypes.CFUNCTYPE(ctypes.c_void_p,
                                                                     ctypes.c_char_p))
        reg = add(endpoint.encode())
        if not reg:
            raise LocalspecError(f"RPC server {endpoint} offers no device.")
        _b.ggml_function("ggml_backend_register", None, ctypes.c_void_p)(reg)
        _attached.append(endpoint)
        _arm_lost_hook(limit)
        if _watch is None:
            _watch = Watch(_servers, limit, _report_lost)
            _watch.start()
        _watch.add_peers(peers_of([endpoint], split_endpoint))
        _watch.secure()                  # the connection add_server made: bounded from now


def secure() -> None:
    """Bound the waits on any connection to a server that loading or a context just opened."""
    if _watch is not None:
        _watch.secure()


def attached() -> tuple:
    """Endpoints attached in this process (part of the device identity, e.g. calibration)."""
    return tuple(_attached)


def server(host: str, port: int, n_threads: int,
           cache_dir: Optional[str] = None) -> Callable[[], None]:
    """ggml's RPC server on this build's best local device (its GPUs, else the CPU), looked up and
    checked now. The returned function blocks while it serves and returns only when it could not
    start (ggml prints the reason on stderr)."""
    start = _entry("ggml_backend_rpc_start_server", ctypes.CFUNCTYPE(
        None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p)))
    handles = device_handles()
    chosen = [d for d, kind in handles if kind in OFFLOAD_TYPES] or \
        [d for d, kind in handles if kind == "CPU"][:1]
    if not chosen:
        raise LocalspecError("llama.cpp reports no device to serve.")
    devs = (ctypes.c_void_p * len(chosen))(*chosen)
    clear_abort_hook = _b.ggml_function("ggml_set_abort_callback", ctypes.c_void_p, ctypes.c_void_p)

    def serve() -> None:
        # ggml aborts on a malformed frame; the server's parent process reads that as the
        # worker dying of SIGABRT and serves again: no crash line or report per bad client.
        native.uninstall_guard()
        clear_abort_hook(None)
        start(f"{host}:{port}".encode(), cache_dir.encode() if cache_dir else None, n_threads,
              len(chosen), devs)
    return serve
