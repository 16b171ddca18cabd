"""Watchers for scripts/bench/policy_replay.py: each wraps one replayed policy, decides nothing (the
policy chooses exactly as unwatched) and sums what it saw, to say *why* a policy scores what it
does: `Calibrated` (--calibration) compares the gain its acceptance model predicted for each
drafting step with the gain the step made; `Shortfall` (--shortfall) says where it falls short
of the future-knowing bound: matches it did not draft, and why not; rows drafted past the first
rejection; runs it drafted only part of.
"""

from __future__ import annotations

from pathlib import Path
import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tools/

from tools import replay as rp
from localspec.policy.acceptance import expected_tokens
from localspec.policy.adaptive import best_draft

K_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64))


class Calibrated:
    """An adaptive policy, watched: for each step that drafts k, the tokens its acceptance model
    expected (E(k) = 1 + p_0 + p_0 p_1 + ...) and the tokens the step emitted, both over the true
    r(k), summed into sums[(name, kind, k's bucket)]. The policy decides exactly as unwatched."""

    def __init__(self, policy, curve, sums, key):
        self.policy, self.curve, self.sums, self.key = policy, curve, sums, key
        self._expected = None

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def choose_draft(self, f):
        k = self.policy.choose_draft(f)
        self._expected = expected_tokens(self.policy.predict(f), k) \
            if k and hasattr(self.policy, "predict") else None
        return k

    def observe_step(self, f, k, n_accepted, emitted, verify_ms=None, propose_ms=0.0):
        if k and self._expected is not None:
            bucket = next(b for b in K_BUCKETS if b[0] <= k <= b[1])
            row = self.sums[self.key + (bucket,)]
            row[0] += 1
            row[1] += self._expected
            row[2] += len(emitted)
            row[3] += self.curve[k]
        self._expected = None
        self.policy.observe_step(f, k, n_accepted, emitted, verify_ms, propose_ms)


def print_calibration(names, sums) -> None:
    """Where the acceptance model is wrong: per policy, kind and k, the gain over plain its
    drafting steps were predicted to make and the gain they made (tokens / r(k))."""
    print("\ndrafting steps: gain predicted by the acceptance model vs realised (tokens / r(k))")
    print(f"{'policy':16s} {'kind':10s} {'k':>5s} {'steps':>6s} {'predicted':>10s} "
          f"{'realised':>9s}")
    order = {n: i for i, n in enumerate(names)}
    for (name, kind, (lo, hi)), (n, expected, emitted, cost) in sorted(
            sums.items(), key=lambda kv: (order[kv[0][0]],) + kv[0][1:]):
        k = f"{lo}" if lo == hi else f"{lo}-{hi}"
        print(f"{name:16s} {kind:10s} {k:>5s} {n:6d} {expected / cost:10.3f} "
              f"{emitted / cost:9.3f}")




MISSED = ("predicted below plain", "predicted under min_gain", "loss budget", "guard paused")


