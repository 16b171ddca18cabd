"""The verifier against exact distributions on small vocabularies (deterministic: uniform grids
stand in for the random stream, so every probability is integrated, not sampled)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from localspec.speculative.sampling import Dist, PositionStream, draw, point_mass
from localspec.speculative.verify import residual, verify

V = 6  # vocabulary size of the enumerated tests


def dist(probs) -> Dist:
    probs = np.asarray(probs, dtype=np.float64)
    ids = np.flatnonzero(probs > 0).astype(np.int32)
    return Dist(ids, probs[ids] / probs[ids].sum())


def dense(d: Dist) -> np.ndarray:
    out = np.zeros(V)
    out[d.ids] = d.probs
    return out


class GridStream:
    """u(t, j) from fixed per-(t, j) values, so a test can sweep them over a grid."""

    def __init__(self, values: dict):
        self.values = values

    def u(self, t, j=0):
        return self.values.get((t, j), 0.5)


def grid(n):
    return (np.arange(n) + 0.5) / n  # midpoints: integrates a step function with error <= 1/n


def test_greedy_accepts_while_draft_equals_argmax():
    drafts = [5, 9, 4]
    argmaxes = [5, 9, 7, 2]
    v = verify(drafts, None, lambda i: point_mass(argmaxes[i]), PositionStream(0), out_pos=0)
    assert (v.n_accepted, v.token, v.bonus) == (2, 7, False)
    assert v.emitted(drafts) == [5, 9, 7]


def test_all_accepted_draws_bonus_from_the_next_position():
    v = verify([3, 1], None, lambda i: point_mass([3, 1, 8][i]), PositionStream(0), out_pos=0)
    assert (v.n_accepted, v.token, v.bonus) == (2, 8, True)


def test_residual_example():
    r = residual(dist([0, .5, .5, 0]), dist([0, .75, 0, .25]))
    assert r.ids.tolist() == [2] and r.probs.tolist() == [1.0]


def test_residual_of_equal_distributions_falls_back_to_target():
    p = dist([.2, .3, .5])
    r = residual(p, p)
    np.testing.assert_allclose(r.probs, p.probs)


def first_token_distribution(p_target: Dist, p_draft: Dist) -> np.ndarray:
    """P(first emitted token) with one draft x ~ p_draft. The accept test only asks whether
    u(0,0) < min(1, p_target(x)/p_draft(x)), so one value on each side integrates it exactly;
    the residual draw u(0,1) is an inverse CDF, integrated on a 1000-point grid."""
    out = np.zeros(V)
    for x, px in zip(p_draft.ids, p_draft.probs):
        a = min(1.0, p_target.prob(x) / px)
        out[x] += px * a
        for u1 in grid(1000):
            v = verify([int(x)], [p_draft], lambda i: p_target,
                       GridStream({(0, 0): a + (1 - a) / 2, (0, 1): u1}), 0)
            if 1 - a > 0:
                assert v.n_accepted == 0
                out[v.token] += px * (1 - a) / 1000
    return out


@pytest.mark.parametrize("seed", range(6))
def test_one_draft_with_p_draft_reproduces_p_target_exactly(seed):
    rng = np.random.default_rng(seed)
    p_target = dist(rng.dirichlet(np.ones(V) * 0.7))
    p_draft = dist(rng.dirichlet(np.ones(V) * 0.7))
    got = first_token_distribution(p_target, p_draft)
    np.testing.assert_allclose(got, dense(p_target), atol=3e-3)


@pytest.mark.parametrize("seed", range(6))
def test_point_mass_draft_reproduces_p_target_exactly(seed):
    rng = np.random.default_rng(100 + seed)
    p_target = dist(rng.dirichlet(np.ones(V)))
    for x in range(V):  # whatever the n-gram proposes, the emitted token follows p_target
        got = np.zeros(V)
        for u in grid(1000):
            v = verify([x], None, lambda i: p_target, GridStream({(0, 0): u}), 0)
            got[v.emitted([x])[0]] += 1 / 1000
        np.testing.assert_allclose(got, dense(p_target), atol=2e-3)


def test_point_mass_draft_emits_exactly_what_plain_sampling_draws():
    """Seeded equivalence at the level of one position: same u, same token, draft or not."""
    rng = np.random.default_rng(3)
    p_target = dist(rng.dirichlet(np.ones(V)))
    for u in grid(500):
        plain = draw(p_target, u)
        for x in range(V):
            v = verify([x], None, lambda i: p_target, GridStream({(0, 0): u}), 0)
            assert v.emitted([x])[0] == plain


def test_two_drafts_joint_distribution_matches_target_chain():
    """k=2 with context-dependent p_target and p_draft tables: the joint law of the first two
    emitted tokens is the target's. Drafts are enumerated exactly; each uniform number the verifier
    actually consults is integrated (conditionally, as the verifier reaches it)."""
    rng = np.random.default_rng(11)
    pt1, pd1 = dist(rng.dirichlet(np.ones(V))), dist(rng.dirichlet(np.ones(V)))
    pt2 = {a: dist(rng.dirichlet(np.ones(V))) for a in range(V)}   # p_target(. | first)
    pd2 = {a: dist(rng.dirichlet(np.ones(V))) for a in range(V)}
    joint = np.zeros((V, V))

    def branches(key, x0, x1):
        """Values of u(key) that lead to distinct outcomes, with their probabilities. An accept
        test only asks whether u < min(1, p_target/p_draft): two representative values integrate
        it exactly. A residual draw is an inverse CDF: a 400-point grid integrates it."""
        t, j = key
        if j == 1:
            return [(u, 1 / 400) for u in grid(400)]
        pt, pd, x = (pt1, pd1, x0) if t == 0 else (pt2[x0], pd2[x0], x1)
        a = min(1.0, pt.prob(x) / pd.prob(x))
        return [(u, w) for u, w in ((a / 2, a), (a + (1 - a) / 2, 1 - a)) if w > 0]

    def sweep(x0, x1, fixed, weight):
        target_at = lambda i: [pt1, pt2[x0], pt2[x1]][i]
        v = verify([x0, x1], [pd1, pd2[x0]], target_at, GridStream(fixed), 0)
        needed = [(0, 0)] + ([(0, 1)] if v.n_accepted == 0 else [(1, 0)])
        if v.n_accepted == 1:
            needed.append((1, 1))
        free = next((key for key in needed if key not in fixed), None)
        if free is not None:  # the verifier consulted a number we have not swept yet
            for u, w in branches(free, x0, x1):
                sweep(x0, x1, {**fixed, free: u}, weight * w)
            return
        emitted = v.emitted([x0, x1])
        if len(emitted) >= 2:
            joint[emitted[0], emitted[1]] += weight
        else:  # rejected at position 0: the next step draws position 1 from p_target(. | y0)
            joint[emitted[0]] += weight * dense(pt2[emitted[0]])

    for x0, x1 in itertools.product(range(V), range(V)):
        sweep(x0, x1, {}, pd1.prob(x0) * pd2[x0].prob(x1))
    expected = dense(pt1)[:, None] * np.stack([dense(pt2[a]) for a in range(V)])
    np.testing.assert_allclose(joint, expected, atol=4e-3)
    assert abs(joint.sum() - 1) < 1e-9
