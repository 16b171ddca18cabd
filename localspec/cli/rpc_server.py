"""`localspec rpc-server`: lend this machine's CPU (or GPUs) to `--rpc` clients, with ggml's RPC
server from the same llama.cpp build (no second install). The protocol is unauthenticated.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import signal
import socket
import sys
import time

import click

from ..errors import LocalspecError
from ..files import cache_dir
from ..llama import default_threads, set_log_level
from ..llama.rpc import server
from .options import COMMAND


def _resolve_ipv4(host: str) -> str:
    try:
        return socket.gethostbyname(host)      # ggml's server binds IPv4 literals only
    except OSError as e:
        raise LocalspecError(f"cannot resolve --host {host!r} to an IPv4 address: {e}") from None


def _check_free(addr: str, port: int) -> None:
    """Bind once here so a taken port is one clear line (ggml would only say it failed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            raise LocalspecError(f"cannot listen on {addr}:{port}: {e.strerror or e}") from None


@click.command("rpc-server", context_settings=COMMAND)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --allow-remote.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=None,
              help="CPU threads for the computations it runs (default: every core it may use).")
@click.option("--cache", is_flag=True,
              help="Keep the tensors clients send in a local file cache (LOCALSPEC_HOME/"
                   "rpc-cache), so loading the same model again skips most of the transfer.")
@click.option("--allow-remote", is_flag=True,
              help="Allow a non-loopback --host. Only on a network you trust: see the warning.")
def rpc_server(host, port, threads, cache, allow_remote):
    """Serve this machine's compute to other localspec processes over llama.cpp's RPC backend.

    On the machine with the model: `localspec generate --rpc HOST:PORT[,HOST:PORT] ...` (any
    command that loads a model takes --rpc) puts the model's layers on these servers.

    WARNING: the RPC protocol is unauthenticated and unencrypted. Anyone who can connect to the
    port can allocate this machine's memory and run computations on it, and sees the model's
    weights and activations in transit. It listens on 127.0.0.1 unless --host and
    --allow-remote say otherwise; expose it only on a private network or through an SSH tunnel.

    \b
    Examples:
      localspec rpc-server --port 50052                     # this machine only
      localspec rpc-server --host 192.168.1.7 --allow-remote --threads 8
    """
    addr = _resolve_ipv4(host)
    if not ipaddress.ip_address(addr).is_loopback and not allow_remote:
        raise LocalspecError(f"refusing to listen on {addr}: the RPC protocol is unauthenticated, "
                             "so anyone who reaches the port can use this machine. Pass "
                             "--allow-remote if this network is trusted.")
    _check_free(addr, port)
    tensors = cache_dir("rpc-cache") if cache else None
    set_log_level()
    serve = server(addr, port, threads or default_threads(), str(tensors) if tensors else None)
    os.dup2(2, 1)           # ggml prints its banner and connection log with printf: stderr it is
    click.echo(f"localspec: RPC server on {addr}:{port} (unauthenticated; Ctrl-C stops)",
               err=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the worker too
    while True:
        code = _serve_in_child(serve)
        if code >= 0:
            raise LocalspecError(f"the RPC server on {addr}:{port} stopped; its reason is above.")
        click.echo(f"localspec: the RPC server's worker ended on signal {-code} (a client sent "
                   "what ggml could not handle, or it crashed); serving again.", err=True)
        time.sleep(0.5)


def _serve_in_child(serve) -> int:
    """Run ggml's server in a child process and wait for it: ggml aborts on a malformed frame
    (its asserts check the input), which must cost one connection, not the listener. Returns
    the child's exit status, or minus the signal that ended it."""
    pid = os.fork()
    if pid == 0:                                  # the child: serve until ggml returns or aborts
        os.environ["GGML_NO_BACKTRACE"] = "1"     # one line from ggml, no debugger attach
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:                                      # Linux: end with the parent, whatever kills it
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        try:
            serve()
        finally:
            os._exit(0)
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.2)                       # waits in slices: Ctrl-C reaches this process
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
