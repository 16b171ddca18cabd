"""The acceptance model, the cost model, the regret guard and the adaptive policy: scripted
features and timings in, k out. Deterministic; no model, no wall clock."""

from __future__ import annotations

import doctest
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from localspec.policy import acceptance
from localspec.policy import adaptive
from localspec.errors import LocalspecError
from localspec.policy import calibrate
from localspec.policy import costmodel
from localspec.policy import explore, slices
from localspec.policy.acceptance import (AcceptanceModel, DraftFeatures, RequestState,
                                         expected_tokens)
from localspec.policy.adaptive import AdaptivePolicy, RegretGuard
from localspec.policy.config import GuardConfig, PolicyConfig
from localspec.policy.costmodel import CostConfig, CostModel, Stability, round_stability
from localspec.policy.draft_estimate import CostCurve

EPYC = [1.0, 1.48, 1.96, 2.22, 2.68, 3.485, 4.29, 5.095, 5.9, 6.2125, 6.525, 6.8375, 7.15,
        7.4625, 7.775, 8.0875, 8.4]
XEON = [1.0, 1.55, 1.75, 1.75, 2.2, 2.4, 2.6, 2.8, 3.0, 3.1125, 3.225, 3.3375, 3.45, 3.5625,
        3.675, 3.7875, 3.9]
MS = 60.0

COPY = DraftFeatures(list(range(100, 116)), "history", 8, n_occ=1, agree=[1] * 16)
GUESS = DraftFeatures(list(range(200, 216)), "history", 1, n_occ=9,
                      agree=[3, 1] + [1] * 14)


def test_docstring_examples():
    for mod in (acceptance, adaptive, costmodel, calibrate, slices, explore):
        assert doctest.testmod(mod).failed == 0


# -- acceptance ------------------------------------------------------------------------------
WARM = RequestState(streak=12, recent=0.9)      # a request that has been copying
# An acceptance model that learns nothing within a request: no online offset, no per-token
# hazard (where a test watches another part, such as the guard, act alone)
NOT_LEARNING = acceptance.AcceptanceConfig(learn_rate=0.0,
                                           weights=acceptance.PRIOR_WEIGHTS[:-1] + (0.0,))
COLD = RequestState(streak=0, recent=0.3)       # one where guesses keep failing


def test_copied_run_is_predicted_likelier_than_a_one_token_guess():
    model = AcceptanceModel()
    copy = model.predict(COPY, 8, WARM)
    guess = model.predict(GUESS, 8, COLD)
    assert len(copy) == 8 and all(0 < p < 1 for p in list(copy) + list(guess))
    assert copy[0] > 0.8 > 0.5 > guess[0]
    assert expected_tokens(copy, 8) > 2 * expected_tokens(guess, 8)


def test_fast_logits_are_the_feature_matrix_times_the_weights():
    model = AcceptanceModel()
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 17))
        agree = np.sort(rng.integers(0, 6, n))[::-1].tolist()
        f = DraftFeatures(list(range(n)), "history", int(rng.integers(1, 9)),
                          n_occ=max(agree[0], int(rng.integers(0, 8))), agree=agree,
                          breaks=rng.integers(0, 3, n).tolist() if rng.random() < 0.7 else None)
        st = RequestState(streak=int(rng.integers(0, 80)), recent=float(rng.random()))
        for tok in rng.integers(0, 20, 6).tolist():         # tokens that parted from a copy
            st.seen[tok] = st.seen.get(tok, 0) + int(rng.integers(1, 4))
            st.missed[tok] = int(rng.integers(0, st.seen[tok] + 1))
        x = acceptance.phis(f, n, st)
        want = x @ np.asarray(acceptance.PRIOR_WEIGHTS)
        np.testing.assert_allclose(model.base_logits(f, n, st), want, rtol=1e-12, atol=1e-12)
        # a draft-store offer: its corrections (acceptance.STORE_TERMS) on the same features
        trust = float(rng.normal())
        g = replace(f, source="store", breaks=None, trust=trust)
        x = acceptance.phis(g, n, st)
        terms = np.stack([np.ones(n), np.full(n, np.log(g.ngram_len / 4)), x[:, 2] - 1.0,
                          x[:, 3], x[:, 5], x[:, 4], x[:, 6]], axis=1)
        want = x @ np.asarray(acceptance.PRIOR_WEIGHTS) + terms @ \
            np.asarray(acceptance.STORE_WEIGHTS) + trust
        np.testing.assert_allclose(model.base_logits(g, n, st), want, rtol=1e-12, atol=1e-12)


