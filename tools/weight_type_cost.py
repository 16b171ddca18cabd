"""Benchmark: what the batch-invariant kernels cost verify batches, per weight type (issue 44,
docs/exactness.md "Per weight type").

    python -m tools.weight_type_cost q8_0=random-q8_0.gguf f16=random-f16.gguf
    python -m tools.weight_type_cost --lib own2=/tmp/avx2-own --lib patched2=/tmp/avx2-patched \\
        --rounds 2 q5_0=random-q5_0.gguf

r(k) = the fastest of --reps k-token decodes (logits on every row) after a 500-token context over
the fastest one-token decode, k = 1, 2, 4, 8, 16 (or --ks; past 31 rows the patched library
raises its row limit for the decode, as verify batches run: Context.decode). Each library runs in its own process (the
library is chosen when llama.cpp loads): `own` is llama.cpp's (LOCALSPEC_EXACT=0), `patched`
localspec's lib-exact (LOCALSPEC_EXACT=1), and --lib NAME=DIR adds a folder laid out like
lib-exact (LLAMA_CPP_LIB_PATH=DIR; then only the --lib ones run unless --with-default).
Libraries interleave per model and round, in reverse order every other round, so drift on a
shared machine hits all alike. Prints one JSON line per run on stdout, then per model the
median over rounds of each library's r(k) and the last library's against the first (+ dearer),
then every other library's batch times t(k) = r(k) x t(1) against the first (ms: what a verify
batch costs when the one-token decodes differ too), as medians over rounds and from each
library's fastest round (a shared host that switches between a fast and a slow state between
rounds fools the medians; the fastest rounds are the ones it left alone).
A benchmark, not a test: run it on a quiet machine; it asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KS = (1, 2, 4, 8, 16)

# One library per process: the child times the decodes and prints one JSON object.
CHILD = """
import json, os, sys, time
from localspec.llama import Model, ModelParams, Context, ContextParams, batch_invariant_rows
path, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ks = [int(k) for k in sys.argv[4].split(",")]
with Model(path, ModelParams()) as model, \\
        Context(model, ContextParams(n_ctx=2048, n_threads=threads)) as ctx:
    ctx.decode(model.tokenize("Speculative decoding verifies drafted tokens. " * 80)[:500],
               logits="none")
    base, cont = ctx.n_past, [(97 * i + 11) % model.n_vocab for i in range(max(ks) + 1)]
    best = {k: 1e9 for k in ks}
    for _ in range(reps):
        for k in ks:
            ctx.truncate(base)
            t = time.perf_counter()
            ctx.decode(cont[:k], logits="all")
            best[k] = min(best[k], time.perf_counter() - t)
print(json.dumps({"invariant_rows": batch_invariant_rows(), "t1_ms": best[1] * 1e3,
                  "r": {k: best[k] / best[1] for k in ks}, "load": os.getloadavg()[0]}))
"""


def run_one(lib_env: dict, path: str, threads: int, reps: int, ks=KS) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCALSPEC_EXACT", "LLAMA_CPP_LIB_PATH")}
    env.update(lib_env)
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(threads), str(reps),
                          ",".join(map(str, ks))], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"error: timing {path} with {lib_env} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _against(name: str, label: str, sym: str, a: dict, b: dict) -> str:
    """One line of b's values against a's per k, in percent (+ dearer)."""
    return f"  {name:8} {label:21}  " + "  ".join(
        f"{sym}({k}) {100 * (b[k] / a[k] - 1):+4.0f}%" for k in a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", metavar="NAME=GGUF")
    ap.add_argument("--lib", action="append", default=[], metavar="NAME=DIR",
                    help="a library folder laid out like lib-exact (repeatable)")
    ap.add_argument("--with-default", action="store_true",
                    help="also time `own` and `patched` when --lib is given")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30, help="decodes per k and run (fastest kept)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", default=",".join(map(str, KS)),
                    help="batch sizes to time, comma-separated, 1 first (default %(default)s)")
    a = ap.parse_args(argv)
    ks = tuple(int(k) for k in a.ks.split(","))
    if ks[0] != 1 or any(k < 1 or k > 512 for k in ks):
        ap.error("--ks must start with 1 and stay within 1..512")
    libs = {}
    if not a.lib or a.with_default:
        libs = {"own": {"LOCALSPEC_EXACT": "0"}, "patched": {"LOCALSPEC_EXACT": "1"}}
    for spec in a.lib:
        name, folder = spec.split("=", 1)
        libs[name] = {"LLAMA_CPP_LIB_PATH": str(Path(folder).resolve())}
    models = dict(m.split("=", 1) for m in a.models)
    runs: dict = {}
    for rnd in range(a.rounds):
        order = list(libs) if rnd % 2 == 0 else list(reversed(libs))
        for name, path in models.items():
            for lib in order:
                res = run_one(libs[lib], path, a.threads, a.reps, ks)
                res.update(model=name, lib=lib, round=rnd + 1)
                print(json.dumps(res), flush=True)
                runs.setdefault((name, lib), []).append(res)
    first, last = list(libs)[0], list(libs)[-1]
    print(f"\nmedian r(k) over {a.rounds} rounds, {a.threads} threads; {last} against {first}:")
    for name in models:
        med, ms, fast = {}, {}, {}   # per library: median r(k); t(k) = r(k) x t(1) in ms,
        for lib in libs:                 # median and fastest over rounds
            rs = runs[(name, lib)]
            med[lib] = {k: statistics.median(r["r"][str(k)] for r in rs) for k in ks[1:]}
            ms[lib] = {k: statistics.median(r["r"][str(k)] * r["t1_ms"] for r in rs) for k in ks}
            fast[lib] = {k: min(r["r"][str(k)] * r["t1_ms"] for r in rs) for k in ks}
            print(f"  {name:8} {lib:10} t1 {ms[lib][1]:6.1f} ms  " +
                  "  ".join(f"r({k}) {v:5.2f}" for k, v in med[lib].items()))
        print(_against(name, f"{last}/{first}", "r", med[first], med[last]))
        for lib in list(libs)[1:]:
            print(_against(name, f"ms, {lib}/{first}", "t", ms[first], ms[lib]))
            print(_against(name, f"fastest, {lib}/{first}", "t", fast[first], fast[lib]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
