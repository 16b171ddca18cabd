"""A wrong cost curve is corrected online (issue 63): probes of longer drafts find out a curve
that overstates long batches, one stall moves nothing, probes stay within their budget, and a
curve the steps confirm is never probed. Timings are injected; no model, no wall clock."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from localspec.policy.acceptance import DraftFeatures
from localspec.policy.adaptive import AdaptivePolicy
from localspec.policy.config import PolicyConfig
from localspec.policy.costmodel import CostModel
from localspec.policy.explore import CREDIT_START, SUSPECT, Exploration
from localspec.policy.slices import fill
from tools import replay as rp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import curve_recovery  # noqa: E402

MS = 60.0
TRUTH = rp.extend_curve([1, 1.23, 1.36, 1.49, 1.81, 1.98, 2.14, 2.31, 2.63], 64)  # issue 63
POISONED = fill({1: 1.06, 2: 2.59, 3: 6.26}, 64)      # its first slice, as calibrate fills it
COPY = DraftFeatures(list(range(1000, 1064)), "history", 12, n_occ=1, agree=[1] * 64)


def copy_steps(policy, truth, n):
    """n steps of text that copies its source: every draft accepted, each step timed at
    truth[k] one-token decodes; the k drafted per step."""
    policy.start()
    ks = []
    for _ in range(n):
        k = policy.choose_draft(COPY)
        policy.observe_step(COPY, k, k, list(range(k + 1)), verify_ms=truth[k] * MS)
        ks.append(k)
    return ks


def test_a_poisoned_first_slice_recovers_within_a_bounded_number_of_steps():
    """Issue 63's first slice, r(1..3) = 1.06, 2.59, 6.26 (r(8) 15 by extrapolation), where the
    host really costs r(1..8) = 1.23 ... 2.63. Believing it, the policy drafts one token a step
    for ever. With probes (one size of 2, 4, ..., 64 rows at a time, on credit) its curve is
    within 25% of the truth from 1 to 63 drafts, and from step 40 on it drafts what believing
    the truth has it draft (7: on this curve longer drafts pay less). (The first probe waits
    for 16 timings that disagree with the curve and a run of 8 right guesses.)"""
    cost = CostModel(POISONED, MS, noisy=True)        # an unfinished slice is rough
    policy = AdaptivePolicy(cost)
    ks = copy_steps(policy, TRUTH, 60)
    for k in (1, 3, 7, 15, 31, 63):
        assert cost.ratio(k) == pytest.approx(TRUTH[k], rel=0.25), k
    knows = copy_steps(AdaptivePolicy(CostModel(TRUTH, MS)), TRUTH, 60)
    assert ks[40:] == knows[40:] == [7] * 20
    assert policy.explore.n_probes <= 6 and policy.explore.credit > 0
    stuck = copy_steps(AdaptivePolicy(CostModel(POISONED, MS, noisy=True),
                                      PolicyConfig(probe_share=0.0)), TRUTH, 60)
    assert max(stuck) <= 2                            # without probes it never finds out


def test_the_replay_of_a_poisoned_curve_recovers_on_recorded_code_edits():
    """The same on the 16 recorded code edits of held-out set 3, one engine through them all
    (its cost model and probe budget carried from case to case, as a session's requests share
    them): within 50 steps of the first case the curve stays right, and the speed over plain is
    at least 0.9 of what believing the truth gives."""
    cases = rp.load(str(Path(__file__).resolve().parents[1] / "data" / "recordings" /
                        "policy_heldout3_zen4.json"))
    rough = {"cost.prior_weight": 1.0}
    scores, steps, probes = curve_recovery.recovery(
        cases, curve_recovery.engine(POISONED, rough), TRUTH)
    truth = [curve_recovery.replay(c, TRUTH, TRUTH, {}) for c in cases]
    assert steps is not None and steps <= 50
    assert 1 <= probes <= 20
    assert rp.geomean(scores) >= 0.9 * rp.geomean(truth)
    never, _, _ = curve_recovery.recovery(
        cases, curve_recovery.engine(POISONED, {**rough, "probe_share": 0.0}), TRUTH)
    assert rp.geomean(never) < 0.7 * rp.geomean(truth)


def test_one_stalled_step_does_not_move_a_size():
    """A verify batch timed 5x its cost (the process descheduled) is clipped and outweighed:
    r(7) stays within 5%; a step timed faster than believed is believed at once."""
    cost = CostModel(TRUTH, MS)
    for i in range(48):
        cost.observe(0, MS)
        cost.observe(7, TRUTH[7] * MS * (5.0 if i == 24 else 1.0))
    assert cost.ratio(7) == pytest.approx(TRUTH[7], rel=0.05)
    dear = CostModel(POISONED, MS)                    # r(7) believed 13.3, capped at 10
    assert dear.ratio(7) == pytest.approx(10.0)
    for _ in range(4):
        dear.observe(0, MS)
        dear.observe(7, TRUTH[7] * MS, now=True)
    assert dear.ratio(7) == pytest.approx(TRUTH[7], rel=0.1)


def test_a_curve_the_steps_confirm_is_never_probed():
    cost = CostModel(TRUTH, MS)
    ks = copy_steps(AdaptivePolicy(cost), TRUTH, 60)
    assert cost.disagreement < SUSPECT
    policy = AdaptivePolicy(cost)
    copy_steps(policy, TRUTH, 60)
    assert policy.explore.n_probes == 0 and ks == copy_steps(AdaptivePolicy(CostModel(
        TRUTH, MS), PolicyConfig(probe_share=0.0)), TRUTH, 60)


def test_probes_lose_at_most_their_share_of_the_time():
    """A curve whose excess cost is 30% under the truth (so the steps disagree with it) on a
    host whose long batches really are dear (the Zen 3's r(8) 5.9): probes there lose, and the
    budget keeps the loss within `probe_share` of the time spent, plus the starting credit."""
    steep = rp.extend_curve([1, 1.48, 1.96, 2.22, 2.68], 64, {8: 5.86, 16: 8.44})
    prior = [1.0 + 0.7 * (r - 1.0) for r in steep]
    explore = Exploration(share=0.02)
    policy = AdaptivePolicy(CostModel(prior, MS), PolicyConfig(), explore=explore)
    policy.start()
    spent = lost = 0.0
    lowest = explore.credit
    for _ in range(600):
        k = policy.choose_draft(COPY)
        probe = explore.pending if explore.pending is not None and explore.pending.k == k \
            else None
        policy.observe_step(COPY, k, k, list(range(k + 1)), verify_ms=steep[k] * MS)
        spent += steep[k]
        if probe is not None:
            lost += steep[k] - (k + 1) * probe.unit
        lowest = min(lowest, explore.credit)
    assert explore.n_probes >= 1
    assert lost <= 0.02 * spent + CREDIT_START + 1e-9
    assert lowest >= -1e-9