def test_disagreeing_occurrences_and_line_breaks_lower_their_position():
    model = AcceptanceModel()
    agree = DraftFeatures(list(range(8)), "history", 3, n_occ=4, agree=[4] * 8)
    split = DraftFeatures(list(range(8)), "history", 3, n_occ=4, agree=[4, 4, 1, 1, 1, 1, 1, 1])
    broken = DraftFeatures(list(range(8)), "history", 3, n_occ=4, agree=[4] * 8,
                           breaks=[0, 0, acceptance.NEWLINE, 0, 0, 0, 0, 0])
    pa, ps, pb = (model.predict(f, 8, WARM) for f in (agree, split, broken))
    assert list(pa[:2]) == list(ps[:2]) == list(pb[:2])   # same until position 2
    assert ps[2] < pa[2] and pb[2] < pa[2]


def test_a_token_where_the_copies_parted_before_ends_the_next_draft_before_it():
    """RequestState.hazard: a rename rejects the old name at each use. The verifier's misses
    are counted per token id (checked positions only); a copy whose offer holds that token
    again is predicted to end there, and the policy drafts up to it instead of past it."""
    st = RequestState()
    old = 105                                              # COPY's token 5: the old name
    st.verified(COPY, 8, 5, [100, 101, 102, 103, 104, 7])  # drafts 0-4 accepted, 5 rejected
    assert st.seen == {t: 1 for t in range(100, 106)} and st.missed == {old: 1}
    st.verified(COPY, 0, 0, [100])                         # a shadow guess, right: seen only
    assert st.seen[100] == 2 and st.hazard(100) == 0.0 and st.hazard(old) == 0.5
    model = AcceptanceModel()
    fresh = replace(WARM)
    edited = replace(WARM, seen=dict(st.seen), missed=dict(st.missed))
    pf, pe = model.predict(COPY, 16, fresh), model.predict(COPY, 16, edited)
    assert list(pe[:5]) == list(pf[:5]) and pe[5] < pf[5] and list(pe[6:]) == list(pf[6:])
    # a quote in prose, its second token twice the one rejected: the draft stops before it
    quote = DraftFeatures(list(range(300, 316)), "history", 3, n_occ=1, agree=[1] * 16)
    policy = AdaptivePolicy(CostModel(EPYC, MS, CostConfig(online=False)))
    for parted, k in (({}, 3), ({301: 2}, 1)):
        policy.state = RequestState(streak=1, recent=0.7, longest=64, seen=dict(parted),
                                    missed=dict(parted))
        assert policy.choose_draft(quote) == k


def test_online_offset_follows_what_the_verifier_says():
    model = AcceptanceModel(acceptance.AcceptanceConfig(learn_rate=0.15))
    before = model.predict(COPY, 1, WARM)[0]
    for _ in range(30):
        model.observe(COPY, 4, 0, WARM)              # rejected at once, every time
    assert model.predict(COPY, 1, WARM)[0] < before - 0.3
    for _ in range(60):
        model.observe(COPY, 4, 4, WARM)              # then accepted throughout
    assert model.predict(COPY, 1, WARM)[0] > before - 0.05


def test_request_state_counts_guesses_per_output_token():
    st = RequestState()
    st.verified(COPY, 4, 4, [100, 101, 102, 103, 7])   # four drafts accepted
    assert st.streak == 4 and st.recent > acceptance.RECENT_PRIOR
    high = st.recent
    st.verified(COPY, 4, 1, [100, 9])                   # one accepted, then a miss
    assert st.streak == 0 and st.recent < high
    st.verified(COPY, 0, 0, [100])                      # not drafted; the guess was right
    assert st.streak == 1
    st.verified(COPY, 3, 0, [])                         # a near-tie at row 0: nothing decided
    assert st.streak == 1


def test_expected_tokens_is_one_plus_prefix_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.9, 0.5, 0.0], 3) == pytest.approx(1 + 0.9 + 0.45)
    np.testing.assert_allclose(acceptance.expected_by_k(np.array([0.9, 0.5, 0.0])),
                               [1.9, 2.35, 2.35])


# -- cost model ------------------------------------------------------------------------------
def test_noisy_calibration_is_detected():
    quiet = [[0.060, 0.089, 0.118, 0.133, 0.161], [0.061, 0.090, 0.118, 0.135, 0.162],
             [0.060, 0.089, 0.119, 0.134, 0.160]]
    assert not round_stability(quiet).noisy
    slower = [[2 * t for t in quiet[0]]] + quiet[1:]          # a uniformly slower round: fine
    assert not round_stability(slower).noisy
    busy = [quiet[0], [0.061, 0.109, 0.150, 0.151, 0.200], [0.060, 0.089, 0.140, 0.180, 0.161]]
    st = round_stability(busy)                                # another job came and went
    assert st.noisy and st.worst_k in (2, 3) and st.spread > costmodel.NOISY_SPREAD
    assert "NOISY" in costmodel.stability_line(st)
    assert "stable" in costmodel.stability_line(round_stability(quiet))
    five = quiet + quiet[:1] + [busy[1]]                      # one odd round of five: left out
    assert not round_stability(five).noisy
    tiny = [[t / 1000 for t in r] for r in busy]              # 0.06 ms steps: timer jitter
    assert round_stability(tiny).spread > costmodel.NOISY_SPREAD
    assert not round_stability(tiny).noisy
    assert "timer-bound" in costmodel.stability_line(round_stability(tiny))


