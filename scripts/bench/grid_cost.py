"""What "cached equals cold" costs, and which prefill grid to use (docs/prompt-cache.md).

A cached prompt keeps only rows computed in whole on-grid chunks (localspec.llama.cold_prefix), so
a hit re-evaluates the tail of the previous prompt past its last grid boundary; a finer grid
re-evaluates less but prefills in smaller batches. For each grid (0 = keep every common row, the
old rule, which is not cold-equal) this measures, interleaved round by round:
  - a cold prefill of N prompt tokens;
  - a chat turn: prompt P (random length), a reply decoded token by token, then P + reply + a
    new message, whose prefill is timed (time to first token of a cache hit) with the number of
    tokens it evaluated.

Usage (repository root, its .venv):
  python scripts/bench/grid_cost.py default -n 1500 --rounds 5 --threads 2
Prints a Markdown table on stdout; record it with the CPU model, `lscpu` flags and `uptime`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from localspec.catalog.models import resolve_model
from localspec.llama import Context, ContextParams, Model

clock = time.perf_counter


def source_tokens(model: Model) -> list:
    sources = sorted(Path(__file__).parents[2].glob("localspec/**/*.py"))
    return model.tokenize("".join(p.read_text() for p in sources))


def cold_prefill_ms(ctx: Context, tokens: list, grid: int) -> float:
    ctx.clear()
    t0 = clock()
    ctx.sync(tokens, grid=grid)
    return 1000 * (clock() - t0)


def chat_turn(ctx: Context, text: list, rng: random.Random, grid: int, reply: int,
              new: int) -> tuple:
    """(ms, tokens evaluated) of the prefill of a follow-up turn after a cold first turn."""
    n = rng.randrange(300, 1200)
    first = text[:n]
    ctx.clear()
    ctx.sync(first, grid=grid)
    for tok in text[n:n + reply]:               # the reply, decoded one token at a time
        ctx.decode([tok], logits="last")
    follow = text[:n + reply + new]
    t0 = clock()
    _, reused = ctx.sync(follow, grid=grid)
    return 1000 * (clock() - t0), len(follow) - reused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=1500, help="cold prefill length")
    ap.add_argument("--grids", default="0,32,64,128,256,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reply", type=int, default=80, help="reply tokens per turn")
    ap.add_argument("--new", type=int, default=40, help="new message tokens per turn")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    grids = [int(g) for g in a.grids.split(",")]
    with Model(resolve_model(a.model)) as model, \
            Context(model, ContextParams(n_ctx=4096, n_batch=512, n_threads=a.threads)) as ctx:
        text = source_tokens(model)
        cold = {g: [] for g in grids}
        turn = {g: [] for g in grids}
        for r in range(a.rounds):
            for g in grids:                      # interleaved: every grid sees the same drift
                cold[g].append(cold_prefill_ms(ctx, text[:a.n], g))
                turn[g].append(chat_turn(ctx, text, random.Random(r), g, a.reply, a.new))
    base = statistics.median(cold[grids[0]])
    print(f"| grid | cold prefill of {a.n} (ms) | vs grid {grids[0]} | hit: tokens evaluated "
          f"(mean) | hit: time to first token (median ms) |")
    print("|---|---|---|---|---|")
    for g in grids:
        c = statistics.median(cold[g])
        ev = statistics.mean(t[1] for t in turn[g])
        ms = statistics.median(t[0] for t in turn[g])
        print(f"| {g or 'none (old rule)'} | {c:.0f} | {c / base:.2f} | {ev:.0f} | {ms:.0f} |")


if __name__ == "__main__":
    main()
