"""localspec.replay: offline scoring of draft policies against recorded plain outputs, and the
future-knowing bound they are measured against."""

import doctest
from pathlib import Path

import pytest

from localspec import replay as rp
from localspec.adaptive import AdaptiveConfig, AdaptivePolicy
from localspec.costmodel import CostModel
from localspec.policy import DraftPolicy, PolicyConfig

RECORDING = Path(__file__).resolve().parent / "data" / "policy_plain.json"
XEON = rp.extend_curve([1, 1.55, 1.75, 1.75, 2.2], 16, {8: 3.0, 16: 3.9})
EPYC = rp.extend_curve([1, 1.48, 1.96, 2.22, 2.68], 16, {8: 5.9, 16: 8.4})


def policies(curve):
    return {"old": lambda: DraftPolicy(curve, PolicyConfig()),
            "new": lambda: AdaptivePolicy(CostModel(curve, rp.BASE_MS), AdaptiveConfig())}


def synthetic(prompt, out, margin=9.0):
    return rp.Recorded("synthetic", "code-edit", prompt, out, [margin] * len(out),
                       [0.99] * len(out))


def test_docstring_examples():
    assert doctest.testmod(rp).failed == 0


@pytest.mark.parametrize("name", ["old", "new"])
def test_copied_output_replays_faster_than_plain_and_never_beats_the_bound(name):
    source = [(37 * i + 11) % 500 + 3 for i in range(120)]        # no repeats inside
    case = synthetic([1, 2] + source, source[:100])               # the answer copies the source
    score = rp.replay_case(case, policies(XEON)[name], XEON, propose_cost=0.002)
    bound = rp.bound_case(case, XEON)
    assert 2.0 < score.speedup <= bound + 1e-9


@pytest.mark.parametrize("name", ["old", "new"])
def test_output_with_nothing_to_copy_stays_at_plain_speed(name):
    case = synthetic([1, 2, 3], [(37 * i + 11) % 500 + 10 for i in range(80)])
    assert rp.replay_case(case, policies(EPYC)[name], EPYC).speedup == pytest.approx(1.0)
    assert rp.bound_case(case, EPYC) == pytest.approx(1.0)


def test_near_ties_cut_steps_in_the_replay_and_the_bound_avoids_them():
    source = [(37 * i + 11) % 500 + 3 for i in range(60)]
    clean, tied = synthetic([1, 2] + source, source[:50]), synthetic([1, 2] + source, source[:50])
    tied.margin[10:40:3] = [0.1] * 10                             # every third row a near-tie
    make = policies(XEON)["new"]
    assert rp.replay_case(tied, make, XEON).speedup < rp.replay_case(clean, make, XEON).speedup
    assert rp.bound_case(tied, XEON) < rp.bound_case(clean, XEON)
    assert rp.replay_case(tied, make, XEON).speedup <= rp.bound_case(tied, XEON)


@pytest.mark.skipif(not RECORDING.exists(), reason="no committed recording")
@pytest.mark.parametrize("curve", [XEON, EPYC], ids=["xeon", "epyc"])
def test_recorded_cases_score_the_same_twice_and_never_above_their_bound(curve):
    cases = rp.load(str(RECORDING))
    picked = {c.kind: c for c in cases}.values()                  # one case of each kind
    for case in picked:
        bound = rp.bound_case(case, curve)
        for make in policies(curve).values():
            a = rp.replay_case(case, make, curve, propose_cost=0.002)
            b = rp.replay_case(case, make, curve, propose_cost=0.002)
            assert a == b
            assert a.speedup <= bound + 1e-9