def fake_ctx(tmp_path):
    """What curve_key reads of a context; the timings are scripted by each test."""
    class Ctx:
        class model:
            path = tmp_path / "m.gguf"
            repacked = True
            placement = ""                   # every layer on the CPU
        n_threads = 2
        n_batch = 512

    Ctx.model.path.write_bytes(b"gguf")
    return Ctx


def test_noisy_cached_curve_is_measured_again_and_the_steadier_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))

    Ctx = fake_ctx(tmp_path)                 # measure() is scripted below
    spreads = iter([0.30, 0.20, 0.02, 0.5, 0.4, 0.3])
    monkeypatch.setattr(calibrate, "measure", lambda ctx, k_max: CostCurve(
        (1.0, 1.5), 50.0, notes={"stability": Stability(5, next(spreads), 1, 0.3, 0.1)}))
    first = calibrate.load_or_measure(Ctx, k_max=1)                       # 0.30: noisy
    assert first.notes["stability"].noisy
    second = calibrate.load_or_measure(Ctx, k_max=1)                      # noisy: again (0.20)
    assert second.notes["stability"].spread == 0.20 and second.notes["remeasured"] == 1
    forced = calibrate.load_or_measure(Ctx, k_max=1, force=True, attempts=3)  # 0.02: stops
    assert forced.notes["stability"].spread == 0.02 and forced.notes["attempts"] == 1
    assert calibrate.load_or_measure(Ctx, k_max=1).notes["stability"].spread == 0.02  # cached
    saved = json.loads(next((tmp_path / "calibration").glob("*.json")).read_text())
    assert saved["stability"]["spread"] == 0.02
    busy = calibrate.load_or_measure(Ctx, k_max=1, force=True, attempts=3)  # 0.5, 0.4, 0.3
    assert busy.notes["attempts"] == 3 and busy.notes["stability"].spread == 0.3
    assert ", 3 attempts;" in costmodel.stability_line(busy.notes["stability"], 3)


def test_cost_model_without_timings_is_the_prior():
    cm = CostModel(EPYC, MS)
    assert cm.ratios() == pytest.approx(EPYC)
    off = CostModel(EPYC, MS, CostConfig(online=False))
    for _ in range(50):
        off.observe(0, MS)
        off.observe(3, 10 * MS)
    assert off.ratios() == pytest.approx(EPYC)          # reproducible mode ignores timing


def test_cost_model_follows_a_drifting_machine_without_changing_the_curve():
    cm = CostModel(EPYC, MS)
    for step in range(400):
        scale = 1.0 if step < 100 else 1.5                # the whole machine slows down
        cm.observe(0, MS * scale)
        cm.observe(2, MS * scale * EPYC[2])
    assert cm.ms(0) == pytest.approx(1.5 * MS, rel=0.05)
    assert cm.ratio(2) == pytest.approx(EPYC[2], rel=0.02)


def test_one_odd_step_does_not_rewrite_the_curve():
    cm = CostModel(XEON, MS)
    for _ in range(20):
        cm.observe(0, MS)
        cm.observe(3, MS * XEON[3])
    cm.observe(3, MS * 40)                                # descheduled once
    assert cm.ratio(3) < 1.2 * XEON[3]


def test_timings_showing_k3_costs_twice_the_cache_change_the_choice():
    f = DraftFeatures(list(range(3)), "history", 6, n_occ=2, agree=[2, 2, 2])
    make = lambda cm: AdaptivePolicy(cm, PolicyConfig())
    trusting = make(CostModel(XEON, MS))
    trusting.start()
    trusting.state = RequestState(streak=10, recent=0.9, longest=10)
    assert trusting.choose_draft(f) == 3                  # XEON: r(3) = r(2): take all three
    cm = CostModel(XEON, MS)
    for _ in range(40):
        cm.observe(0, MS)
        cm.observe(1, XEON[1] * MS)                       # k = 1 and 2 cost what the
        cm.observe(2, XEON[2] * MS)                       # cache says, but k = 3 really
        cm.observe(3, 2 * XEON[3] * MS)                   # costs 3.5 steps
    assert cm.ratio(3) > 1.6 * XEON[3]
    learned = make(cm)
    learned.start()
    learned.state = RequestState(streak=10, recent=0.9, longest=10)
    assert learned.choose_draft(f) == 2


