"""The `localspec` command line: a thin click group, one file per command in this package,
the options they share in options.py, and the one place user errors become one-line messages."""

from __future__ import annotations


import click

from .. import __version__
from .bench import bench
from .calibrate import calibrate
from .chat import chat
from .doctor import doctor
from .edit import edit
from .generate import generate
from .models import models
from .options import COMMAND, run_command
from .rpc_server import rpc_server
from .serve import serve
from .store import store
from .summarize import summarize


@click.group(context_settings=COMMAND)
@click.version_option(__version__, "-V", "--version", prog_name="localspec")
def cli():
    """localspec: a local LLM runtime with lossless speculative decoding on llama.cpp.

    A cheap proposer guesses the next tokens, the model checks them all in one batch, and only
    what the model itself would have produced is kept: same text, sooner.

    \b
    Examples:
      localspec models pull default            # Qwen2.5-Coder-1.5B-Instruct (1.1 GB)
      localspec generate "def fib(n):"         # raw completion on stdout
      echo "Explain KV caches" | localspec generate --chat --stats -
    """


for _command in (generate, edit, calibrate, doctor, models, chat, serve, summarize, bench,
                 rpc_server, store):
    cli.add_command(_command)


def main() -> None:
    """Console entry point."""
    run_command(cli)
