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
import dataclasses
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
                store.remember(c.out, c.prompt)
        finally:
            store.close()
    return rows


def store_rows(cases: list, k_max: int = K_MAX) -> tuple:
    """(z, y, depth) over every position where the draft store has a proposal, sessions
    replayed in order: z the acceptance prior's logit of each draft position up to the first
    miss (no store bias), y whether it matched the recorded output. The request state is kept
    as plain decoding sees it (tools/replay.py training_rows)."""
    from localspec.policy.acceptance import AcceptanceConfig, AcceptanceModel, RequestState
    model = AcceptanceModel(AcceptanceConfig(store_bias=0.0))
    z, y, depth, lens = [], [], [], []
    for group in sessions_of(cases).values():
        store = LearningStore(DraftStore(capacity_for(64)), None, learn=False)
        for c in group:
            out, n, state = c.out, len(c.out), RequestState()
            prop = rp._proposer(c, 8, "earliest", store)
            try:
                for t in range(1, n):
                    f = next((o.features for o in prop.offers(min(k_max, n - t))
                              if o.source == "store"), None)       # where the store competes
                    if f is not None:
                        run = rp.run_length(f.tokens, out, t)
                        m = min(run + 1, len(f.tokens))
                        z.extend(model.base_logits(f, m, state))
                        y.extend(float(i < run) for i in range(m))
                        depth.extend(range(m))
                        lens.extend([f.ngram_len] * m)
                    state.verified(prop.features(min(k_max, n - t)), 0, 0, out[t:t + 1])
                    prop.accept(out[t:t + 1])
            finally:
                rp._close(prop)
            store.remember(out, c.prompt)
        store.close()
    return z, y, depth, lens


def fit_bias(z, y, depth, lens) -> tuple:
    """(store_bias, store_len) maximising the likelihood of y under
    sigmoid(z + store_bias + store_len log(len / 4)), each position weighted 1 / (1 + depth)
    as the prior's fit weighs them (Newton steps, a small L2 pull to 0)."""
    import numpy as np
    z, y = np.asarray(z), np.asarray(y)
    w = 1.0 / (1.0 + np.asarray(depth))
    X = np.stack([np.ones(len(y)), np.log(np.asarray(lens) / 4.0)], axis=1)
    b = np.zeros(2)
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-(z + X @ b)))
        grad = X.T @ (w * (p - y)) + 0.1 * b
        hess = (X * (w * p * (1 - p))[:, None]).T @ X + 0.1 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        b -= step
        if np.abs(step).max() < 1e-9:
            break
    return float(b[0]), float(b[1])


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
    rep.add_argument("--store-bias", type=float, nargs=2, default=None,
                     metavar=("BIAS", "LEN"))
    ft = sub.add_parser("fit")
    ft.add_argument("paths", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "record":
        from tools.replay_record import record
        record(a.path, a.threads, cases=a.cases.split(",") if a.cases else None,
               workloads=a.workloads, model=a.model)
        return
    if a.cmd == "fit":
        z, y, depth, lens = [], [], [], []
        for path in a.paths:
            for part, rows in zip((z, y, depth, lens), store_rows(rp.load(path))):
                part.extend(rows)
        bias, per_len = fit_bias(z, y, depth, lens)
        print(f"{len(y)} store positions, {sum(y) / max(len(y), 1):.1%} matched: "
              f"store_bias = {bias:.3f}, store_len = {per_len:.3f}")
        return
    import json
    with open(a.path) as f:
        model = json.load(f).get("model", "")
    cases = rp.load(a.path)
    for spec in a.curve.split(","):
        name, curve = curve_of(spec, model, a.threads)
        shown = ", ".join(f"{r:.2f}" for r in curve[1:9])
        config = PolicyConfig(store_evidence=a.store_evidence)
        if a.store_bias is not None:
            config = dataclasses.replace(config, acceptance=dataclasses.replace(
                config.acceptance, store_bias=a.store_bias[0], store_len=a.store_bias[1]))
        report(replay_sessions(cases, curve, config), f"curve {name}: r(1..8) = {shown}",
               a.per_case)


if __name__ == "__main__":
    sys.exit(main())