def test_choice_of_k_is_the_argmax_of_expected_tokens_over_cost():
    """choose_draft's float loop against the definition: argmax_k E(k) / r(k) over numpy
    arrays (expected_by_k) among the k whose r(k) - 1 fits the loss budget, plain when the
    best is not above min_gain."""
    rng = np.random.default_rng(1)
    config = PolicyConfig()
    n_plain = n_bound = 0
    for curve in (EPYC, XEON):
        policy = AdaptivePolicy(CostModel(curve, MS, CostConfig(online=False)), config)
        for _ in range(300):
            n = int(rng.integers(1, 17))
            agree = np.sort(rng.integers(0, 9, n))[::-1].tolist()
            f = DraftFeatures(list(range(n)), "history", int(rng.integers(1, 9)),
                              n_occ=max(agree[0], int(rng.integers(1, 9))), agree=agree)
            streak = int(rng.integers(0, 12))
            policy.state = RequestState(streak=streak, recent=float(rng.random()),
                                        longest=streak + int(rng.integers(0, 12)))
            p = np.asarray(policy.predict(f))
            r = np.asarray(curve)[1:n + 1]
            gain = acceptance.expected_by_k(p) / r
            gain[r - 1 > config.loss_budget * (policy.state.longest + 1)] = 0.0
            want = int(np.argmax(gain)) + 1 if gain.max() > config.min_gain else 0
            assert policy.choose_draft(f) == want
            n_plain += want == 0
            n_bound += int(np.argmax(acceptance.expected_by_k(p) / r)) + 1 > max(want, 1)
    assert n_plain > 5 and n_bound > 20              # plain, and the budget binding, both seen


def test_deep_drafts_wait_for_the_request_to_show_long_copied_runs():
    """The loss budget: a draft of k risks r(k) - 1 plain steps if its first token misses; a
    request may risk loss_budget x (its longest run of right guesses + 1) of them. EPYC:
    r(1) - 1 = 0.48, r(2) - 1 = 0.96, r(8) - 1 = 4.9."""
    f = DraftFeatures(list(range(16)), "history", 8, n_occ=4, agree=[4] * 16)
    policy = AdaptivePolicy(CostModel(EPYC, MS, CostConfig(online=False)))
    picks = {}
    for longest in (0, 1, 2, 3, 40):
        policy.start()
        policy.state = RequestState(streak=longest, recent=0.95, longest=longest)
        assert policy.predict(f)[0] > 0.9                  # the model likes every one of them
        picks[longest] = policy.choose_draft(f)
    # budget r(k) <= 1 + 0.4 (longest + 1): 1.4 (< r(1) = 1.48: plain), 1.8 (k = 1), 2.2
    # (k <= 2), 2.6 (k <= 3: r(4) = 2.68 does not fit), 17.4 (all 16)
    assert picks == {0: 0, 1: 1, 2: 2, 3: 3, 40: 16}
    gpu = AdaptivePolicy(CostModel([1.0] + [1.02] * 16, MS, CostConfig(online=False)))
    gpu.start()
    gpu.state = RequestState(streak=0, recent=0.95)
    assert gpu.choose_draft(f) == 16                      # r(k) ~ 1: the budget never binds
    # Only the positions the budget lets it draft are predicted (the per-step Python of chat,
    # where most steps draft nothing): one for a plain step, which learns from position 0.
    asked = []
    predict = policy.acceptance.base_logits
    policy.acceptance.base_logits = lambda f, n, state: asked.append(n) or predict(f, n, state)
    for longest in (0, 1, 3, 40):
        policy.state = RequestState(streak=longest, recent=0.95, longest=longest)
        policy.choose_draft(f)
    assert asked == [1, 1, 3, 16]
    seen = RequestState()
    for hits in (3, 0, 5, 1):                             # the longest run is remembered
        seen.verified(f, 8, hits, [0] * (hits + 1))
    assert seen.longest == 5 and seen.streak == 0


def test_a_run_that_has_copied_two_line_breaks_ramps_at_the_long_rate():
    """long_lines: a run of right guesses holding two line breaks is a block of lines being
    copied, and gets loss_budget_long before it is long_run tokens long; a miss ends the run
    and its lines. Lines come from the proposal's token classes of the tokens that passed."""
    nl, plain = acceptance.NEWLINE, acceptance.PLAIN
    f = DraftFeatures(list(range(16)), "history", 8, n_occ=1, agree=[1] * 16,
                      breaks=[plain, plain, nl, plain, nl] + [plain] * 11)
    st = RequestState()
    st.verified(f, 4, 4, [0] * 5)                   # tokens 0-3 passed: one line break
    assert (st.streak, st.lines) == (4, 1)
    st.verified(f, 0, 0, [0])                       # a plain step guessed right: token 0
    assert (st.streak, st.lines) == (5, 1)
    st.verified(f, 8, 5, [0] * 6)                   # 0-4 passed (two breaks), 5 missed
    assert (st.streak, st.lines, st.longest) == (0, 0, 10)
    st.verified(f, 8, 8, [0] * 9)
    assert (st.streak, st.lines) == (8, 2)
    # EPYC: r(8) = 5.9. At the 0.4 rate a streak of 8 may risk 1 + 0.4 x 9 = 4.6 plain steps
    # (k <= 6); with two lines copied, the 1.0 rate: 1 + 9 = 10 (all 16 fit in r(16) = 8.41)
    g = DraftFeatures(list(range(16)), "history", 8, n_occ=1, agree=[1] * 16)
    picks = {}
    for name, config in (("lines", PolicyConfig()), ("off", PolicyConfig(long_lines=0))):
        policy = AdaptivePolicy(CostModel(EPYC, MS, CostConfig(online=False)), config)
        policy.start()
        policy.state = RequestState(streak=8, recent=0.99, longest=8, lines=2)
        picks[name] = policy._depth(policy.cost.ratio_list())
    assert picks == {"lines": 16, "off": 6}


