"""`localspec doctor`: the build's features and whether a draft model fits a target."""

from __future__ import annotations

import sys

import click

from ..apps.doctor import device_lines, report
from .options import COMMAND, gpu_layers_option


@click.command(context_settings=COMMAND)
@click.argument("target", default="default")
@click.argument("draft", required=False)
@gpu_layers_option("Load the model(s) with this many layers on the GPU (-1 = all) and say "
                   "where they and the KV cache went.")
@click.option("--build-only", is_flag=True,
              help="Report the build, backend and devices only; load no model.")
def doctor(target, draft, gpu_layers, build_only):
    """Check this machine's llama.cpp build and, given DRAFT, whether it can draft for TARGET.

    Prints the backend this build has (CPU, CUDA, Vulkan, Metal), the devices it sees, what
    install.sh would choose on this machine now and why, CPU features and whether the AMX
    workaround is in effect; with --gpu-layers, where the layers and KV cache went. Compares
    tokenizer type, vocabulary size, BOS/EOS and the text of every shared token id. Exits 1 when
    the pair is incompatible.

    \b
    Examples:
      localspec doctor                                   # device report + default model
      localspec doctor --build-only                      # backend and devices, no model
      localspec doctor smollm2-135m --gpu-layers -1      # where an offloaded model's layers go
      localspec doctor default default-draft             # the catalog's default pair
    """
    if build_only:
        click.echo("\n".join(device_lines()))
        return
    lines, ok = report(target, draft, gpu_layers)
    click.echo("\n".join(lines))
    if not ok:
        sys.exit(1)
