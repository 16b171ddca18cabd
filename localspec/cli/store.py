"""`localspec store`: what the draft store holds (stats) and emptying it (clear)."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import click

from ..catalog.models import find_entry, model_path, resolve_model
from ..speculative.store import bytes_per_token, max_tokens_for
from ..speculative.store_file import (BREAK, ENV_MB, SUFFIX, budget_mb, clear_stores, list_stores,
                                      next_run, saved_hits, store_dir, store_path)
from .options import COMMAND


@click.group("store", context_settings=COMMAND)
def store() -> None:
    """The draft store: past outputs, one file per model under $LOCALSPEC_HOME/store, that
    later requests draft from (faster, never different text).

    Every command that generates adds its outputs unless given --no-learn (serve --http does
    not by default). Files are readable by their owner only. The budget is
    $LOCALSPEC_STORE_MB MB of RAM per model (default 64, about a million tokens; the file is a
    sixteenth of that); the oldest outputs go first. LOCALSPEC_STORE_MB=0 turns it off.

    \b
    Examples:
      localspec store stats
      localspec store clear                  # every model's store
      localspec store clear -m default       # one model's
    """


@store.command("stats")
def stats() -> None:
    """One line per model's store: tokens, outputs, recent offers right, file size, last
    change, path."""
    budget = budget_mb()
    cap = max_tokens_for(budget)
    click.echo(f"budget: {budget:g} MB of RAM per model ({ENV_MB}), up to {cap:,} tokens "
               f"({bytes_per_token():.0f} bytes a token in RAM, 4 on disk)")
    rows = list_stores()
    if not rows:
        click.echo("no stores yet")
    for path, header, tokens, why in rows:
        if header is None:
            click.echo(f"{path.name}: unusable ({why}); {next_run(path)}")
            continue
        when = datetime.datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y-%m-%d %H:%M")
        hits = saved_hits(header)
        right = f"{hits:.0%} of recent offers right, " if hits is not None else ""
        click.echo(f"{header.get('model', '?')}: {len(tokens) - int((tokens == BREAK).sum()):,} "
                   f"tokens in {int((tokens == BREAK).sum()):,} outputs, {right}"
                   f"{path.stat().st_size / 1e6:.2f} MB, {when}, {path}")


@store.command("clear")
@click.option("-m", "--model", default=None,
              help="Only this model's store (catalog name or .gguf path; a catalog model need "
                   "not be downloaded); default: every model's.")
def clear(model) -> None:
    """Delete the stored outputs (every model's, or one).

    \b
    Examples:
      localspec store clear                  # every model's store
      localspec store clear -m smollm2-135m  # one model's
    """
    if model is None:
        n = clear_stores()
    else:
        n = sum(clear_stores(path) for path in _stores_of(model))
    click.echo(f"removed {n} store file{'s' if n != 1 else ''}", err=True)


def _stores_of(model: str) -> list:
    """The store files of one model, found without pulling it. An empty name is refused: it is
    what an unset `$MODEL` gives, and must not mean every model."""
    if not model.strip():
        raise click.BadParameter("an empty name names no model; leave -m out to clear every "
                                 "model's store.", param_hint="'-m' / '--model'")
    entry = None if Path(model).expanduser().is_file() else find_entry(model)
    if entry is None:
        return [store_path(resolve_model(model, pull=False))[0]]
    cached = model_path(entry)
    if cached.is_file():
        return [store_path(cached)[0]]
    # Not downloaded (or removed since): a store file is named <model file's stem>-<16 hex
    # digits of its identity><suffix>, so the catalog's file name finds it.
    name = re.compile(re.escape(Path(entry.filename).stem) + r"-[0-9a-f]{16}" + re.escape(SUFFIX))
    return [p for p in store_dir().glob("*" + SUFFIX) if name.fullmatch(p.name)]