def test_cost_model_decays_observations_the_same_in_batches():
    """observe() defers the decay to the next solve; the weights must be those of decaying at
    every observation."""
    cm = CostModel(EPYC, MS, CostConfig(solve_every=7))
    w, sy = np.zeros(len(EPYC)), np.zeros(len(EPYC))
    rng = np.random.default_rng(2)
    for step in range(100):
        k = int(rng.integers(0, 5))
        ms = MS * EPYC[k] * float(rng.uniform(0.9, 1.1))
        cm.observe(k, ms)
        cm.ratio(1)                                       # solves every 7th observation
        w *= cm.config.decay
        sy *= cm.config.decay
        w[k] += 1.0
        sy[k] += math.log(ms)    # within the clip: the same y as observe() keeps
    cm._solve()
    np.testing.assert_allclose(cm._w, w, rtol=1e-12)
    np.testing.assert_allclose(cm._sy, sy, rtol=1e-12)


# -- regret guard ----------------------------------------------------------------------------
def stream_nothing_accepted(policy, f, steps):
    """Drive a policy with a proposal the prior loves and a verifier that rejects everything;
    returns which steps drafted."""
    drafted = []
    for _ in range(steps):
        k = policy.choose_draft(f)
        drafted.append(k > 0)
        policy.observe_step(f, k, 0, [999], verify_ms=MS * XEON[k])
    return drafted


def test_regret_guard_turns_speculation_off_within_a_bounded_number_of_steps():
    cfg = PolicyConfig(acceptance=NOT_LEARNING, loss_budget=math.inf)   # the guard alone
    policy = AdaptivePolicy(CostModel(XEON, MS), cfg)
    policy.start()
    drafted = stream_nothing_accepted(policy, COPY, 200)
    first_off = drafted.index(False)
    assert first_off <= GuardConfig().min_steps
    assert policy.guard.n_backoffs >= 1
    assert sum(drafted) <= 3 * GuardConfig().min_steps        # probes stay short and rare
    # With the loss budget on (the default), a request that never shows a right guess never
    # risks a draft at all on a CPU where one missed token costs half a step
    budgeted = AdaptivePolicy(CostModel(XEON, MS), replace(cfg, loss_budget=0.4))
    budgeted.start()
    assert sum(stream_nothing_accepted(budgeted, COPY, 200)) == 0


def test_regret_guard_probes_again_and_backs_off_longer_each_time():
    guard, c = RegretGuard(), GuardConfig()
    off_stretches, run = [], 0
    for _ in range(2000):
        if guard.allows():
            if run:
                off_stretches.append(run)
                run = 0
            guard.speculative(n_emitted=1, ms=1.75 * MS, plain_ms=MS)   # never pays
        else:
            run += 1
            guard.plain()
    assert off_stretches[:4] == [c.backoff, 2 * c.backoff, 4 * c.backoff, 8 * c.backoff]
    assert max(off_stretches) == c.backoff_max


def test_regret_guard_keeps_a_paying_stream_on():
    guard = RegretGuard()
    for _ in range(100):
        guard.speculative(n_emitted=4, ms=2.2 * MS, plain_ms=MS)
    assert guard.allows() and guard.n_backoffs == 0 and guard.gain > 1.5


def paying_then_one_deep_miss(guard: RegretGuard) -> None:
    for _ in range(10):                 # 2-token drafts, all accepted: 1.43x plain
        guard.speculative(n_emitted=3, ms=2.1 * MS, plain_ms=MS)
    guard.speculative(n_emitted=1, ms=7.0 * MS, plain_ms=MS)   # a 15-token draft, all missed


def test_regret_guard_one_deep_miss_does_not_pause_a_paying_stream():
    # Seen in a real summary running at 1.2x: one 15-token draft that missed pulled the
    # window's gain under the threshold and paused drafting for 24 steps.
    guard = RegretGuard()
    paying_then_one_deep_miss(guard)
    assert guard.allows() and guard.n_backoffs == 0
    uncapped = RegretGuard(GuardConfig(step_cap=math.inf))   # what it did before
    paying_then_one_deep_miss(uncapped)
    assert not uncapped.allows()
    # ... while deep misses that keep coming still turn drafting off
    for _ in range(GuardConfig().min_steps):
        guard.speculative(n_emitted=1, ms=7.0 * MS, plain_ms=MS)
    assert not guard.allows()