class Shortfall:
    """An adaptive policy, watched against the recorded output of `case`. Per step, into
    sums[(name, kind, where)] = [steps, steps whose match was right, plain steps, tokens, r]:

    - a proposal it did not draft: where = why not (its predicted best gain E(k)/r(k) over
      every k it could draft was under 1, or under min_gain, or the k that beat min_gain was
      outside the loss budget, or the regret guard had paused drafting); plain steps = what
      drafting exactly the matching run would have saved, (j + 1) - r(j), j cut before a
      near-tie row as the bound cuts it; tokens and r = what drafting the k the model liked
      best would have emitted and cost, summed over all such proposals, right or not (their
      ratio says whether drafting them all would have paid);
    - a draft that ran past its first rejection: plain steps = r(k) - r(accepted);
    - a draft wholly accepted whose match ran on: plain steps = r(k) + (j - k) - r(j), what
      drafting the whole run would have saved against finishing it plainly.
    Indicators, not a split of the gap to the bound (the bound takes another path)."""

    def __init__(self, policy, curve, case, sums, key, tie_margin=0.25):
        self.policy, self.curve, self.case, self.sums, self.key = policy, curve, case, sums, key
        self.tie_margin = tie_margin
        self._t, self._why = 1, None

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def choose_draft(self, f):
        guard = getattr(self.policy, "guard", None)   # the scalar policy ("old"): no reasons
        allows = guard is not None and guard.allows()  # before the choice, as the policy reads it
        k = self.policy.choose_draft(f)
        self._why = None
        if k == 0 and guard is not None:
            if not allows:
                self._why = (MISSED[3], 0)
            else:
                r = self.policy.cost.ratio_list()   # refreshed by choose_draft: no refit here
                best_k, best = best_draft(self.policy.predict(f), r)
                why = 0 if best < 1.0 else 1 if best <= self.policy.config.min_gain else 2
                self._why = (MISSED[why], best_k)
        return k

    def _add(self, where, right, plain_steps, tokens=0, r=0.0):
        row = self.sums[self.key + (where,)]
        for i, v in enumerate((1, right, plain_steps, tokens, r)):
            row[i] += v

    def observe_step(self, f, k, n_accepted, emitted, verify_ms=None, propose_ms=0.0):
        c, out, t = self.curve, self.case.out, self._t
        if f is not None and len(f.tokens) and emitted:
            run = rp.run_length(f.tokens, out, t)
            j = rp.clear_run(self.case.margin, t, min(run, len(c) - 1, len(out) - t - 1),
                             self.tie_margin)
            if k == 0 and self._why is not None:
                why, best_k = self._why
                self._add(why, run > 0, max(0.0, (j + 1) - c[j]),
                          min(run, best_k) + 1 if best_k else 0, c[best_k] if best_k else 0.0)
            elif k and n_accepted < k:
                self._add("drafted past the rejection", 0, c[k] - c[n_accepted])
            elif k and j > k and c[k] + (j - k) > c[j]:
                self._add("drafted part of the run", 1, c[k] + (j - k) - c[j])
        self._t += len(emitted)
        self._why = None
        self.policy.observe_step(f, k, n_accepted, emitted, verify_ms, propose_ms)


def print_shortfall(names, sums, costs) -> None:
    """Per policy and kind: its cost and the bound's (plain steps, summed over the cases), then
    each kind of shortfall Shortfall counted."""
    print("\nwhere each policy falls short of the bound, in plain steps (indicators, not a "
          "split):\nnot drafted: proposals, of them right, plain steps drafting the right ones "
          "would have saved,\nand the gain drafting them all at the k predicted best would have "
          "made (tokens / r(k))")
    print(f"{'policy':16s} {'kind':10s} {'where':38s} {'steps':>6s} {'right':>6s} "
          f"{'plain steps':>12s} {'gain if drafted':>16s}")
    order = {n: i for i, n in enumerate(names)}
    wheres = MISSED + ("drafted past the rejection", "drafted part of the run")
    for (name, kind), (cost, bound) in sorted(costs.items(), key=lambda kv: (order[kv[0][0]],
                                                                             kv[0][1])):
        total = f"its cost {cost:.1f}, the bound's {bound:.1f}"
        print(f"{name:16s} {kind:10s} {total:38s} {'':>6s} {'':>6s} {cost - bound:12.1f}")
        for where in wheres:
            n, right, steps, tokens, r = sums.get((name, kind, where), (0, 0, 0.0, 0, 0.0))
            if n:
                gain = f"{tokens / r:.3f}" if r else "-"
                missed = where in MISSED
                where = f"not drafted: {where}" if missed else where
                right = f"{right:6d}" if missed else ""
                print(f"{'':16s} {'':10s} {where:38s} {n:6d} {right:>6s} {steps:12.1f} "
                      f"{gain:>16s}")
