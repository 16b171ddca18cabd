"""Benchmark: what raising the batch-invariant row limit costs (docs/exactness.md).

    python -m tools.exact_rows_cost                       # the default model, limit 66, 2 threads
    python -m tools.exact_rows_cost -m smollm2-135m --limit 101 --reps 7 --threads 2

r(k) = the fastest decode of a k-row batch (logits on every row, after a 32-token prefix, as
`localspec calibrate` times them: localspec.policy.calibrate.time_batches) over the fastest
one-token decode, for k = 1..--k-max, once with the library's default limit (32: batches of 32+
rows take tinyBLAS, the tiled K-quant matmul and the repacked 4-row gemms) and once with the
limit raised to --limit (every batch below it takes the batch-invariant kernels). The two
settings alternate round by round in one process, so drift on a shared machine hits both alike.
Since K_LIMIT 64, Context.decode raises the limit itself for any decode of 32+ rows that wants
every row's logits (llama/exact_rows.exact_for), so the "default" column past 31 rows is exact
too: to compare with llama.cpp's fast kernels there, use `python -m tools.weight_type_cost
--ks ...` (llama.cpp's own library in its own process).
Needs the batch-invariant library with its run-time row limit (./install.sh). Run it on a quiet machine;
a benchmark, not a test: it prints and asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from localspec.catalog.models import resolve_model
from localspec.llama import Context, ContextParams, Model, ModelParams, system_info
from localspec.llama.exact_rows import exact_rows, exact_rows_raised, exact_rows_settable
from localspec.policy.calibrate import time_batches


def measure(ctx: Context, k_max: int, limit: int, reps: int) -> dict:
    """{"default": [seconds per k], "raised": [...]}, the fastest of `reps` rounds each, the two
    settings interleaved (default first in even rounds, raised first in odd ones)."""
    sizes = list(range(1, k_max + 1))
    best = {"default": [float("inf")] * k_max, "raised": [float("inf")] * k_max}
    for rep in range(reps):
        order = ("default", "raised") if rep % 2 == 0 else ("raised", "default")
        for which in order:
            if which == "raised":
                with exact_rows_raised(limit):
                    rounds = time_batches(ctx, sizes, 1)
            else:
                rounds = time_batches(ctx, sizes, 1)
            best[which] = [min(a, b) for a, b in zip(best[which], rounds[0])]
        print(f"round {rep + 1}/{reps} done", file=sys.stderr)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="default", help="catalog name or GGUF path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=66, help="the raised limit (default 66: batches "
                    "of up to 65 rows, issue 45's 64-token drafts, batch-invariant)")
    ap.add_argument("--k-max", type=int, default=65, help="largest batch timed (default 65)")
    ap.add_argument("--reps", type=int, default=5, help="rounds per setting (fastest kept)")
    a = ap.parse_args(argv)
    path = resolve_model(a.model, progress=False)
    with Model(path, ModelParams()) as model, \
            Context(model, ContextParams(n_ctx=1024, n_threads=a.threads)) as ctx:
        if not exact_rows_settable():
            print("error: this process's ggml-cpu cannot raise its row limit (llama.cpp's own "
                  "libraries, or a lib-exact from before the run-time limit: rerun ./install.sh).",
                  file=sys.stderr)
            return 1
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        best = measure(ctx, a.k_max, a.limit, a.reps)
        assert exact_rows() == 32
    one = {w: t[0] for w, t in best.items()}
    print(f"# {Path(path).name}, {a.threads} threads, fastest of "
          f"{a.reps} rounds per setting, started {started}")
    print(f"# {system_info()}")
    print(f"# one-token decode: {1000 * one['default']:.2f} ms (limit 32), "
          f"{1000 * one['raised']:.2f} ms (limit {a.limit})")
    print(f"{'k':>3}  {'r(k) limit 32':>13}  {f'r(k) limit {a.limit}':>13}  {'raised/32':>9}")
    for k in range(1, a.k_max + 1):
        r32 = best["default"][k - 1] / one["default"]
        rhi = best["raised"][k - 1] / one["raised"]
        cost = best["raised"][k - 1] / best["default"][k - 1]
        print(f"{k:>3}  {r32:>13.3f}  {rhi:>13.3f}  {cost:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
