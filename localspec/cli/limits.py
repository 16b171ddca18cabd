"""Upper bounds on what a command line may ask of this machine and the model, checked before
anything is allocated: threads capped at the cores this process may use (a warning), a context
bounded by int32 (click), by the model's training context and by the memory its KV cache needs
(usage errors, --force-ctx skips them). Without them `--threads 4096` hangs, `--ctx 2000000000`
climbs past 5 GB and `--ctx 4294967360` wraps to 64 inside llama.cpp.
"""

from __future__ import annotations

from typing import Optional

import click

from ..llama import Model, default_threads
from ..llama.slots import slot_size
from ..speculative.config import EngineConfig

CTX_MAX = 2**31 - 1         # llama.cpp keeps positions in int32 (n_ctx is a uint32 that wraps)
CTX_TRAINING_FACTOR = 8     # the largest RoPE scaling in use (Llama 3.1: 8K trained -> 128K)


def cap_threads(threads: Optional[int]) -> Optional[int]:
    """--threads, at most the cores this process may use (sched_getaffinity): past them
    llama.cpp's threads spin waiting on each other (4096 hangs, 100000 crashes)."""
    usable = default_threads()
    if threads is None or threads <= usable:
        return threads
    click.echo(f"warning: --threads {threads} is more than the {usable} cores this process may "
               f"use; using {usable} (more would wait on each other and slow decoding down many "
               "times over).", err=True)
    return usable


def available_memory() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes (what can be allocated without swapping), or
    None where there is no such file (macOS) or it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_context(model: Model, config: EngineConfig, slots: int = 1) -> None:
    """A usage error, before the context is allocated, when one request's context (--ctx, or a
    slot's share of it with --parallel) is more than CTX_TRAINING_FACTOR times the model's
    training context, or when the whole KV cache (f16, on this machine: no GPU or RPC layers)
    needs more than the memory available.

    Example: the 1.5B model (28 KiB of KV a token, trained on 32768) with --ctx 2000000000:
    refused, 2000000000 > 8 x 32768; --ctx 524288 --parallel 16 passes that test (32768 a
    slot) and is refused only if 14 GB of memory are not available."""
    n_ctx, trained, name = config.n_ctx, model.n_ctx_train, model.path.name
    per_slot = slot_size(n_ctx, slots) if slots > 1 else n_ctx
    if trained > 0 and per_slot > CTX_TRAINING_FACTOR * trained:
        what = f"{n_ctx} tokens" if slots == 1 else \
            f"{per_slot} tokens a slot (--ctx {n_ctx} shared by {slots} slots)"
        raise click.BadParameter(
            f"{what} is more than {CTX_TRAINING_FACTOR} times the {trained} that {name} "
            f"was trained on; lower --ctx (at most {trained * slots} keeps the output sound), "
            "or pass --force-ctx to try anyway.", param_hint="'--ctx'")
    if config.n_gpu_layers != 0 or config.rpc:
        return                      # the KV cache goes where its layers go, not into this RAM
    need, free = n_ctx * model.kv_bytes_per_token(), available_memory()
    if free is not None and need > free:
        fits = free // max(1, model.kv_bytes_per_token())
        raise click.BadParameter(
            f"a context of {n_ctx} tokens needs about {_gb(need)} for the KV cache of {name} "
            f"(trained on {trained}) but this machine has {_gb(free)} of memory available; "
            f"lower --ctx (about {fits} tokens fit), or pass --force-ctx to try anyway.",
            param_hint="'--ctx'")


def note_rounded_context(asked: int, holds: int, slots: int = 1) -> None:
    """llama.cpp pads a context up to a multiple of 256 tokens, and gives each of several slots
    a multiple of 256: say so instead of running silently with another size than asked."""
    if slots > 1 and holds * slots != asked:
        click.echo(f"note: --ctx {asked} gives each of the {slots} slots {holds} tokens (a "
                   f"multiple of 256), {holds * slots} in all.", err=True)
    elif slots == 1 and holds != asked:
        click.echo(f"note: --ctx {asked} holds {holds} tokens (llama.cpp rounds a context up to "
                   "a multiple of 256).", err=True)


def _gb(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:,.1f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:,.0f} MB"
