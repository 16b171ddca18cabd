"""The `--http` side of `localspec serve`: its options, the listening socket, and the run (engine,
worker thread, uvicorn) until Ctrl-C. The server itself lives in localspec/http_server.py.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import click

from ..errors import LocalspecError
from .options import open_engine

DEFAULT_MAX_BODY = 8 << 20       # bytes: a request carrying a whole source file as its document fits
DEFAULT_QUEUE = 16               # requests waiting behind the running one


def http_options(f):
    """Options that only `--http` uses."""
    opts = [
        click.option("--http", "http_bind", metavar="[HOST:]PORT", default=None,
                     help="Serve the OpenAI-compatible HTTP API on PORT (host 127.0.0.1 unless "
                          "given; PORT 0 picks a free one). Needs `pip install "
                          "'localspec[server]'`. Spec: docs/http.md."),
        click.option("--api-key", default=None, envvar="LOCALSPEC_API_KEY",
                     help="With --http: require 'Authorization: Bearer KEY' on every request "
                          "but GET /health. Env: LOCALSPEC_API_KEY."),
        click.option("--max-body", type=click.IntRange(1024), default=DEFAULT_MAX_BODY,
                     show_default=True, help="With --http: refuse request bodies larger than "
                                             "this many bytes (413)."),
        click.option("--queue", "max_queue", type=click.IntRange(1), default=DEFAULT_QUEUE,
                     show_default=True, help="With --http: requests that may wait behind the "
                                             "running one; more are answered 503 + Retry-After."),
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


def model_names(arg: str, path: Path) -> list:
    """The id clients send as `model` (first), then the other spellings accepted for it."""
    looks_like_path = arg.endswith(".gguf") or "/" in arg or "\\" in arg
    first = path.stem if looks_like_path else arg
    return list(dict.fromkeys([first, arg, path.name, path.stem]))


def model_info(engine) -> dict:
    """What GET /v1/models tells about the model beyond OpenAI's fields."""
    model, cfg = engine.model, engine.config
    return {"path": str(model.path), "description": model.describe(),
            "n_ctx": engine.ctx.n_ctx, "n_ctx_train": model.n_ctx_train,
            "n_vocab": model.n_vocab, "chat_template": model.chat_template() is not None,
            "proposer": cfg.proposer, "k_max": cfg.policy.k_max, "fixed_k": cfg.policy.fixed_k}


def run_http(kw: dict) -> None:
    """Load the model, calibrate, serve until Ctrl-C (then cancel running work and exit)."""
    try:
        import uvicorn

        from ..apps.http_server import Service, Worker, build_app
    except ImportError as e:
        raise LocalspecError(f"the HTTP server needs its extra packages ({e.name} is missing): "
                             "pip install 'localspec[server]' (./install.sh installs them).")
    try:
        host, port = parse_bind(kw["http_bind"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--http'")
    sock = listen(host, port)
    if not is_loopback(host) and not kw["api_key"]:
        click.echo(f"localspec: warning: serving on {host} without --api-key: anyone who can reach "
                   "this port can use the model.", err=True)
    with sock, open_engine(kw) as engine:
        engine.prepare()      # calibrate now, not inside the first request
        worker = Worker(engine, kw["max_queue"])
        service = Service(worker, model_names(kw["model"], engine.model.path), model_info(engine),
                          kw["api_key"], kw["max_body"])
        config = uvicorn.Config(build_app(service), log_level="warning", access_log=False,
                                lifespan="off", http="h11", ws="none", loop="asyncio",
                                timeout_graceful_shutdown=5)
        server = _server_class(uvicorn)(config, on_exit=worker.cancel_all)
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        click.echo(f"localspec: serving {service.names[0]} at http://{shown}:{bound}/v1 "
                   "(OpenAI-compatible; Ctrl-C stops)", err=True)
        worker.start()
        try:
            server.run(sockets=[sock])
        finally:
            worker.stop()
            engine.keep_live_state()


def _server_class(uvicorn):
    class _Server(uvicorn.Server):
        """uvicorn's server, which on Ctrl-C/SIGTERM first cancels every generation, so open
        streams end within one step instead of holding the graceful shutdown open."""

        def __init__(self, config, on_exit):
            super().__init__(config)
            self._on_exit = on_exit

        def handle_exit(self, sig, frame):
            self._on_exit()
            super().handle_exit(sig, frame)

    return _Server
