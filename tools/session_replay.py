"""Session replay: what the draft store gains over prompt lookup alone, on recorded plain greedy
outputs of workload sessions, in decode-time units on several cost curves (no model, no noise).

    python -m tools.session_replay record sessions.json [--threads 2] [--model default]
    python -m tools.session_replay replay sessions.json [--curve here,flat,1,1.9,2.5,...]

`record` records every case of localspec/data/sessions.jsonl (tools/replay_record.py: the plain
output, top-2 margins). `replay` replays each session in file order twice with the real
proposer and the adaptive policy (tools/replay.py): `ngram` (prompt lookup alone) and `store`
(prompt lookup + the draft store, which starts each session empty and gets each request's
recorded output once the request is done, as `localspec bench` does). Beside each figure, the
future-knowing bound of that mode: the best any policy drafting prefixes of its offers could do.
Curves: `here` (this machine's newest `localspec calibrate` of the recording's model),
`flat` (r(k) = 1 + 0.05 k, GPU-like), a calibration or bench JSON file, or r(0..) as numbers
separated by `/` (e.g. 1/1.9/2.5/3.1). A design tool: it prints and asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
from collections import OrderedDict

from localspec.policy.adaptive import AdaptivePolicy
from localspec.policy.config import PolicyConfig
from localspec.policy.costmodel import CostConfig, CostModel
from localspec.spec.store import DraftStore, capacity_for
from localspec.spec.store_file import LearningStore
from tools import replay as rp

SESSIONS = "localspec/data/sessions.jsonl"
K_MAX = 16


def curve_of(spec: str, model: str, threads: int) -> tuple:
    """(name, r(0..K_MAX)) of one --curve entry."""
    if spec == "flat":
        return "flat 1+0.05k", [1.0 + 0.05 * k for k in range(K_MAX + 1)]
    if spec == "here":
        ratios, _ = rp.calibrated_curve(model, threads)
        return f"here ({threads} threads)", rp.extend_curve(ratios, K_MAX)
    if spec.endswith(".json"):
        return spec, rp.extend_curve(rp.curve_from_json(spec), K_MAX)
    return spec, rp.extend_curve([float(x) for x in spec.split("/")], K_MAX)


def sessions_of(cases: list) -> "OrderedDict":
    """{session name: its cases in file order}; a case outside any session is its own."""
    groups: OrderedDict = OrderedDict()
    for c in sorted(cases, key=lambda c: c.order):
        groups.setdefault(c.session or f"case {c.id}", []).append(c)
    return groups


def replay_sessions(cases: list, curve: list, config: PolicyConfig = PolicyConfig()) -> list:
    """[(session, case id, ngram speedup, its bound, store speedup, its bound)]."""
    make = lambda: AdaptivePolicy(CostModel(curve, rp.BASE_MS, CostConfig()), config)  # noqa
    rows = []
    for name, group in sessions_of(cases).items():
        store = LearningStore(DraftStore(capacity_for(64)), None, learn=False)
        try:
            for c in group:
                ngram = rp.replay_case(c, make, curve).speedup
                ngram_bound = rp.bound_case(c, curve)
                with_store = rp.replay_case(c, make, curve, store=store).speedup
                store_bound = rp.bound_case(c, curve, store=store)
                rows.append((name, c.id, ngram, ngram_bound, with_store, store_bound))
                store.remember(c.out)
        finally:
            store.close()
    return rows


def report(rows: list, title: str, per_case: bool = False) -> None:
    print(f"\n{title}")
    print(f"{'session':<12} {'cases':>5} {'ngram':>7} {'bound':>7} {'store':>7} {'bound':>7} "
          f"{'store/ngram':>11} {'store/bound':>11}")
    for name in OrderedDict((r[0], None) for r in rows):
        sel = [r for r in rows if r[0] == name]
        g = [rp.geomean([r[i] for r in sel]) for i in range(2, 6)]
        print(f"{name:<12} {len(sel):>5} {g[0]:>6.2f}x {g[1]:>6.2f}x {g[2]:>6.2f}x {g[3]:>6.2f}x "
              f"{g[2] / g[0]:>10.3f}x {g[2] / g[3]:>10.0%}")
        if per_case:
            for r in sel:
                print(f"  {r[1]:<24} {r[2]:>6.2f}x {r[3]:>6.2f}x {r[4]:>6.2f}x {r[5]:>6.2f}x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("path")
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--model", default="default")
    rec.add_argument("--workloads", default=SESSIONS)
    rec.add_argument("--cases", default=None, help="comma-separated case ids")
    rep = sub.add_parser("replay")
    rep.add_argument("path")
    rep.add_argument("--curve", default="here,flat")
    rep.add_argument("--threads", type=int, default=2)
    rep.add_argument("--per-case", action="store_true")
    rep.add_argument("--store-evidence", type=int, default=PolicyConfig().store_evidence)
    a = ap.parse_args(argv)
    if a.cmd == "record":
        from tools.replay_record import record
        record(a.path, a.threads, cases=a.cases.split(",") if a.cases else None,
               workloads=a.workloads, model=a.model)
        return
    import json
    with open(a.path) as f:
        model = json.load(f).get("model", "")
    cases = rp.load(a.path)
    for spec in a.curve.split(","):
        name, curve = curve_of(spec, model, a.threads)
        shown = ", ".join(f"{r:.2f}" for r in curve[1:9])
        config = PolicyConfig(store_evidence=a.store_evidence)
        report(replay_sessions(cases, curve, config), f"curve {name}: r(1..8) = {shown}",
               a.per_case)


if __name__ == "__main__":
    sys.exit(main())
