"""The `localspec` command line: a thin click group; each command lives in its own module."""

from __future__ import annotations

import sys

import click

from . import __version__
from .cli_common import build_sampling, model_options, open_engine, sampling_options
from .cli_bench import bench
from .cli_chat import chat
from .cli_models import models
from .cli_rpc import rpc_server
from .cli_summarize import summarize
from .errors import LocalspecError
from .serve import serve

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT_SETTINGS)
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


@cli.command()
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as one user message in the model's "
                                           "chat template (default: raw completion).")
@click.option("--system", default=None, help="System message (implies --chat).")
@click.option("--document", type=click.File("r"), default=None,
              help="Extra text for the n-gram proposer to copy from (the file being edited...).")
@click.option("--stats", is_flag=True, help="Print acceptance and speed statistics to stderr.")
@model_options(default_proposer="none")
@sampling_options
def generate(prompt, chat, system, document, stats, **kw):
    """Complete PROMPT (or stdin with `-`) and stream the text to stdout.

    Plain decoding by default, for scripting and for checking speculative output against;
    `--proposer ngram` speculates (same text, faster when the output repeats the input).

    \b
    Examples:
      localspec generate -m smollm2-135m -n 64 "The capital of France is"
      localspec generate --chat --proposer ngram --stats "Rewrite in Rust: ..." 
      cat prompt.txt | localspec generate -t 0.7 --seed 1 -
    """
    if prompt == "-":
        prompt = sys.stdin.read()
    if chat or system:
        messages = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": prompt}]
        prompt = messages
    with open_engine(kw) as engine:
        gen = engine.generate(prompt, build_sampling(kw), max_tokens=kw["max_tokens"],
                              stop=kw["stop"], document=document.read() if document else None)
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if stats:
            click.echo(gen.stats.summary(), err=True)


@cli.command()
@model_options()
def calibrate(**kw):
    """Re-measure the verify cost curve r(k) of MODEL on this device and cache it.

    r(k) is the time of one batched decode of k+1 tokens over a one-token decode; the adaptive
    policy drafts k tokens only where E(k)/r(k) beats plain decoding. It is measured once per
    model/device/threads on first use; run this on a quiet machine if that first run was noisy.
    """
    from .calibrate import load_or_measure

    with open_engine({**kw, "proposer": "none"}) as engine:
        curve = load_or_measure(engine.ctx, engine.config.n_gpu_layers, force=True,
                                progress=lambda m: click.echo(m, err=True))
    click.echo(f"one-token decode: {curve.ms_per_step:.1f} ms")
    click.echo("k:    " + " ".join(f"{k:>5}" for k in range(len(curve.ratios))))
    click.echo("r(k): " + " ".join(f"{r:5.2f}" for r in curve.ratios))


@cli.command()
@click.argument("target", default="default")
@click.argument("draft", required=False)
def doctor(target, draft):
    """Check this machine's llama.cpp build and, given DRAFT, whether it can draft for TARGET.

    Compares tokenizer type, vocabulary size, BOS/EOS and the text of every shared token id, and
    prints CPU features, GPU offload and whether the AMX workaround is in effect. Exits 1 when
    the pair is incompatible.

    \b
    Examples:
      localspec doctor                                   # device report + default model
      localspec doctor default default-draft             # the catalog's default pair
    """
    from .doctor import report

    lines, ok = report(target, draft)
    click.echo("\n".join(lines))
    if not ok:
        sys.exit(1)


for _command in (models, chat, serve, summarize, bench, rpc_server):
    cli.add_command(_command)


def run_command(command: click.Command, argv=None, prog_name=None) -> None:
    """Run a click command with localspec's rules: user errors are one line on stderr (exit 1),
    Ctrl-C is "interrupted" (exit 130), never a traceback."""
    try:
        code = command.main(argv, prog_name=prog_name, standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)   # a command's ctx.exit(n) returns n
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except LocalspecError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)


def main() -> None:
    """Console entry point."""
    run_command(cli)
