"""`localspec serve`: the editor protocol on stdio (protocol.py, stdio.py)."""

from __future__ import annotations

import sys

import click

from ..llama import set_log_level
from ..protocol import Server
from ..stdio import Writer, read_lines, take_stdout
from .options import COMMAND, model_options, open_engine


@click.command(context_settings=COMMAND)
@click.option("--stdio", is_flag=True,
              help="Talk on stdin/stdout. Required: the only transport for now.")
@model_options()
def serve(stdio, **kw):
    """Serve the editor protocol: JSON-RPC 2.0, one message per line on stdin/stdout.

    Methods: initialize, generate (streams "generate/progress" notifications, then responds with
    the text and statistics), cancel, shutdown. stdout carries protocol messages only; logs and
    errors go to stderr. EOF on stdin cancels any work and exits 0. Spec: docs/protocol.md.

    \b
    Examples:
      localspec serve --stdio -m qwen2.5-coder-1.5b
      echo '{"jsonrpc":"2.0","id":1,"method":"initialize"}' | localspec serve --stdio
    """
    if not stdio:
        raise click.UsageError("pass --stdio: stdin/stdout is the only transport for now.")
    set_log_level()
    protocol_fd = take_stdout()
    with open_engine(kw) as engine:
        engine.prepare()   # calibrate now, not inside the first (uncancellable) request
        Server(engine, Writer(protocol_fd)).serve(read_lines(sys.stdin.fileno()))
