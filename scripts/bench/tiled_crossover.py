"""Does ggml's tiled K-quant matmul pay at the batch sizes a verify step uses? Times decodes of
several batch sizes with the tiled kernel on (llama.cpp's default) and off (GGML_CPU_TILED_MM=0),
each setting in its own process (ggml reads the switch once per process), alternated pair by
pair so a shared machine's drift hits both alike.

    python scripts/bench/tiled_crossover.py [--model default] [--threads 2] [--pairs 3] [--reps 3]
                                            [--sizes 1,2,4,8,12,16,17,24,32,64,128,256]

ggml takes the tiled path for every matmul of 8 or more rows (ggml-cpu/tiled/tiled.cpp,
ggml_tiled_min_batch); below that, repacked Q4_K weights go through a 4-row gemm plus one gemv per
leftover row and other K-quants through vec_dot. Prints, per size, the fastest time of each
setting (median over pairs) and off/on per pair, normalised by that pair's median off/on over
the sizes under 8 rows (which no setting changes: what is left is the two processes' drift):
under 1 means the tiled kernel costs time at that size. What it decided: docs/policy.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def child(model: str, threads: int, sizes: list, reps: int) -> dict:
    """In a fresh process whose environment already holds the switch: fastest ms per size."""
    from localspec.policy.calibrate import time_batches
    from localspec.catalog.models import resolve_model
    from localspec.llama import Context, ContextParams, Model

    with Model(resolve_model(model, progress=False)) as m, \
            Context(m, ContextParams(64 + max(sizes), max(512, max(sizes)), threads)) as ctx:
        rounds = time_batches(ctx, sizes, reps, all_rows_upto=33)  # verify sizes: every row
    return {n: 1000.0 * min(r[i] for r in rounds) for i, n in enumerate(sizes)}


def run_pair(model: str, threads: int, sizes: list, reps: int) -> tuple:
    out = {}
    for mode in ("on", "off"):
        env = dict(os.environ)
        env.pop("GGML_CPU_TILED_MM", None)
        if mode == "off":
            env["GGML_CPU_TILED_MM"] = "0"
        args = [sys.executable, __file__, "--child", "--model", model, "--threads", str(threads),
                "--reps", str(reps), "--sizes", ",".join(map(str, sizes))]
        r = subprocess.run(args, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"tiled_crossover: the {mode} run failed: "
                             f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
        out[mode] = {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    return out["on"], out["off"]


def table(pairs: list, sizes: list) -> list:
    """Rows (size, on ms, off ms, [normalised off/on per pair])."""
    refs = [n for n in sizes if n < 8] or sizes[:1]
    rows = []
    for n in sizes:
        norm = [(off[n] / on[n]) / statistics.median(off[m] / on[m] for m in refs)
                for on, off in pairs]
        rows.append((n, statistics.median(on[n] for on, _ in pairs),
                     statistics.median(off[n] for _, off in pairs), norm))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="catalog name or .gguf path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="1,2,4,8,12,16,17,24,32,64,128,256",
                    help="batch sizes in rows; those under 8 are the drift reference")
    ap.add_argument("--json", help="also write the raw times of every pair here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    if a.child:
        print(json.dumps(child(a.model, a.threads, sizes, a.reps)))
        return
    print(f"load before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    pairs = [run_pair(a.model, a.threads, sizes, a.reps) for _ in range(a.pairs)]
    print(f"load after: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "model": a.model, "pairs": pairs}, f)
    print("rows   tiled on ms   tiled off ms   off/on per pair (normalised by the sizes under 8)")
    for n, on, off, norm in table(pairs, sizes):
        print(f"{n:4d}  {on:12.1f}  {off:13.1f}   " + " ".join(f"{x:.3f}" for x in norm))


if __name__ == "__main__":
    main()
