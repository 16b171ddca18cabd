"""Does the policy recover from a wrong cost curve? Replays recorded cases (tools/replay.py) with
the adaptive policy believing one curve (--prior, e.g. a poisoned first calibration) while the
steps cost, and are timed at, another (--truth), beside the same policy believing the truth.

    python scripts/bench/curve_recovery.py data/recordings/policy_heldout3_zen4.json \\
        --prior 1,1.06,2.59,6.26 --truth 1,1.23,1.36,1.49,1.81,1.98,2.14,2.31,2.63 \\
        [--kinds code-edit] [--settings probe_share=0] [--trusted] [--session] [--per-case]

Both curves are extended to k = 64 as tools/llamacpp_replay.py extends them (the last slope; a
first slice's curve, as calibrate.py fills it, grows in proportion past its largest k: give the
points it had). Per kind: the geometric mean of each policy's speedup over plain, their ratio,
and the recovery: the steps after which the cost model's r(k) stays within 20% of the truth at
k = 1, 3, 7 and 15, and the probes it spent (explore.py). By default each case starts from the
prior (a fresh engine each time: the hardest case); --session runs one engine through every
case in order, its cost model and probe budget carried on, as a user's requests share them.
The prior is weighed as the engine weighs a first slice, rough (CostConfig.noisy_prior_weight),
unless --trusted (as a finished calibration: prior_weight).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))            # the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))                # policy_replay

from tools import llamacpp_replay as lr  # noqa: E402
from tools import replay as rp  # noqa: E402
from localspec.policy.costmodel import CostConfig  # noqa: E402
from localspec.policy.slices import fill  # noqa: E402

TOLERANCE = 0.2     # the learned r(k) within this of the truth: recovered at k
CHECKED = (1, 3, 7, 15)   # the sizes whose learned cost is checked


def first_slice(points: list, k_max: int = 64) -> list:
    """r(0..k_max) as a first slice that timed r(1..len-1) leaves it (calibrate.py's fill:
    in proportion past the last point)."""
    return fill({k: r for k, r in enumerate(points) if k}, k_max)


def replay(case, prior: list, truth: list, settings: dict) -> float:
    """The speedup of one case."""
    return rp.replay_case(case, lr.localspec_policy(prior, 64, settings), truth[:65],
                          tie_margin=0.0, propose_cost=0.002, k_max=64).speedup


def engine(prior: list, settings: dict):
    """A maker of policies that share one cost model and probe budget, as an engine's requests
    do (speculative/drafting.py)."""
    from policy_replay import _variant
    from localspec.policy.acceptance import AcceptanceConfig
    from localspec.policy.adaptive import AdaptivePolicy
    from localspec.policy.costmodel import CostModel
    from localspec.policy.explore import Exploration
    config, cost_config = _variant({**settings, "k_max": 64}, AcceptanceConfig())
    cost = CostModel(prior, rp.BASE_MS, cost_config)
    explore = Exploration(config.probe_share, config.probe_timed)
    return lambda: AdaptivePolicy(cost, config, explore=explore)


def recovery(cases, make_base, truth: list) -> tuple:
    """([speedup per case], steps after which the learned r(k) stays within TOLERANCE of the
    truth at CHECKED (None: never), probes spent), replaying `cases` one after another with
    policies from `make_base` (steps counted over them all)."""
    wrong: list = []        # per step: was the learned curve off at a checked k
    made: list = []

    def make():
        policy = make_base()
        made.append(policy)
        observe = policy.observe_step

        def watched(f, k, n_accepted, emitted, verify_ms=None, propose_ms=0.0):
            observe(f, k, n_accepted, emitted, verify_ms, propose_ms)
            wrong.append(any(abs(policy.cost.ratio(j) / truth[j] - 1.0) > TOLERANCE
                             for j in CHECKED))
        policy.observe_step = watched
        return policy
    scores = [rp.replay_case(c, make, truth[:65], tie_margin=0.0, propose_cost=0.002,
                             k_max=64).speedup for c in cases]
    last = max((i for i, off in enumerate(wrong) if off), default=-1)
    probes = sum({id(p.explore): p.explore.n_probes for p in made}.values())
    return scores, (last + 1 if last + 1 < len(wrong) else None), probes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recordings", nargs="+")
    ap.add_argument("--prior", required=True, help="what the policy believes: 1,r(1),...")
    ap.add_argument("--truth", required=True, help="what steps cost: 1,r(1),... or a curve of "
                    f"tools/llamacpp_replay.py ({', '.join(lr.CURVES)}; localspec's kernels)")
    ap.add_argument("--kinds", help="only these kinds (comma-separated)")
    ap.add_argument("--settings", default="", help="policy settings for both (policy_replay's "
                    "--variant keys, e.g. probe_share=0)")
    ap.add_argument("--trusted", action="store_true",
                    help="weigh the prior as a finished calibration, not as a rough first slice")
    ap.add_argument("--session", action="store_true",
                    help="one engine through every case in order, not a fresh one per case")
    ap.add_argument("--per-case", action="store_true")
    a = ap.parse_args(argv)
    prior = first_slice([float(x) for x in a.prior.split(",")])
    truth = lr.CURVES[a.truth][0] if a.truth in lr.CURVES else \
        rp.extend_curve([float(x) for x in a.truth.split(",")], 64)
    settings = {}
    if a.settings:
        from policy_replay import parse_variants
        settings = parse_variants([f"x:{a.settings}"])["x"]
    rough = settings if a.trusted else \
        {"cost.prior_weight": CostConfig().noisy_prior_weight, **settings}
    cases = [lr.dataclass_with_prefix(c, p, len(a.recordings)) for p in a.recordings
             for c in rp.load(p)]
    if a.kinds:
        cases = [c for c in cases if c.kind in a.kinds.split(",")]
    for name, curve in (("prior", prior), ("truth", truth)):
        print(f"{name} r(1,3,7,15,31,63): "
              + ", ".join(f"{curve[k]:.2f}" for k in (1, 3, 7, 15, 31, 63)))
    told = [replay(c, truth, truth, settings) for c in cases]
    if a.session:
        wrong, steps, probes = recovery(cases, engine(prior, rough), truth)
        results = [(w, steps, probes) for w in wrong]
        print(f"one engine through {len(cases)} cases: recovered after "
              f"{steps if steps is not None else 'never'} steps, {probes} probes")
    else:
        results = []
        for c in cases:
            (w,), steps, probes = recovery([c], lr.localspec_policy(prior, 64, rough), truth)
            results.append((w, steps, probes))
    rows = defaultdict(list)
    for c, t, (w, steps, probes) in zip(cases, told, results):
        rows[c.kind].append((t, w, steps, probes))
        if a.per_case:
            print(f"{c.id:50s} truth {t:.3f}x  prior {w:.3f}x  recovered after "
                  f"{steps if steps is not None else 'never'} steps, {probes} probes")
    print("| kind | cases | believing the truth | believing the prior | ratio |"
          + ("" if a.session else " recovered (cases) | steps to recover (median, worst) |"
             " probes a case |"))
    print("|---|---|---|---|---|" + ("" if a.session else "---|---|---|"))
    for kind, rs in rows.items():
        g_true, g_prior = rp.geomean([r[0] for r in rs]), rp.geomean([r[1] for r in rs])
        line = f"| {kind} | {len(rs)} | {g_true:.3f}x | {g_prior:.3f}x | {g_prior / g_true:.3f} |"
        if not a.session:
            steps = sorted(r[2] for r in rs if r[2] is not None)
            line += (f" {len(steps)}/{len(rs)} | {steps[len(steps) // 2] if steps else '-'}, "
                     f"{steps[-1] if steps else '-'} | {sum(r[3] for r in rs) / len(rs):.1f} |")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
