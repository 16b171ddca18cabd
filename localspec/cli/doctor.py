"""`localspec doctor`: the build's features and whether a draft model fits a target."""

from __future__ import annotations

import sys

import click

from ..apps.doctor import report
from .options import COMMAND


@click.command(context_settings=COMMAND)
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
    lines, ok = report(target, draft)
    click.echo("\n".join(lines))
    if not ok:
        sys.exit(1)