def test_regret_guard_compares_with_the_requests_own_plain_steps():
    # The engine's cost model remembers 50 ms plain steps (an earlier request, shorter
    # context); this request's plain steps take 60 ms, and its 2-token drafts emit 2 tokens in
    # 120 ms: as fast as plain here (gain 1.0), not a loss (2 x 50 / 120 = 0.83).
    cost = CostModel(EPYC, 50.0)
    for _ in range(200):
        cost.observe(0, 50.0)
    policy = AdaptivePolicy(cost, PolicyConfig(acceptance=acceptance.AcceptanceConfig(
        learn_rate=0.0)))
    policy.start()
    for _ in range(5):
        policy.observe_step(COPY, 0, 0, [999], verify_ms=60.0)
    assert cost.ms(0) < 55.0
    for _ in range(30):
        policy.observe_step(COPY, 2, 1, [100, 101], verify_ms=120.0)
        policy.observe_step(COPY, 0, 0, [999], verify_ms=60.0)
    assert policy.guard.n_backoffs == 0
    assert policy.guard.gain == pytest.approx(1.0, abs=0.01)


def test_steep_curve_and_weak_guesses_stay_plain():
    policy = AdaptivePolicy(CostModel(EPYC, MS))
    policy.start()
    assert policy.choose_draft(GUESS) == 0


def test_timings_of_one_k_correct_the_whole_curve_when_the_cache_is_too_flat():
    # The cache was measured on a Xeon-like curve; the machine behaves like the EPYC. Steps of
    # k = 2 alone must make k = 8, never tried, look dear too (one slope for the whole curve).
    cm = CostModel(XEON, MS)
    for _ in range(30):
        cm.observe(0, MS)
        cm.observe(2, MS * EPYC[2])
    assert cm.slope > 1.0
    assert cm.ratio(8) > 1.15 * XEON[8]                  # 3.5 (EPYC-like 5.9; Xeon 3.0)
    assert cm.ratio(2) == pytest.approx(EPYC[2], rel=0.1)
    steady = CostModel(EPYC, MS)                          # a right cache keeps its shape
    for _ in range(30):
        steady.observe(0, MS)
        steady.observe(2, MS * EPYC[2])
    assert steady.ratios() == pytest.approx(EPYC, rel=0.03)


class Device:
    """A context on a fake clock for calibration: a decode of n rows with logits takes `one` x
    truth[n - 1] seconds (a prefix without logits `one`); the decodes in `stalls` ({(rows, the
    how-many-th decode of that many rows): factor}) take `factor` times as long."""
    def __init__(self, clock, truth, one=0.05, stalls=None, path=None):
        self.clock, self.truth, self.one, self.stalls = clock, truth, one, dict(stalls or {})
        self.model = type("model", (), {"n_vocab": 100, "path": path, "repacked": True,
                                        "placement": ""})
        self.n_threads, self.n_batch = 2, 512
        self.n_past, self.decoded = 0, []

    def clear(self):
        self.n_past = 0

    def truncate(self, n):
        self.n_past = n

    def decode(self, toks, logits):
        n = len(toks)
        cost = self.one if logits == "none" else self.one * self.truth[n - 1]
        self.clock[0] += cost * self.stalls.get((n, self.decoded.count(n)), 1.0)
        self.n_past += n
        self.decoded.append(n)


def device(tmp_path, monkeypatch, truth, **kw):
    """A Device whose clock every timing in calibrate.py and slices.py reads."""
    clock = [0.0]
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    path = tmp_path / "m.gguf"
    path.write_bytes(b"gguf")
    return Device(clock, truth, path=path, **kw)


LINEAR = [1.0 + 0.5 * k for k in range(70)]     # r(k) = 1 + k / 2


