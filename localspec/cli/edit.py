"""`localspec edit`: the filter any editor can run: an instruction applied to a file or stdin,
only the rewritten text on stdout."""

from __future__ import annotations

from pathlib import Path

import click

from ..apps.edit import Rewrite, check_edit, parse_region, split_region
from ..text import decode_utf8, read_text_file
from .options import (COMMAND, build_sampling, learn_option, model_options, open_engine,
                      sampling_options, stdin, text_arg, write_out)


def _region(_ctx, _param, value):
    try:
        return None if value is None else parse_region(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command(context_settings=COMMAND)
@click.argument("instruction")
@click.argument("file", required=False, type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--region", metavar="START:END", callback=_region, default=None,
              help="Rewrite only lines START..END (1-based, inclusive); the whole file is still "
                   "read as context and is what stdout gets, with that range replaced.")
@click.option("--stats", is_flag=True, help="Print acceptance and speed statistics to stderr.")
@model_options(default_proposer="ngram")
@learn_option(True, "On by default, as for every command that generates: a file edited "
                    "again and again drafts what its earlier rewrites wrote.")
@sampling_options()
def edit(instruction, file, region, stats, **kw):
    """Rewrite FILE (or stdin) as INSTRUCTION says and write only the result to stdout.

    The text is also the n-gram proposer's document, so a rewrite that keeps most of it arrives
    several tokens a step. Code fences and commentary the model adds are stripped, the text's
    trailing newline is kept. Nothing is written unless the whole rewrite is there (exit 0);
    otherwise one `error:` line on stderr and exit 1.

    \b
    Examples:
      localspec edit "add type hints" util.py > util_typed.py
      :%!localspec edit "translate the comments to English"          (Vim, whole buffer)
      localspec edit --region 10:24 "make this loop a comprehension" app.py
      git show HEAD:app.py | localspec edit --stats "rename foo to bar" -
    """
    instruction = text_arg(instruction, "the instruction")
    if file is None or file == "-":
        text = decode_utf8(stdin("name a FILE").buffer.read(), "stdin")
        name = "stdin"
    else:
        text, name = read_text_file(file, "the file"), Path(file).name
    before, part, after = split_region(text, region)
    instruction = check_edit(instruction, text, part)
    ctx = click.get_current_context()
    max_tokens = None if ctx.get_parameter_source("max_tokens") == \
        click.core.ParameterSource.DEFAULT else kw["max_tokens"]
    with open_engine(kw, learn=kw["learn"]) as engine:
        rewrite = Rewrite(engine, instruction, text, region, name, build_sampling(kw),
                          max_tokens, stop=kw["stop"])
        out = before + rewrite.result() + after
    if stats:
        click.echo(rewrite.stats.summary(), err=True)
    write_out(out)
