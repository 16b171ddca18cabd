"""Does the verify cost ratio r(k) depend on how much context is cached? Measures one-token and
(k+1)-token decodes at several context lengths, interleaved round by round, fastest of `reps`.

    python scripts/bench/cost_vs_context.py [--threads 2] [--reps 5]
           [--lengths 64,512,1024,2048,3072]

Prints ms of a one-token decode and r(k) per context length (stdout), load average (stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lengths", default="64,512,1024,2048,3072")
    ap.add_argument("--ks", default="0,1,2,3,4,8,16")
    a = ap.parse_args()
    from localspec.catalog.models import resolve_model
    from localspec.llama import Context, ContextParams, Model

    lengths = sorted(int(x) for x in a.lengths.split(","))
    ks = [int(x) for x in a.ks.split(",")]
    print(f"load before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    with Model(resolve_model("default")) as model, \
            Context(model, ContextParams(lengths[-1] + 64, 512, a.threads)) as ctx:
        vocab = model.n_vocab
        ctx.decode([(7 * i + 3) % vocab for i in range(lengths[-1])], logits="none")
        best = {(n, k): float("inf") for n in lengths for k in ks}
        for _ in range(a.reps):
            for n in reversed(lengths):   # every length in every round: drift hits all alike
                ctx.truncate(n)           # longest first; refilled after the round
                for k in ks:
                    toks = [(11 * j + 5) % vocab for j in range(k + 1)]
                    t = time.perf_counter()
                    ctx.decode(toks, logits="all")
                    best[n, k] = min(best[n, k], time.perf_counter() - t)
                    ctx.truncate(n)
            ctx.truncate(lengths[0])
            ctx.decode([(7 * i + 3) % vocab for i in range(lengths[0], lengths[-1])],
                       logits="none")
    print("n_past  one-token ms  " + "  ".join(f"r({k})" for k in ks if k))
    for n in lengths:
        one = best[n, 0]
        print(f"{n:6d}  {1000 * one:12.1f}  " +
              "  ".join(f"{best[n, k] / one:4.2f}" for k in ks if k))
    print(f"load after: {os.getloadavg()[0]:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
