"""Pure-Python parts: sampler chain, random stream, text streaming, draft policy (build flags:
tests/test_buildflags.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from localspec.policy.config import PolicyConfig
from localspec.policy.draft_estimate import DraftPolicy, expected_tokens
from localspec.speculative.sampling import (Dist, PositionStream, SamplingParams, apply_penalty, draw,
                                target_dist)
from localspec.speculative.stats import GenerationStats
from localspec.speculative.textstream import TextStream


def test_chain_top_k_example():
    logits = np.array([0.0, math.log(3), 0.0 - 5, -np.inf], dtype=np.float32)
    d = target_dist(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0))
    assert d.ids.tolist() == [0, 1]
    np.testing.assert_allclose(d.probs, [0.25, 0.75], rtol=1e-6)


def test_chain_top_p_min_p_and_temperature():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    top_p = target_dist(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0))
    assert top_p.ids.tolist() == [0, 1]            # 0.5 + 0.3 reaches 0.8
    min_p = target_dist(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))
    assert min_p.ids.tolist() == [0, 1, 2]         # 0.05 < 0.2 * 0.5
    cold = target_dist(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    expected = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    np.testing.assert_allclose(cold.probs, expected / expected.sum(), rtol=1e-5)


def test_greedy_is_argmax_after_penalty():
    logits = np.array([2.0, 1.5, -1.0], dtype=np.float32)
    assert target_dist(logits, SamplingParams()).ids.tolist() == [0]
    penalised = SamplingParams(repeat_penalty=2.0)
    assert target_dist(logits, penalised, history=[0]).ids.tolist() == [1]


def test_penalty_example():
    out = apply_penalty(np.array([2.0, -1.0, 0.5], dtype=np.float32), [0, 1], 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5]


def test_draw_example_and_stream_is_keyed_by_position():
    d = Dist(np.array([3, 7], dtype=np.int32), np.array([0.25, 0.75]))
    assert draw(d, 0.1) == 3 and draw(d, 0.5) == 7
    s = PositionStream(42)
    assert s.u(5, 0) == PositionStream(42).u(5, 0)          # no hidden call-order state
    assert s.u(5, 0) != s.u(5, 1) != s.u(6, 0)
    us = np.array([s.u(t) for t in range(20000)])
    assert 0 <= us.min() and us.max() < 1 and abs(us.mean() - 0.5) < 0.01


def test_textstream_never_splits_utf8_and_hides_stop_strings():
    pieces = {1: "Hi ".encode(), 2: "é".encode()[:1], 3: "é".encode()[1:], 4: b"\n", 5: b"x"}
    ts = TextStream(pieces.__getitem__, stops=["\n\n"])
    assert ts.feed(1) == "Hi "
    assert ts.feed(2) == ""              # half a character is held back
    assert ts.feed(3) == "é"
    assert ts.feed(4) == ""              # could be the start of the stop string
    assert ts.feed(4) == "" and ts.stopped
    assert ts.text == "Hi é"


def test_textstream_holds_back_a_character_its_last_tokens_left_unfinished():
    """Issue 65: max_tokens cutting inside a character ended the text with U+FFFD."""
    party = "🎉".encode()
    ts = TextStream({1: party, 2: party[:2], 3: b"\xff"}.__getitem__)
    assert ts.feed(1) == "🎉" and ts.feed(2) == "" and ts.finish() == "" and ts.text == "🎉"
    ts = TextStream({1: party, 2: b"\xff"}.__getitem__)    # never UTF-8: U+FFFD as it comes
    assert ts.feed(1) + ts.feed(2) + ts.finish() == "🎉\ufffd"


def test_textstream_releases_a_false_stop_prefix():
    ts = TextStream({1: b"a\n", 2: b"b"}.__getitem__, stops=["\n\n"])
    assert ts.feed(1) == "a"
    assert ts.feed(2) == "\nb" and not ts.stopped
    assert ts.finish() == ""


def test_expected_tokens_formula():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == 4


def test_policy_drafts_when_acceptance_is_high_and_switches_off_when_low():
    cpu_curve = [1.0, 1.5, 1.8, 1.6, 2.4, 2.6, 2.5, 3.0, 3.0]   # shaped like docs/design.md's CPU data
    pol = DraftPolicy(cpu_curve, PolicyConfig(k_max=8))
    for _ in range(30):
        pol.observe("history", 4, 4)
    assert pol.choose_k("history") >= 3
    assert pol.choose_k("history", available=2) <= 2
    for _ in range(60):
        pol.observe("history", 3, 0)
    assert pol.choose_k("history") == 0                      # the off-switch
    assert pol.choose_k("document") > 0                      # sources are estimated apart


def test_ngram_proposer_keys_acceptance_by_match_length():
    """Short matches (prose) and long ones (copied code) are learned apart, so a run of failed
    one-token guesses does not switch off drafting for four-token matches."""
    from localspec.speculative.proposers import NgramProposer

    pol = DraftPolicy([1.0, 1.5, 1.8, 1.6, 2.4], PolicyConfig(k_max=4))
    for _ in range(60):
        pol.observe("history:1", 1, 0)
    prop = NgramProposer(ngram_min=1, ngram_max=4)
    try:
        prop.begin([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8])       # suffix 5 6 7 8 seen before: length 4
        [offer] = prop.offers(4)
        p = prop.draft(offer, pol.choose(offer))
        assert (pol.key_for(offer.features), p.source, p.tokens[:2]) == \
            ("history:4", "history", [9, 1])
        prop.begin([3, 4, 1, 2, 3])                          # only "3" repeats: length 1
        [offer] = prop.offers(4)
        assert (pol.key_for(offer.features), pol.choose(offer)) == ("history:1", 0)  # off
        assert list(offer.features.tokens[:1]) == [4]        # the guess a plain step scores
    finally:
        prop.close()


def test_draft_can_pay_only_where_the_cost_curve_leaves_room():
    cpu = [1.0, 1.58, 1.75, 1.75, 2.26, 2.70, 2.70, 2.85, 3.07]   # measured, 2-core Xeon
    assert not DraftPolicy(cpu, draft_cost=0.48).draft_can_pay()  # Qwen 0.5B for 1.5B there
    assert DraftPolicy([1.0] * 9, draft_cost=0.2).draft_can_pay()  # GPU-like: flat verify
    assert DraftPolicy(cpu, PolicyConfig(fixed_k=3), draft_cost=0.48).draft_can_pay()  # forced


def test_policy_fixed_k_and_gpu_like_curve():
    assert DraftPolicy([1.0] * 17, PolicyConfig(fixed_k=5)).choose_k("x") == 5
    flat = DraftPolicy([1.0] * 17, PolicyConfig(k_max=16))
    assert flat.choose_k("x") == 16                           # drafting is free: draft a lot


def test_stats_counts_positions_and_sources():
    st = GenerationStats()
    st.record_step("history", 3, 1)
    st.record_step("document", 2, 2)
    st.record_step("none", 0, 0)
    assert (st.steps, st.spec_steps, st.drafted, st.accepted) == (3, 2, 5, 3)
    assert st.drafted_by_pos == [2, 2, 1] and st.accepted_by_pos == [2, 1, 0]
    assert st.accepted_by_source == {"history": 1, "document": 2}


def test_one_policy_config_checks_the_draft_length():
    """PolicyConfig is the one place k_max and fixed_k live; K_LIMIT bounds both."""
    from localspec.policy.config import K_LIMIT

    assert PolicyConfig().k_max == K_LIMIT
    for bad in (dict(k_max=K_LIMIT + 1), dict(k_max=0), dict(fixed_k=K_LIMIT + 1),
                dict(k_max=4, fixed_k=5), dict(fixed_k=-1)):
        with pytest.raises(ValueError):
            PolicyConfig(**bad)


def test_the_draft_length_goes_one_way_offer_choose_draft():
    """The proposer offers what it found, the policy chooses k, the proposer drafts that many;
    a draft model's offer (no features) is chosen by its scalar estimate."""
    from localspec.policy.acceptance import Offer
    from localspec.speculative.proposers import NgramProposer

    pol = DraftPolicy([1.0] * 9, PolicyConfig(k_max=8, fixed_k=3))
    prop = NgramProposer(ngram_min=1, ngram_max=4)
    try:
        prop.begin([1, 2, 3, 4, 5, 6, 1, 2, 3])
        [offer] = prop.offers(8)
        assert (offer.source, offer.limit) == ("history", 6)
        assert list(offer.features.tokens) == [4, 5, 6, 1, 2, 3]
        k = pol.choose(offer)
        assert k == 3 and prop.draft(offer, k).tokens == [4, 5, 6]
        assert prop.offers(2)[0].limit == 2                  # the limit reaches the matcher
    finally:
        prop.close()
    assert pol.choose(Offer("draft", 2)) == 2                # fixed_k 3, but only 2 on offer