def test_a_first_run_times_batches_in_slices_that_later_runs_finish(tmp_path, monkeypatch):
    """With a time budget, calibration is sliced: each slice times the least-timed sizes first
    (FIRST_KS before the others), each size three times in turn with others, and the curve is
    final once every k has FULL_ROUNDS plausible samples; then nothing is timed any more."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    ctx = device(tmp_path, monkeypatch, LINEAR, one=0.01)
    first = calibrate.load_or_measure(ctx, k_max=16, budget_s=0.5)
    assert ctx.decoded[:5] == [1, 1, 1, 2, 4]            # prefix, warm-up, reference, k = 1, 3
    assert not first.notes["complete"] and first.notes["dropped"] == 0
    assert first.notes["timed"] == [1, 2, 3, 7]          # the spread sizes first
    assert first.ratios == pytest.approx(LINEAR[:17], rel=1e-3)
    saved = json.loads(next((tmp_path / "calibration").glob("*.json")).read_text())
    assert saved["complete"] is False and saved["samples"]["3"] == pytest.approx([2.5] * 3)
    curve = first
    for _ in range(20):
        if curve.notes["complete"]:
            break
        curve = calibrate.load_or_measure(ctx, k_max=16, budget_s=0.5)    # the next runs
    assert curve.notes["complete"] and curve.ratios == pytest.approx(LINEAR[:17], rel=1e-3)
    n = len(ctx.decoded)
    assert calibrate.load_or_measure(ctx, k_max=16, budget_s=0.5).notes["complete"]
    assert len(ctx.decoded) == n                         # final: cached, nothing timed


def test_a_sliced_curve_uses_the_sparse_sizes_past_the_dense_ones(tmp_path, monkeypatch):
    """Past DENSE_K only SPARSE_K are timed: the curve a sliced calibration finishes must run
    through them (straight lines between), as measure()'s does, not extrapolate r(16)'s slope
    (seen on an AMD Zen 4: r(48) believed 21 where it was 17.6, so the policy drafted 15-21
    where 47 paid)."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))

    def r(k):                                            # flatter past 16 drafts
        return (k + 1 if k <= 16 else 17 + 0.5 * (k - 16)) ** 0.8
    ctx = device(tmp_path, monkeypatch, [r(n - 1) for n in range(1, 70)], one=0.001)
    curve = calibrate.load_or_measure(ctx, k_max=40, budget_s=60)
    assert curve.notes["complete"]
    assert calibrate.timed_ks(40)[-3:] == [28, 31, 40]
    for k in (16, 20, 28, 31, 40):
        assert curve.ratios[k] == pytest.approx(r(k), rel=1e-3)
    assert curve.ratios[30] == pytest.approx(r(28) + 2 * (r(31) - r(28)) / 3, rel=1e-3)


ISSUE_XEON = [1.0, 1.23, 1.36, 1.49, 1.81, 1.98, 2.14, 2.31, 2.63] + \
    [2.63 + 0.16 * k for k in range(1, 60)]   # issue 63's Xeon, r(1..8), then r(16) ~3.9


def test_one_stalled_sample_in_a_first_slice_is_rejected(tmp_path, monkeypatch, capsys):
    """Issue 63: one sample taken while the host stalled made a 4-row batch cost 6.26 one-token
    decodes, a curve of r(1..3) = 1.06, 2.59, 6.26 that held for the whole bench. A batch of n
    rows cannot cost more than n one-token decodes: that sample is dropped (counted, quietly),
    and the medians of the rest give the true curve; a stalled one-token reference moves
    nothing either (each batch counts against the median of its three nearest)."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    stalls = {(4, 0): 6.26 / 1.49, (1, 3): 3.0}            # the first 4-row batch; a reference
    ctx = device(tmp_path, monkeypatch, ISSUE_XEON, one=0.06, stalls=stalls)
    curve = calibrate.load_or_measure(ctx, k_max=64, budget_s=3.0)
    assert ctx.clock[0] <= 3.0                             # the first run's budget holds
    assert curve.notes["dropped"] == 1
    assert curve.ratios[1:4] == pytest.approx([1.23, 1.36, 1.49], rel=0.01)
    assert curve.ratios[7] == pytest.approx(2.31, rel=0.01)
    assert 7 in curve.notes["timed"] and curve.ratios[3] < 2.0
    assert "threw away" not in capsys.readouterr().err     # a sample, not the slice: quiet


def test_a_slice_that_cannot_be_true_is_thrown_away_with_one_line(tmp_path, monkeypatch,
                                                                  capsys):
    """A slice whose 2-row batches stalled every time (r(1) 2.4, under the 2.5 a sample may
    reach) while 4-row ones did not: the curve falls as the batch grows, so nothing of it is
    kept; one line on stderr says so, and the prior stands until a later run's slice."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    stalls = {(2, i): 2.4 / 1.23 for i in range(3)}
    ctx = device(tmp_path, monkeypatch, ISSUE_XEON, one=0.06, stalls=stalls)
    curve = calibrate.load_or_measure(ctx, k_max=16, budget_s=3.0)
    err = capsys.readouterr().err
    assert err.count("threw away this run's timing of verify batches") == 1, err
    assert "the cost fell as the batch grew" in err
    assert curve.ratios[:3] == pytest.approx([1.0, 1.3, 1.6]) and not curve.notes["complete"]
    quiet = calibrate.load_or_measure(ctx, k_max=16, budget_s=3.0)   # the next run: healthy
    assert quiet.ratios[1:4] == pytest.approx([1.23, 1.36, 1.49], rel=0.01)
    assert "threw away" not in capsys.readouterr().err


