"""The `--http` side of `localspec serve`: its options, checked into HttpSettings, the listening
socket, and the hand-over to the server (localspec/apps/http_server.py) with a loaded engine.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

import click

from ..apps.openai_api import DEFAULT_MAX_BODY, DEFAULT_QUEUE, HttpSettings, api_key_problem
from ..apps.supervise import LISTEN_FD, HttpSupervisor, supervised
from ..errors import LocalspecError
from .options import open_engines


def http_options(f):
    """Options that only `--http` uses."""
    opts = [
        click.option("--http", "http_bind", metavar="[HOST:]PORT", default=None,
                     help="Serve the OpenAI-compatible HTTP API on PORT (host 127.0.0.1 unless "
                          "given; PORT 0 picks a free one). Needs `pip install "
                          "'localspec[server]'`. Reference: docs/http.md."),
        click.option("--api-key", default=None, envvar="LOCALSPEC_API_KEY",
                     help="With --http: require 'Authorization: Bearer KEY' on every request "
                          "but GET /health. Env: LOCALSPEC_API_KEY."),
        click.option("--max-body", type=click.IntRange(1024), default=DEFAULT_MAX_BODY,
                     show_default=True, help="With --http: refuse request bodies larger than "
                                             "this many bytes (413)."),
        click.option("--queue", "max_queue", type=click.IntRange(1), default=DEFAULT_QUEUE,
                     show_default=True, help="With --http: requests that may wait for a slot "
                                             "(behind the running ones); more are answered "
                                             "503 + Retry-After."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def parse_bind(value: str) -> tuple:
    """'8080' -> ('127.0.0.1', 8080); 'HOST:PORT'; '[::1]:8080'. ValueError when malformed."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host = "127.0.0.1"
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or int(port) > 65535 or not host:
        raise ValueError(f"expected [HOST:]PORT (e.g. 8080 or 0.0.0.0:8080), got {value!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """Bind and listen now, so a port in use is one line before the model loads."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise LocalspecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def run_http(kw: dict, *, learn: bool) -> None:
    """Check the options, listen (so a port in use is one line before the model loads), load
    the engine (adding its outputs to the draft store when `learn`), and hand both to the
    server until Ctrl-C."""
    try:
        import uvicorn  # noqa: F401  (the server's; asked for here for a clear message)

        from ..apps.http_server import serve_http
    except ImportError as e:
        raise LocalspecError(f"the HTTP server needs its extra packages ({e.name} is missing): "
                             "pip install 'localspec[server]' (./install.sh installs them).")
    try:
        host, port = parse_bind(kw["http_bind"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--http'")
    problem = api_key_problem(kw["api_key"])
    if problem:
        raise click.BadParameter(problem, param_hint="'--api-key' / LOCALSPEC_API_KEY")
    settings = HttpSettings(host, port, kw["api_key"], kw["max_body"], kw["max_queue"],
                            kw["model"])
    inherited = os.environ.pop(LISTEN_FD, None)     # a child of HttpSupervisor: its socket
    sock = socket.socket(fileno=int(inherited)) if inherited else listen(host, port)
    if not is_loopback(host) and not settings.api_key:
        click.echo(f"localspec: warning: serving on {host} without --api-key: anyone who can reach "
                   "this port can use the model.", err=True)
    if kw.get("rpc") and not supervised():      # a lost RPC server must not end the server
        with sock:
            code = HttpSupervisor(sys.argv[1:], sock, say=lambda line: click.echo(line, err=True)
                                  ).run()
        raise SystemExit(code)
    with sock, open_engines(kw, learn=learn, prepare=True) as engines:    # calibrated
        serve_http(engines, sock, settings, say=lambda line: click.echo(line, err=True))
