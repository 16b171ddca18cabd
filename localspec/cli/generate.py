"""`localspec generate`: one completion streamed to stdout, plain decoding unless asked."""

from __future__ import annotations

import contextlib

import click

from ..text import read_text_file
from .options import (COMMAND, build_sampling, learn_option, model_options, open_engine,
                      sampling_options, text_arg, write_out)


@click.command(context_settings=COMMAND)
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as one user message in the model's "
                                           "chat template (default: raw completion).")
@click.option("--system", default=None, help="System message (implies --chat).")
@click.option("--document", type=click.Path(dir_okay=False), default=None,
              help="Extra text for the n-gram proposer to copy from (the file being edited...); "
                   "UTF-8.")
@click.option("--stats", is_flag=True, help="Print acceptance and speed statistics to stderr.")
@model_options(default_proposer="none")
@learn_option(True, "It drafts and learns with --proposer ngram or hybrid; plain decoding "
                    "touches no store. On by default: scripts that call generate again and "
                    "again (agent loops) gain most, and only the file outlives the process.")
@sampling_options()
def generate(prompt, chat, system, document, stats, **kw):
    """Complete PROMPT (or stdin with `-`) and stream the text to stdout. Input must be UTF-8.

    Plain decoding by default, for scripting and for checking speculative output against;
    `--proposer ngram` speculates (same text, faster when the output repeats the input).

    \b
    Examples:
      localspec generate -m smollm2-135m -n 64 "The capital of France is"
      localspec generate --chat --proposer ngram --stats "Rewrite in Rust: ..." 
      cat prompt.txt | localspec generate -t 0.7 --seed 1 -
    """
    prompt = text_arg(prompt, "the prompt")
    system = None if system is None else text_arg(system, "--system")
    doc = read_text_file(document, "--document") if document else None
    if chat or system:
        messages = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": prompt}]
        prompt = messages
    with open_engine(kw, learn=kw["learn"]) as engine:
        gen = engine.generate(prompt, build_sampling(kw), max_tokens=kw["max_tokens"],
                              stop=kw["stop"], document=doc)
        with contextlib.closing(gen):   # its cleanup runs now, on an open context, even when
            for piece in gen:           # stdout is gone (`| head`) or Ctrl-C stops it
                write_out(piece)
        write_out("\n")
        if stats:
            click.echo(gen.stats.summary(), err=True)
        if gen.stats.stop_reason == "context":
            click.echo(f"note: the output stopped at the context limit ({engine.ctx.n_ctx} "
                       "tokens, prompt included); raise --ctx for a longer answer.", err=True)