def test_a_timer_bound_slice_is_never_thrown_away(tmp_path, monkeypatch, capsys):
    """Under a millisecond a step is timer jitter, not load (a tiny test model): the same
    stalled 2-row batches drop nothing but what no batch can cost, and no line is printed."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    stalls = {(2, i): 2.4 / 1.23 for i in range(3)}
    ctx = device(tmp_path, monkeypatch, ISSUE_XEON, one=0.0002, stalls=stalls)
    curve = calibrate.load_or_measure(ctx, k_max=16, budget_s=3.0)
    assert curve.notes["complete"] and curve.notes["dropped"] == 0
    assert curve.ratios[1:4] == pytest.approx([1.36, 1.36, 1.49], rel=0.01)  # r(1) <= r(2)
    assert "threw away" not in capsys.readouterr().err


def test_the_issue_poisoned_cache_heals_at_the_next_run(tmp_path, monkeypatch):
    """A cache written before these checks (one sample per size, r(3) = 6.26): none of its
    single samples is a value any more, and the next slice's medians decide."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    ctx = device(tmp_path, monkeypatch, ISSUE_XEON, one=0.06)
    key = calibrate.curve_key(ctx, 0, 16)
    (tmp_path / "calibration").mkdir(mode=0o700)
    (tmp_path / "calibration" / f"{key}.json").write_text(json.dumps({
        "ratios": [1.0, 1.06, 2.59, 6.26] + [1 + 1.753 * k for k in range(4, 17)],
        "ms_per_step": 110.0, "complete": False, "remeasured": 0,
        "samples": {"t0": [0.11], "1": [1.06], "2": [2.59], "3": [6.26]}}))
    assert calibrate.load_or_measure(ctx, k_max=16, budget_s=0).ratios[3] == pytest.approx(1.9)
    healed = calibrate.load_or_measure(ctx, k_max=16, budget_s=3.0)
    assert healed.ratios[3] == pytest.approx(1.49, rel=0.01)
    assert healed.ratios[7] == pytest.approx(2.31, rel=0.01)


class SlowDevice(Device):
    """A context on a fake clock: a decode of n rows takes `one` x (1 + 0.5 (n - 1)) seconds (a
    prefix without logits `one`), and the first decode of a shape `compile_s` more (a software
    GPU compiling its shaders)."""
    def __init__(self, clock, one, compile_s):
        super().__init__(clock, truth=None, one=one)
        self.compile_s, self.shapes = compile_s, set()

    def decode(self, toks, logits):
        n = len(toks)
        cost = self.one if logits == "none" else self.one * (1 + 0.5 * (n - 1))
        self.clock[0] += cost + self.compile_s * (n not in self.shapes)
        self.shapes.add(n)
        self.n_past += n
        self.decoded.append(n)


def test_a_budget_bounds_the_whole_timing_call_on_a_slow_device(monkeypatch):
    """No batch starts that should end past the budget (guessed from the warm-up and the prior
    r(k)), the prefix and warm-up count against it, and a device whose first decode alone eats
    the budget gets an empty row, which leaves the prior in place."""
    clock = [0.0]
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    fast = SlowDevice(clock, one=0.01, compile_s=0.0)
    (row,) = calibrate.time_batches(fast, [1, 2, 3, 4, 5], 1, budget_s=3.0)
    assert len(row) == 5 and clock[0] <= 3.0
    clock[0] = 0.0
    mid = SlowDevice(clock, one=0.5, compile_s=0.0)
    (row,) = calibrate.time_batches(mid, [1, 2, 3, 4, 5], 1, budget_s=3.0)
    assert row == pytest.approx([0.5, 0.75]) and clock[0] <= 3.0   # a 3-row batch would not fit
    clock[0] = 0.0
    lavapipe = SlowDevice(clock, one=0.7, compile_s=6.0)
    assert calibrate.time_batches(lavapipe, [1, 2, 3], 1, budget_s=3.0) == [[]]
    assert lavapipe.decoded == [1, 1]                   # the 1-token prefix and the warm-up
    samples = slices.run_slice(lavapipe, {}, k_max=2, deadline=clock[0] + 1.0)
    assert samples == {}                                # nothing timed: the prior stands
    assert calibrate.curve_from_samples(samples, 2).ratios == (1.0, 1.3, 1.6)


def test_a_zero_budget_answers_with_the_prior_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "time_batches", lambda *a, **k: pytest.fail("timed"))

    Ctx = fake_ctx(tmp_path)
    curve = calibrate.load_or_measure(Ctx, k_max=2, budget_s=0)
    assert curve.ratios == (1.0, 1.3, 1.6) and not curve.notes["complete"]
    monkeypatch.setenv("LOCALSPEC_CALIBRATION_S", "nan")
    with pytest.raises(LocalspecError, match="LOCALSPEC_CALIBRATION_S"):
        calibrate.first_run_budget()
