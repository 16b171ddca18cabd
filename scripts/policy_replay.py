"""Replay plain greedy outputs through the n-gram proposer and a draft policy, offline.

Greedy speculation emits exactly plain decoding's tokens, so once the plain outputs of the
workloads are recorded, every proposer setting and policy can be scored without the model:
each step asks the policy for k, counts how many drafted tokens match the recorded output,
and charges r(k) from a cost curve. The score is plain steps / speculative steps, i.e. the
speedup in decode-time units (no Python overhead, no noise). It also prints an upper bound
that knows the future (draft exactly the matching run, or nothing).

    python scripts/policy_replay.py record out.json [--threads 2] [--exact]   # ~15 min, 2 cores
    python scripts/policy_replay.py replay out.json [--curve 1,1.58,1.75,...]

`record` runs plain greedy decoding of every workload case (each case's own max_tokens);
`replay` defaults to the cost curve cached by `localspec calibrate` for the default model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict

from localspec.ngram import NgramIndex
from localspec.policy import DraftPolicy, PolicyConfig

KEY_LENGTHS = 4


def record(path: str, threads: int, exact: bool) -> None:
    from localspec.bench import load_workloads
    from localspec.calibrate import load_or_measure
    from localspec.engine import Engine, EngineConfig

    out = {}
    with Engine("default", EngineConfig(proposer="none", exact=exact, n_threads=threads)) as eng:
        curve = load_or_measure(eng.ctx, 0, 16)
        for case in load_workloads():
            eng.reset()
            gen = eng.generate(case.messages(), max_tokens=case.max_tokens)
            out[case.id] = {"kind": case.kind, "prompt": eng.tokenize_prompt(case.messages()),
                            "out": gen.complete_tokens()}
            print(f"{case.id}: {len(out[case.id]['out'])} tokens", file=sys.stderr)
    with open(path, "w") as f:
        json.dump({"curve": list(curve.ratios), "cases": out}, f)


def replay_case(prompt, out, curve, ngram_max, tie, key_lengths):
    """Speedup of one case in decode-step units under DraftPolicy; acceptance is keyed by match
    length 1..key_lengths (0: one estimate for every match)."""
    pol = DraftPolicy(curve, PolicyConfig())
    with NgramIndex(ngram_min=1, ngram_max=ngram_max, tie=tie) as idx:
        idx.append(prompt + out[:1])
        t, cost, n = 1, 0.0, len(out)
        while t < n:
            m = idx.propose(min(16, n - t))
            toks = m.tokens.tolist()
            key = f"history:{min(m.ngram_len, key_lengths)}" if key_lengths else "history"
            k = pol.choose_k(key, available=len(toks)) if toks else 0
            run = 0
            while run < len(toks) and t + run < n and toks[run] == out[t + run]:
                run += 1
            if k:
                acc = min(k, run)
                pol.observe(key, k, acc)
            elif toks:
                acc = 0
                pol.observe(key, 1, int(run > 0))
            else:
                acc = 0
            step = min(acc + 1, n - t)
            idx.append(out[t:t + step])
            t, cost = t + step, cost + curve[k]
    return (n - 1) / cost if cost else 1.0


def bound_case(prompt, out, curve, ngram_max, tie):
    """Knowing the future: draft exactly the matching run when that beats a plain step."""
    with NgramIndex(ngram_min=1, ngram_max=ngram_max, tie=tie) as idx:
        idx.append(prompt + out[:1])
        t, cost, n = 1, 0.0, len(out)
        while t < n:
            toks = idx.propose(min(16, n - t)).tokens.tolist()
            run = 0
            while run < len(toks) and t + run < n and toks[run] == out[t + run]:
                run += 1
            k = run if run and (run + 1) / curve[run] > 1.0 else 0
            step = min(k + 1, n - t)
            idx.append(out[t:t + step])
            t, cost = t + step, cost + curve[k]
    return (n - 1) / cost


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def replay(path: str, curve_text: str | None) -> None:
    data = json.load(open(path))
    curve = [float(x) for x in curve_text.split(",")] if curve_text else data["curve"]
    settings = [("up to 4, recent, one estimate", 4, "recent", 0),
                ("up to 4, recent, keyed by length", 4, "recent", KEY_LENGTHS),
                ("up to 8, earliest, keyed by length", 8, "earliest", KEY_LENGTHS)]
    print(f"cost curve r(k): {', '.join(f'{r:.2f}' for r in curve)}")
    for name, ngram_max, tie, keyed in settings + [("future-knowing bound", 8, "earliest", None)]:
        by_kind = defaultdict(list)
        for case in data["cases"].values():
            args = (case["prompt"], case["out"], curve, ngram_max, tie)
            by_kind[case["kind"]].append(bound_case(*args) if keyed is None
                                         else replay_case(*args, keyed))
        print(f"{name:36s}" + "  ".join(f"{k}: {geomean(v):.2f}x (worst {min(v):.2f})"
                                       for k, v in by_kind.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("path")
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--exact", action="store_true")
    rep = sub.add_parser("replay")
    rep.add_argument("path")
    rep.add_argument("--curve")
    a = ap.parse_args()
    if a.cmd == "record":
        record(a.path, a.threads, a.exact)
    else:
        replay(a.path, a.curve)


if __name__ == "__main__":
    main()
