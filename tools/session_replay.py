"""Session replay: what the draft store gains over prompt lookup alone, on recorded plain greedy
outputs of workload sessions, in decode-time units on several cost curves (no model, no noise).

    python -m tools.session_replay record sessions.json [--threads 2] [--model default]
    python -m tools.session_replay replay sessions.json [--curve here,flat,1/1.9/2.5/...]
                                                        [--per-case] [--oracle]
    python -m tools.session_replay fit sessions.json [--terms bias,len,...] [--test other.json]

`record` records every case of localspec/data/sessions.jsonl or `--workloads FILE`
(tools/replay_record.py: the plain output, top-2 margins). `replay` replays each session in file
order twice with the real proposer and the adaptive policy (tools/replay.py): `ngram` (prompt
lookup alone) and `store` (prompt lookup + the draft store, which starts each session empty and
gets each request's recorded output once the request is done, as `localspec bench` does). Beside
each figure, the future-knowing bound of that mode: the best any policy drafting prefixes of its
offers could do. Curves: `here` (this machine's newest `localspec calibrate` of the recording's
model), `flat` (r(k) = 1 + 0.05 k, GPU-like), a calibration or bench JSON file, or r(0..) as
numbers separated by `/` (e.g. 1/1.9/2.5/3.1). `--oracle` adds the store mode with only the offers
whose first token is right shown to the policy: how much of the gap to the bound is not knowing
which offers are right, and how much not knowing how far they run. `fit` fits the acceptance
model's draft-store corrections (acceptance.STORE_TERMS) by likelihood and scores them, with the
shipped ones, on each session left out and on held-out recordings. A design tool: it prints and
asserts nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections import OrderedDict
from typing import Sequence

from localspec.policy.acceptance import STORE_TERMS
from localspec.policy.adaptive import AdaptivePolicy
from localspec.policy.config import PolicyConfig
from localspec.policy.costmodel import CostConfig, CostModel
from localspec.speculative.learning_store import LearningStore
from localspec.speculative.store import DraftStore, max_tokens_for
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


def replay_sessions(cases: list, curve: list, config: PolicyConfig = PolicyConfig(),
                    oracle: bool = False) -> list:
    """[(session, case id, ngram speedup, its bound, store speedup, its bound)], and with
    `oracle` the store mode's speedup when only offers with a right first token are shown to
    the policy (replay_case's first_oracle)."""
    make = lambda: AdaptivePolicy(CostModel(curve, rp.BASE_MS, CostConfig()), config)  # noqa
    rows = []
    for name, group in sessions_of(cases).items():
        store = LearningStore(DraftStore(max_tokens_for(64)), None, learn=False)
        try:
            for c in group:
                ngram = rp.replay_case(c, make, curve).speedup
                ngram_bound = rp.bound_case(c, curve)
                with_store = rp.replay_case(c, make, curve, store=store).speedup
                store_bound = rp.bound_case(c, curve, store=store)
                rows.append((name, c.id, ngram, ngram_bound, with_store, store_bound))
                if oracle:
                    rows[-1] += (rp.replay_case(c, make, curve, store=store,
                                                first_oracle=True).speedup,)
                store.remember(c.out, c.prompt)
        finally:
            store.close()
    return rows


def store_rows(cases: list, k_max: int = K_MAX) -> list:
    """[(session, z, y, depth, terms)] for every draft position up to the first miss wherever the
    draft store has a proposal, sessions replayed in order: z the acceptance prior's logit with
    the store's trust and no store corrections, y whether it matched the recorded output,
    terms the values acceptance.STORE_TERMS weigh at that position. The request state is kept
    as plain decoding sees it (tools/replay.py training_rows)."""
    from localspec.policy.acceptance import AcceptanceConfig, AcceptanceModel, RequestState, phis
    model = AcceptanceModel(AcceptanceConfig(store_weights=(0.0,) * len(STORE_TERMS)))
    rows = []
    for name, group in sessions_of(cases).items():
        store = LearningStore(DraftStore(max_tokens_for(64)), None, learn=False)
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
                        x = phis(f, m, state)
                        for i, z in enumerate(model.base_logits(f, m, state)):
                            terms = (1.0, math.log(f.ngram_len / 4), x[i, 2] - 1.0, x[i, 3],
                                     x[i, 5], x[i, 4], x[i, 6])
                            rows.append((name, z, float(i < run), i, terms))
                    state.verified(prop.features(min(k_max, n - t)), 0, 0, out[t:t + 1])
                    prop.accept(out[t:t + 1])
            finally:
                rp._close(prop)
            store.remember(out, c.prompt)
        store.close()
    return rows


def fit_store(rows: list, terms: Sequence[str], l2: float = 0.1) -> tuple:
    """Store corrections (acceptance.STORE_WEIGHTS order; the terms not named stay 0) that
    maximise the likelihood of y under sigmoid(z + corrections), each position weighted
    1 / (1 + depth) as the prior's fit weighs them (a small L2 pull to 0, the bias included)."""
    cols = [STORE_TERMS.index(t) for t in terms]
    z, y, w, X = _arrays(rows, cols)
    b = rp.fit_logistic(X, y, l2=l2, iters=60, sample_weight=w, offset=z, penalize_bias=True)
    weights = [0.0] * len(STORE_TERMS)
    for c, v in zip(cols, b):
        weights[c] = round(float(v), 3)
    return tuple(weights)


def store_loss(rows: list, weights: Sequence[float]) -> float:
    """Weighted log loss per position of `rows` under store corrections `weights`."""
    import numpy as np
    z, y, w, X = _arrays(rows, range(len(weights)))
    return rp.log_loss(X, y, np.asarray(weights), sample_weight=w, offset=z)


def _arrays(rows: list, cols) -> tuple:
    import numpy as np
    z = np.array([r[1] for r in rows])
    y = np.array([r[2] for r in rows])
    w = 1.0 / (1.0 + np.array([r[3] for r in rows]))
    X = np.array([[r[4][c] for c in cols] for r in rows]).reshape(len(rows), -1)
    return z, y, w, X


def fit_report(train: list, test: list, terms: Sequence[str]) -> None:
    """Fit store corrections on `train` rows and print their log loss beside the shipped
    STORE_WEIGHTS': on train, leaving each session out in turn (fitted on the others), and on
    the held-out `test` rows."""
    from localspec.policy.acceptance import STORE_WEIGHTS
    weights = fit_store(train, terms)
    sessions = OrderedDict((r[0], None) for r in train)
    loso = sum(store_loss(held, fit_store([r for r in train if r[0] != s], terms)) * len(held)
               for s in sessions for held in [[r for r in train if r[0] == s]]) / len(train)
    print(f"{len(train)} store positions, {sum(r[2] for r in train) / len(train):.1%} matched")
    print(f"fitted  {weights}: loss {store_loss(train, weights):.4f}, "
          f"each session left out {loso:.4f}")
    print(f"shipped {STORE_WEIGHTS}: loss {store_loss(train, STORE_WEIGHTS):.4f}")
    if test:
        print(f"held out: {len(test)} positions, {sum(r[2] for r in test) / len(test):.1%} "
              f"matched: fitted {store_loss(test, weights):.4f}, "
              f"shipped {store_loss(test, STORE_WEIGHTS):.4f}")


def report(rows: list, title: str, per_case: bool = False) -> None:
    print(f"\n{title}")
    oracle = len(rows[0]) > 6
    print(f"{'session':<12} {'cases':>5} {'ngram':>7} {'bound':>7} {'store':>7} {'bound':>7} "
          f"{'store/ngram':>11} {'store/bound':>11}" + ("  oracle/bound" if oracle else ""))
    for name in OrderedDict((r[0], None) for r in rows):
        sel = [r for r in rows if r[0] == name]
        g = [rp.geomean([r[i] for r in sel]) for i in range(2, len(rows[0]))]
        print(f"{name:<12} {len(sel):>5} {g[0]:>6.2f}x {g[1]:>6.2f}x {g[2]:>6.2f}x {g[3]:>6.2f}x "
              f"{g[2] / g[0]:>10.3f}x {g[2] / g[3]:>10.0%}" +
              (f" {g[4]:>6.2f}x {g[4] / g[3]:.0%}" if oracle else ""))
        if per_case:
            for r in sel:
                print(f"  {r[1]:<24} " + " ".join(f"{x:>6.2f}x" for x in r[2:]))


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
    rep.add_argument("--oracle", action="store_true",
                     help="also the store mode with only right-first-token offers shown")
    rep.add_argument("--store-evidence", type=int, default=PolicyConfig().store_evidence)
    rep.add_argument("--store-weights", default=None, metavar="W,W,...",
                     help="store corrections in acceptance.STORE_TERMS order")
    ft = sub.add_parser("fit")
    ft.add_argument("paths", nargs="+", help="recordings to fit on")
    ft.add_argument("--terms", default=",".join(STORE_TERMS),
                    help="the STORE_TERMS to fit (the others stay 0)")
    ft.add_argument("--test", nargs="*", default=[], help="held-out recordings to score")
    a = ap.parse_args(argv)
    if a.cmd == "record":
        from tools.replay_record import record
        record(a.path, a.threads, cases=a.cases.split(",") if a.cases else None,
               workloads=a.workloads, model=a.model)
        return
    if a.cmd == "fit":
        fit_report([r for p in a.paths for r in store_rows(rp.load(p))],
                   [r for p in a.test for r in store_rows(rp.load(p))], a.terms.split(","))
        return
    import json
    with open(a.path) as f:
        model = json.load(f).get("model", "")
    cases = rp.load(a.path)
    for spec in a.curve.split(","):
        name, curve = curve_of(spec, model, a.threads)
        shown = ", ".join(f"{r:.2f}" for r in curve[1:9])
        config = PolicyConfig(store_evidence=a.store_evidence)
        if a.store_weights is not None:
            weights = tuple(float(w) for w in a.store_weights.split(","))
            config = dataclasses.replace(config, acceptance=dataclasses.replace(
                config.acceptance, store_weights=weights))
        report(replay_sessions(cases, curve, config, a.oracle),
               f"curve {name}: r(1..8) = {shown}", a.per_case)


if __name__ == "__main__":
    sys.exit(main())
