"""Design tool for the draft policy: record plain greedy outputs with the features the acceptance
model needs, fit its prior, and replay policies offline against any cost curve.

    python scripts/bench/policy_replay.py record out.json [--threads 2] [--exact] [--workloads F]
           [--model M]
    python scripts/bench/policy_replay.py replay out.json
           [--curve here|epyc|xeon|FILE.json|1,1.5,...] [--prior-curve ...] [--policies old,new]
           [--cv] [--threads 2] [--per-case] [--k-max 64]
           [--timing-noise 0.08] [--variant NAME:min_gain=1.2,...] [--calibration]
           [--shortfall] [--refit-on other.json,...] [--llamacpp]
    python scripts/bench/policy_replay.py fit out.json [more.json ...] [--folds 2]

Greedy speculation emits plain decoding's tokens, so every step can be scored without the model
(tools/replay.py says how). `replay` prints, per kind, each policy's speedup over plain in
decode-time units (geometric mean, worst case), the future-knowing bound, the fraction of it each
policy takes, and how often a policy drafted in cases whose bound is under 1.05x.
`--curve` is what steps really cost: by default this machine's newest `localspec calibrate`
of the recording's model (`here`), or a calibration / `bench --json` file, a named curve, or a
list starting at r(0) = 1. `--prior-curve` is what the policies believe (the cached calibration;
default: the same); `--cv` replays each case with an acceptance prior fitted on the other fold;
`--timing-noise` tells the policies jittered step times (the online cost model then learns from
noise, as on a shared machine; `new-fixed-cost` ignores timings). `--variant` adds the adaptive
policy with some settings changed (what a design question usually is), `--calibration` prints
where its acceptance model over- or under-predicts, per kind and draft length, `--shortfall`
where it falls short of the bound and why (scripts/bench/replay_watch.py); `--refit-on`
adds the adaptive policy with its acceptance prior refitted on other recordings (the replayed
one left out), which is how a prior fitted on more data is judged. `--llamacpp` adds llama.cpp's
own drafters, ngram-simple and ngram-mod (tools/llamacpp_replay.py, which also gives each tool
its own curve and says per case why localspec paid a step), charged on the curve extended to
k = 64 with its last slope.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tools/

from tools import replay as rp
from localspec.policy.acceptance import FEATURES, AcceptanceConfig
from localspec.policy.adaptive import AdaptivePolicy
from localspec.policy.costmodel import CostConfig, CostModel
from localspec.errors import LocalspecError
from localspec.policy.config import K_LIMIT, GuardConfig, PolicyConfig
from localspec.policy.draft_estimate import DraftPolicy
from replay_watch import Calibrated, Shortfall, print_calibration, print_shortfall

CURVES = {  # docs/design.md, the cost model; Qwen2.5-Coder-1.5B Q4_K_M, 2 threads
    "epyc": rp.extend_curve([1, 1.48, 1.96, 2.22, 2.68], 16, {8: 5.9, 16: 8.4}),
    "xeon": rp.extend_curve([1, 1.55, 1.75, 1.75, 2.2], 16, {8: 3.0, 16: 3.9}),
}
PROPOSE_COST = 0.002   # proposer + policy per step, in plain-step units (measured: see --time)


def parse_curve(text, data, threads=2, k_max=K_LIMIT):
    """A named curve, `here` (this machine's newest calibration of the recording's model), a
    JSON file holding one (calibration or bench JSON), or 1,r(1),r(2),... (extended to k_max,
    the last slope carried on)."""
    if text in (None, "here"):
        curve, path = rp.calibrated_curve(data["model"], threads)
        print(f"this machine's curve: {path}", file=sys.stderr)
        return rp.extend_curve(curve, k_max)
    if text in CURVES:
        return rp.extend_curve(CURVES[text], k_max)
    if text.endswith(".json"):
        return rp.extend_curve(rp.curve_from_json(text), k_max)
    try:
        points = [float(x) for x in text.split(",")]
    except ValueError:
        points = []
    if len(points) < 2 or points[0] != 1.0 or min(points) < 1.0:
        raise LocalspecError(f"--curve {text!r}: expected epyc, xeon, here, a .json file or "
                             "numbers r(0)=1,r(1),r(2),... (each >= 1)")
    return rp.extend_curve(points, k_max)


def parse_variants(texts) -> dict:
    """--variant NAME:key=value,... -> {NAME: {key: value}}: the adaptive policy ("new") with
    settings changed, e.g. `tight:min_gain=1.2,guard.threshold=1.0`. Keys: PolicyConfig's
    fields, guard.<GuardConfig field>, acceptance.<AcceptanceConfig field but weights>,
    cost.<CostConfig field>; values are numbers (inf allowed) or true/false."""
    out = {}
    for text in texts or ():
        name, _, body = text.partition(":")
        if not name or not body or name in POLICY_NAMES:
            raise LocalspecError(f"--variant {text!r}: expected NAME:key=value,... with a new "
                                 f"NAME (not one of {', '.join(POLICY_NAMES)})")
        settings = {}
        for item in body.split(","):
            key, eq, value = item.strip().partition("=")
            if key not in SETTABLE or not eq:
                raise LocalspecError(f"--variant {name}: cannot set {item.strip()!r}; settable: "
                                     f"{', '.join(sorted(SETTABLE))} (as key=value)")
            settings[key] = _setting(name, key, value.strip())
        out[name] = settings
    return out


def _fields(cls, prefix="", skip=()):
    return {prefix + f.name: f.default for f in dataclasses.fields(cls)
            if f.name not in skip and f.default is not dataclasses.MISSING}


SETTABLE = {**_fields(PolicyConfig, skip=("fixed_k",)), **_fields(GuardConfig, "guard."),
            **_fields(AcceptanceConfig, "acceptance.", skip=("weights",)),
            **_fields(CostConfig, "cost.")}


def _setting(name, key, value):
    default = SETTABLE[key]
    try:
        if isinstance(default, bool):
            if value not in ("true", "false"):
                raise ValueError
            return value == "true"
        return int(value) if isinstance(default, int) else float(value)
    except ValueError:
        kind = "true/false" if isinstance(default, bool) else type(default).__name__
        raise LocalspecError(f"--variant {name}: {key}={value!r} is not a {kind}") from None


def _variant(settings, acc):
    """PolicyConfig and CostConfig of the adaptive policy with `settings` applied."""
    groups = defaultdict(dict)
    for key, value in settings.items():
        group, _, field = key.rpartition(".")
        groups[group][field] = value
    config = dataclasses.replace(
        PolicyConfig(acceptance=dataclasses.replace(acc, **groups["acceptance"]),
                       guard=GuardConfig(**groups["guard"])), **groups[""])
    return config, CostConfig(**groups["cost"])


POLICY_NAMES = ("old", "new", "new-fixed-cost", "unbudgeted")


def check_policies(names, variants, refit=False) -> None:
    unknown = [n for n in names if n not in POLICY_NAMES and n not in variants and
               not (refit and n == "refit")]
    if unknown:
        raise LocalspecError(f"--policies: unknown policy {unknown[0]!r}; known: "
                             f"{', '.join(POLICY_NAMES)}, any --variant, and refit with "
                             f"--refit-on")


def make_policies(names, prior, weights=None, variants=None, refit=None):
    """{name: maker} of the named policies, believing the cost curve `prior`; `weights` replace
    the shipped acceptance prior (--cv), `refit` is the prior of the "refit" policy
    (--refit-on)."""
    acc = AcceptanceConfig(weights=tuple(weights)) if weights is not None else AcceptanceConfig()
    check_policies(names, variants or {}, refit is not None)
    makers = {
        "old": lambda: DraftPolicy(prior, PolicyConfig()),
        "new": lambda: AdaptivePolicy(CostModel(prior, rp.BASE_MS, CostConfig()),
                                      PolicyConfig(acceptance=acc)),
        "new-fixed-cost": lambda: AdaptivePolicy(
            CostModel(prior, rp.BASE_MS, CostConfig(online=False)), PolicyConfig(acceptance=acc)),
        # the adaptive policy before the loss budget and min_gain 1.1 (2026-11-24)
        "unbudgeted": lambda: AdaptivePolicy(
            CostModel(prior, rp.BASE_MS, CostConfig()),
            dataclasses.replace(PolicyConfig(acceptance=acc), min_gain=1.0, loss_budget=math.inf)),
    }
    if refit is not None:
        makers["refit"] = lambda: AdaptivePolicy(
            CostModel(prior, rp.BASE_MS, CostConfig()),
            PolicyConfig(acceptance=AcceptanceConfig(weights=tuple(refit))))
    for name, settings in (variants or {}).items():
        config, cost = _variant(settings, acc)
        makers[name] = (lambda config=config, cost=cost:
                        AdaptivePolicy(CostModel(prior, rp.BASE_MS, cost), config))
    return {n: makers[n] for n in names}


def load_recording(path) -> list:
    """rp.load, with a one-line error for a file that is missing or not a recording."""
    try:
        return rp.load(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LocalspecError(f"cannot read the recording {path}: {e!r:.200}") from None


def load_many(paths) -> list:
    """The cases of several recordings; with more than one, ids are prefixed by the file's
    name (the same workloads recorded on two CPUs share their ids)."""
    if len(paths) == 1:
        return load_recording(paths[0])
    return [dataclasses.replace(c, id=f"{Path(p).stem}/{c.id}")
            for p in paths for c in load_recording(p)]


def refit_prior(paths, replayed):
    """--refit-on: an acceptance prior fitted on the cases of `paths`, the replayed recording
    left out (leave-one-recording-out), with a line saying what it was fitted on."""
    paths = [p for p in paths if Path(p).resolve() != Path(replayed).resolve()]
    if not paths:
        raise LocalspecError("--refit-on: no recording left to fit on once the replayed one is "
                             "left out")
    cases = load_many(paths)
    w = rp.fit_prior([rp.training_rows(c) for c in cases])
    names = ", ".join(Path(p).name for p in paths)
    print(f"refit's prior: fitted on {len(cases)} cases of {names}: "
          f"({', '.join(f'{v:.3f}' for v in w)})")
    return w


def fold_weights(cases, folds):
    """Acceptance priors fitted on all cases but fold f, for each f (case i of a kind is in fold
    i % folds); with folds == 1, one prior fitted on everything."""
    rows = {c.id: rp.training_rows(c) for c in cases}
    fold_of, seen = {}, defaultdict(int)
    for c in cases:
        fold_of[c.id] = seen[c.kind] % folds
        seen[c.kind] += 1
    weights = {f: rp.fit_prior([rows[c.id] for c in cases if fold_of[c.id] != f or folds == 1])
               for f in range(folds)}
    return weights, fold_of, rows


def replay(a) -> None:
    cases = load_recording(a.path)
    data = json.load(open(a.path))
    if not 1 <= a.k_max <= K_LIMIT:
        raise LocalspecError(f"--k-max {a.k_max}: expected 1..{K_LIMIT}")
    curve = parse_curve(a.curve, data, a.threads, a.k_max)
    prior = parse_curve(a.prior_curve, data, a.threads, a.k_max) if a.prior_curve else curve
    variants = parse_variants(a.variant)
    names = [n for n in a.policies.split(",") if n]
    names += [n for n in variants if n not in names]
    check_policies(names, variants, bool(a.refit_on))     # before any work
    print(f"true cost r(k):  {', '.join(f'{r:.2f}' for r in curve)}")
    if prior != curve:
        print(f"policy's prior:  {', '.join(f'{r:.2f}' for r in prior)}")
    refit = None
    if a.refit_on:
        names += [] if "refit" in names else ["refit"]
        refit = refit_prior([p for text in a.refit_on for p in text.split(",") if p], a.path)
    cv = fold_weights(cases, 2) if a.cv else None
    scores = defaultdict(lambda: defaultdict(list))    # name -> kind -> [(case, score)]
    bounds = defaultdict(list)
    calibration = defaultdict(lambda: [0, 0.0, 0.0, 0.0])   # (name, kind, k's bucket) -> sums
    shortfall = defaultdict(lambda: [0, 0, 0.0, 0, 0.0])   # (name, kind, where) -> sums
    costs = defaultdict(lambda: [0.0, 0.0])     # (name, kind) -> [its cost, the bound's]
    t0 = time.perf_counter()
    if a.llamacpp:
        from tools import llamacpp_replay as lr
        long_curve = rp.extend_curve(curve, lr.K_LLAMACPP)
        names += [n for n in lr.DRAFTERS if n not in names]
    for c in cases:
        w = cv[0][cv[1][c.id]] if cv else None
        b = rp.bound_case(c, curve, tie_margin=a.tie_margin, k_max=a.k_max)
        bounds[c.kind].append((c, b))
        if a.llamacpp:
            for name, drafter in lr.DRAFTERS.items():
                scores[name][c.kind].append((c, lr.replay_drafter(c, drafter(), long_curve)))
        for name, make in make_policies([n for n in names if not (a.llamacpp and n in lr.DRAFTERS)],
                                        prior, w, variants, refit).items():
            if a.calibration:
                make = (lambda make=make, key=(name, c.kind):
                        Calibrated(make(), curve, calibration, key))
            if a.shortfall:
                make = (lambda make=make, key=(name, c.kind), c=c:
                        Shortfall(make(), curve, c, shortfall, key, a.tie_margin))
            s = rp.replay_case(c, make, curve, propose_cost=a.propose_cost,
                               tie_margin=a.tie_margin, timing_noise=a.timing_noise,
                               k_max=a.k_max)
            scores[name][c.kind].append((c, s))
            if a.shortfall:
                costs[name, c.kind][0] += s.cost
                costs[name, c.kind][1] += (len(c.out) - 1) / b
    if a.per_case:
        print_cases(names, scores, bounds)
    print_table(names, scores, bounds)
    ours = [n for n in names if not (a.llamacpp and n in lr.DRAFTERS)]
    if a.calibration:
        print_calibration(ours, calibration)
    if a.shortfall:
        print_shortfall(ours, shortfall, costs)
    print(f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)


def print_cases(names, scores, bounds) -> None:
    """One row per case and policy: speedup, its bound, steps that drafted, tokens drafted and
    accepted (where a kind's mean comes from)."""
    print(f"{'case':30s} {'policy':10s} {'x plain':>8s} {'bound':>7s} {'drafted in':>14s} "
          f"{'accepted':>12s}")
    for kind, rows in bounds.items():
        for i, (c, b) in enumerate(rows):
            for name in names:
                s = scores[name][kind][i][1]
                print(f"{c.id:30s} {name:10s} {s.speedup:7.3f}x {b:6.3f}x "
                      f"{s.spec_steps:5d}/{s.steps:<4d} steps {s.accepted:5d}/{s.drafted:<5d}")
    print()


def print_table(names, scores, bounds) -> None:
    kinds = list(bounds)
    head = f"{'policy':16s}" + "".join(f"{k:>30s}" for k in kinds)
    print(head)
    bound_by_kind = {k: rp.geomean([b for _, b in bounds[k]]) for k in kinds}
    for name in names + ["bound"]:
        cells = []
        for k in kinds:
            if name == "bound":
                xs = [b for _, b in bounds[k]]
                cells.append(f"{rp.geomean(xs):.3f}x (worst {min(xs):.3f})")
                continue
            xs = [s.speedup for _, s in scores[name][k]]
            frac = rp.geomean(xs) / bound_by_kind[k]
            cells.append(f"{rp.geomean(xs):.3f}x {100 * frac:3.0f}% (w {min(xs):.3f})")
        print(f"{name:16s}" + "".join(f"{c:>30s}" for c in cells))
    for name in names:   # drafting where the future-knowing bound says there is ~nothing
        low = [(s, b) for k in kinds for (c, s), (_, b) in zip(scores[name][k], bounds[k])
               if b < 1.05]
        if low:
            steps = sum(s.steps for s, _ in low)
            spec = sum(s.spec_steps for s, _ in low)
            print(f"{name}: {len(low)} cases with bound < 1.05x: drafted in {spec} of {steps} "
                  f"steps ({100 * spec / max(1, steps):.1f}%)")


def fit(a) -> None:
    import numpy as np
    cases = load_many(a.paths)
    weights, fold_of, rows = fold_weights(cases, a.folds)
    for f, w in weights.items():
        if a.folds == 1:
            break
        test = [rows[c.id] for c in cases if fold_of[c.id] == f]
        X = np.vstack([x for x, _, _ in test])
        y = np.concatenate([y for _, y, _ in test])
        rate = np.r_[np.log(y.mean() / (1 - y.mean())), np.zeros(len(w) - 1)]
        print(f"fold {f}: held-out log loss {rp.log_loss(X, y, w):.4f} "
              f"(a constant rate: {rp.log_loss(X, y, rate):.4f})")
    w = rp.fit_prior(list(rows.values()))
    y = np.concatenate([y for _, y, _ in rows.values()])
    print(f"all cases: {len(y)} rows, acceptance {y.mean():.3f}")
    for name, v in zip(FEATURES, w):
        print(f"  {name:14s} {v:+.3f}")
    print("PRIOR_WEIGHTS = (" + ", ".join(f"{v:.3f}" for v in w) + ")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("path")
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--exact", action="store_true")
    rec.add_argument("--workloads", help="a workloads JSONL file (default: the shipped cases)")
    rec.add_argument("--model", default="default", help="catalog name or .gguf path")
    rep = sub.add_parser("replay")
    rep.add_argument("path")
    rep.add_argument("--curve", default="here",
                     help="what steps cost: epyc, xeon, here (this machine's newest calibration, "
                          "the default), a calibration or bench .json, or 1,r(1),r(2),...")
    rep.add_argument("--prior-curve", help="what the policies believe (default: --curve)")
    rep.add_argument("--threads", type=int, default=2, help="which calibration `here` reads")
    rep.add_argument("--policies", default="old,new")
    rep.add_argument("--k-max", type=int, default=K_LIMIT,
                     help=f"the longest draft a step may verify (default {K_LIMIT}, the shipped "
                          "limit; 16 replays the policy as it was before 2026-11-27, and as this "
                          "tool did before 2026-12-04); every curve is carried to it with its "
                          "last slope")
    rep.add_argument("--propose-cost", type=float, default=PROPOSE_COST)
    rep.add_argument("--tie-margin", type=float, default=0.25)
    rep.add_argument("--cv", action="store_true")
    rep.add_argument("--per-case", action="store_true", help="a row per case before the table")
    rep.add_argument("--variant", action="append", metavar="NAME:key=value,...",
                     help="also replay the adaptive policy with settings changed, e.g. "
                          "tight:min_gain=1.2,loss_budget=0.6,guard.threshold=1.0 (repeatable; "
                          "keys: PolicyConfig fields, guard.*, acceptance.*, cost.*)")
    rep.add_argument("--calibration", action="store_true",
                     help="after the table: per policy, kind and k, the gain its drafting steps "
                          "were predicted to make against the gain they made")
    rep.add_argument("--shortfall", action="store_true",
                     help="after the table: per policy and kind, where it falls short of the "
                          "bound: matches it did not draft (and why not: predicted under "
                          "plain, under min_gain, the loss budget, the guard), rows drafted "
                          "past the first rejection, runs drafted in part")
    rep.add_argument("--refit-on", action="append", metavar="REC.json,...",
                     help="also replay the adaptive policy as `refit`, its acceptance prior "
                          "fitted on these recordings (the replayed one left out): does more "
                          "or other data make a better prior than the shipped one?")
    rep.add_argument("--llamacpp", action="store_true",
                     help="also replay llama.cpp's ngram-simple and ngram-mod drafters "
                          "(tools/llamacpp_replay.py; their drafts run to 64 tokens, charged on "
                          "the curve extended with its last slope)")
    rep.add_argument("--timing-noise", type=float, default=0.0, metavar="SIGMA",
                     help="tell the policies jittered step times (log-normal SIGMA, e.g. 0.08, "
                          "and 3%% descheduled steps), as a shared machine does; scores still "
                          "use the true curve")
    ft = sub.add_parser("fit")
    ft.add_argument("paths", nargs="+", metavar="path", help="one or more recordings")
    ft.add_argument("--folds", type=int, default=2)
    a = ap.parse_args()
    try:
        run(a)
    except LocalspecError as e:
        sys.exit(f"error: {e}")


def run(a) -> None:
    if a.cmd == "record":
        from tools.replay_record import record
        record(a.path, a.threads, a.exact, workloads=a.workloads, model=a.model)
    elif a.cmd == "replay":
        replay(a)
    else:
        fit(a)


if __name__ == "__main__":
    main()
