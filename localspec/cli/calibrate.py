"""`localspec calibrate`: re-measure the verify cost curve r(k) on this device."""

from __future__ import annotations

import click

from ..policy.calibrate import load_or_measure, timed_ks
from ..policy.costmodel import stability_line
from .options import COMMAND, model_option, open_engine, placement_options


@click.command(context_settings=COMMAND)
@model_option
@placement_options
def calibrate(**kw):
    """Re-measure the verify cost curve r(k) of MODEL on this device and cache it.

    r(k) is the time of one batched decode of k+1 tokens over a one-token decode; the adaptive
    policy drafts k tokens only where E(k)/r(k) beats plain decoding. It is measured once per
    model/device/threads on first use; run this on a quiet machine if that first run was noisy.
    The last line says how well the measurement rounds agreed: a NOISY curve (rounds more than
    8% apart) is measured up to three times here, and re-measured on later runs; while
    speculating, the engine also refines r(k) from the timing of every step.

    \b
    Examples:
      localspec calibrate                                # the default model, all cores
      localspec calibrate -m smollm2-135m --threads 2
    """
    with open_engine(kw, learn=False) as engine:      # plain decoding: nothing to learn
        k_max = engine.config.policy.k_max                  # the curve the engine reads
        curve = load_or_measure(engine.ctx, engine.config.n_gpu_layers, k_max, force=True,
                                attempts=3, progress=lambda m: click.echo(m, err=True))
    ks = [0] + timed_ks(len(curve.ratios) - 1)   # past 16 only these are timed; lines between
    click.echo(f"one-token decode: {curve.ms_per_step:.1f} ms")
    click.echo("k:    " + " ".join(f"{k:>5}" for k in ks))
    click.echo("r(k): " + " ".join(f"{curve.ratios[k]:5.2f}" for k in ks))
    click.echo(stability_line(curve.notes["stability"], curve.notes.get("attempts", 1)))
