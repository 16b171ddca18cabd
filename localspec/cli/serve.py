"""`localspec serve`: the editor protocol on stdio (protocol.py, stdio.py) or the OpenAI-compatible
HTTP API (http.py here, http_server.py and openai_api.py)."""

from __future__ import annotations

import sys

import click

from ..llama import set_log_level
from ..protocol import Server
from ..stdio import Writer, read_lines, take_stdout
from .http import http_options, run_http
from .options import COMMAND, model_options, open_engine


@click.command(context_settings=COMMAND)
@click.option("--stdio", is_flag=True,
              help="Talk the editor protocol on stdin/stdout (docs/protocol.md).")
@http_options
@model_options()
def serve(stdio, **kw):
    """Serve a model: the editor protocol on stdin/stdout (--stdio), or an OpenAI-compatible HTTP
    API (--http [HOST:]PORT). Pass exactly one of the two.

    --stdio: JSON-RPC 2.0, one message per line. Methods: initialize, generate (streams
    "generate/progress" notifications, then responds with the text and statistics), cancel,
    shutdown. stdout carries protocol messages only; logs and errors go to stderr. EOF on stdin
    cancels any work and exits 0. Spec: docs/protocol.md.

    --http: POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models and
    /health, for the openai SDK, curl and editor plugins that take an OpenAI base URL. Binds
    127.0.0.1 unless HOST is given; one generation at a time, the rest queue. Spec: docs/http.md.

    \b
    Examples:
      localspec serve --stdio -m qwen2.5-coder-1.5b
      echo '{"jsonrpc":"2.0","id":1,"method":"initialize"}' | localspec serve --stdio
      localspec serve --http 8080 -m qwen2.5-coder-1.5b   # base URL http://127.0.0.1:8080/v1
    """
    if stdio == bool(kw["http_bind"]):
        raise click.UsageError("pass exactly one of --stdio and --http [HOST:]PORT.")
    set_log_level()
    if kw["http_bind"]:
        return run_http(kw)
    protocol_fd = take_stdout()
    with open_engine(kw) as engine:
        engine.prepare()   # calibrate now, not inside the first (uncancellable) request
        Server(engine, Writer(protocol_fd)).serve(read_lines(sys.stdin.fileno()))
