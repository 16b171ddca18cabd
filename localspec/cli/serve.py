"""`localspec serve`: the editor protocol on stdio (protocol.py, stdio.py) or the OpenAI-compatible
HTTP API (http.py here, http_server.py and openai_api.py)."""

from __future__ import annotations

import sys

import click

from ..llama import set_log_level
from ..apps.protocol import Server
from ..apps.stdio import Writer, read_lines, take_stdout
from ..apps.supervise import serve_stdio_supervised, supervised
from .http import http_options, run_http
from .options import (COMMAND, learn_option, model_options, open_engines, parallel_option,
                      parallel_slots, stdin)


@click.command(context_settings=COMMAND)
@click.option("--stdio", is_flag=True,
              help="Talk the editor protocol on stdin/stdout (docs/protocol.md).")
@click.option("--no-disk-cache", is_flag=True,
              help="Keep saved prompt states in RAM only (default: also under the cache "
                   "directory, so a restarted server finds the documents it had read).")
@http_options
@model_options()
@parallel_option
@learn_option(None, "Default: learn with --stdio (one editor, one user); --no-learn with "
                    "--http, where every client's outputs would join one store: one client's "
                    "outputs could then shape (speed up, never change) another's replies, and "
                    "a reply's speed could hint that a text was written before. Pass --learn "
                    "to a server only you use.")
def serve(stdio, no_disk_cache, **kw):
    """Serve a model: the editor protocol on stdin/stdout (--stdio), or an OpenAI-compatible HTTP
    API (--http [HOST:]PORT). Pass exactly one of the two.

    --stdio: JSON-RPC 2.0, one message per line. Methods: initialize, generate (streams
    "generate/progress" notifications, then responds with the text and statistics), complete
    (fill in the middle, token-healed), prefill (read a buffer ahead of the first completion),
    rewrite, cancel, status (busy slots and the queue), shutdown. stdout carries protocol
    messages only; logs and errors go to stderr. EOF on stdin cancels any work and exits 0.
    Reference: docs/protocol.md.

    Prompts that begin like an earlier one reuse its KV rows (the prompt cache, --cache-mb), also
    across restarts: put what stays the same first (system text, then the document, then the
    instruction) so repeated requests about a document read only their new tokens.

    --http: POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models and
    /health, for the openai SDK, curl and editor plugins that take an OpenAI base URL. Binds
    127.0.0.1 unless HOST is given. Reference: docs/http.md.

    One generation at a time unless --parallel N: then N run together, each in a slot of
    --ctx/N tokens, and each gets the text it would get alone; the rest queue in arrival order
    (GET /health and the protocol's `status` show the busy slots and the queue).

    \b
    Examples:
      localspec serve --stdio -m qwen2.5-coder-1.5b
      echo '{"jsonrpc":"2.0","id":1,"method":"initialize"}' | localspec serve --stdio
      localspec serve --http 8080 -m qwen2.5-coder-1.5b   # base URL http://127.0.0.1:8080/v1
      localspec serve --http 8080 --parallel 4 --ctx 16384  # 4 requests at once, 4096 tokens each
    """
    if stdio == bool(kw["http_bind"]):
        raise click.UsageError("pass exactly one of --stdio and --http [HOST:]PORT.")
    parallel_slots(kw)              # a usage error before anything listens or loads
    kw["cache_disk"] = not no_disk_cache
    # Learning by transport: one editor's user on stdio; over HTTP every client would share
    # (and could probe) one store, so only when asked.
    learn = kw["learn"] if kw["learn"] is not None else not kw["http_bind"]
    set_log_level()
    if kw["http_bind"]:
        return run_http(kw, learn=learn)
    requests = stdin("use --http").fileno()
    protocol_fd = take_stdout()
    if kw.get("rpc") and not supervised():      # a lost RPC server must not end the server
        raise SystemExit(serve_stdio_supervised(sys.argv[1:], protocol_fd, requests))
    # calibrate now, not inside the first (uncancellable) request
    with open_engines(kw, learn=learn, prepare=True) as engines:
        Server(engines, Writer(protocol_fd)).serve(read_lines(requests))
        for engine in engines:
            engine.keep_live_state()
