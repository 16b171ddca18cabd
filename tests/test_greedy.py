"""localspec/speculative/greedy.py: one-pass greedy verification gives exactly what the per-row
path gives (verify() over target_dist() rows, then the step's near-tie guard over top2_gap()),
and step.step's one pass (the default for greedy point-mass drafts) is its per-row path
(one_pass=False): same result and KV rows on a scripted context, same output and counters
through the engine on a real model."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from test_speculative import REPEATING
from test_step import ScriptedContext

import localspec.speculative.engine
from localspec.speculative.engine import Engine, EngineConfig
from localspec.policy.config import PolicyConfig
from localspec.speculative.greedy import greedy_verify, penalize_row
from localspec.speculative.proposers import Proposal
from localspec.speculative.sampling import (PositionStream, SamplingParams, apply_penalty, target_dist,
                                     top2_gap)
from localspec.speculative.step import step
from localspec.speculative.verify import verify


def reference(rows, drafts, sampling, recent, margin):
    """The engine's per-row path: (n_accepted, token, first near-tie row or None)."""
    verdict = verify(drafts, None, lambda i: target_dist(rows[i], sampling, recent + drafts[:i]),
                     PositionStream(7), out_pos=0)
    tie = None
    if drafts and margin > 0:
        tie = next((i for i in range(verdict.n_accepted + 1)
                    if top2_gap(rows[i], sampling, recent + drafts[:i]) < margin), None)
    return verdict.n_accepted, verdict.token, tie


def scenario(rng, n_vocab, k, penalty, last_n):
    """Random logits with planted structure: drafts that follow the penalised argmax for a
    random stretch, near-ties, exact ties, and draft tokens inside the penalty window."""
    rows = rng.standard_normal((k + 1, n_vocab)).astype(np.float32) * rng.choice([0.3, 1, 4])
    recent = [int(t) for t in rng.integers(0, n_vocab, rng.integers(0, 80))]
    sampling = SamplingParams(temperature=0.0, repeat_penalty=penalty, repeat_last_n=last_n)
    drafts, agree = [], rng.integers(0, k + 1)
    for i in range(k):
        if rng.random() < 0.3:               # a near-tie (or an exact tie) at this row
            j = np.argsort(rows[i])[-2:]
            rows[i, j[0]] = rows[i, j[1]] - rng.choice([0.0, 0.01, 0.2, 0.3])
        if rng.random() < 0.2 and recent:    # the best token was used recently: penalised
            rows[i, recent[-1]] = rows[i].max() + 0.1
        window = recent + drafts
        best = int(np.argmax(apply_penalty(rows[i], window[-last_n:] if last_n > 0 else window,
                                           penalty)))
        drafts.append(best if i < agree else int(rng.integers(0, n_vocab)))
    return rows, drafts, sampling, recent


@pytest.mark.parametrize("penalty,last_n", [(1.0, 64), (1.1, 64), (1.3, 8), (0.8, 16),
                                            (1.2, 0), (1.5, -1)])
def test_greedy_verify_matches_the_per_row_path(penalty, last_n):
    rng = np.random.default_rng(int(penalty * 100) + last_n)
    for case in range(300):
        k = int(rng.integers(0, 17))
        rows, drafts, sampling, recent = scenario(rng, int(rng.choice([50, 300, 4000])), k,
                                                  penalty, last_n)
        margin = float(rng.choice([0.0, 0.25, 0.5]))
        want = reference(rows, drafts, sampling, recent, margin)
        got = greedy_verify(rows.copy(), drafts, sampling, recent, margin)
        assert (got.n_accepted, got.token, got.tie) == want, (case, k, margin)


def test_emitted_and_kept_follow_the_engine_rule():
    rows = np.zeros((4, 10), np.float32)
    for i, best in enumerate([5, 9, 7, 2]):
        rows[i, best] = 3.0
    v = greedy_verify(rows, [5, 9, 4], SamplingParams(), [], margin=0.25)
    assert (v.n_accepted, v.token, v.tie) == (2, 7, None)
    assert v.emitted([5, 9, 4]) == [5, 9, 7] and v.kept == 2
    rows[1, 3] = 2.9                          # row 1 is now a near-tie: emit only row 0's choice
    v = greedy_verify(rows, [5, 9, 4], SamplingParams(), [], margin=0.25)
    assert (v.n_accepted, v.tie, v.emitted([5, 9, 4]), v.kept) == (2, 1, [5], 0)
    v = greedy_verify(rows, [], SamplingParams(), [], margin=0.25)   # plain step: no guard
    assert (v.n_accepted, v.token, v.tie, v.emitted([])) == (0, 5, None, [5])


def test_rows_past_the_first_rejection_are_not_touched():
    rows = np.random.default_rng(0).standard_normal((5, 100)).astype(np.float32)
    before = rows.copy()
    drafts = [int(np.argmax(rows[0])), (int(np.argmax(rows[1])) + 1) % 100, 1, 2]
    v = greedy_verify(rows, drafts, SamplingParams(repeat_penalty=1.3), list(range(100)), 0.0)
    assert v.n_accepted == 1
    assert np.array_equal(rows[2:], before[2:])          # never read, so never penalised


def test_penalize_row_in_place_equals_apply_penalty():
    row = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    want = apply_penalty(row, [0, 1, 1], 2.0)
    penalize_row(row, [0, 1, 1], 2.0)
    assert np.array_equal(row, want) and list(row) == [1.0, -2.0, 0.5, 3.0]


PER_ROW = functools.partial(step, one_pass=False)


def same_step(ctx_args, history, drafts, sampling=SamplingParams(), tie_margin=0.0):
    """Run the step's per-row path and its one pass from the same state on two scripted
    contexts; compare."""
    results = []
    for fn in (PER_ROW, step):
        ctx = ScriptedContext(**ctx_args)
        ctx.tokens = list(history[:-1])
        r = fn(ctx, Proposal(list(drafts), None, "history"), sampling, history,
               PositionStream(7), 0, tie_margin)
        results.append((dataclasses.replace(r, verify_ms=0.0, sample_ms=0.0), ctx.tokens,
                        ctx.decoded))
    assert results[0] == results[1]
    return results[1][0]


@pytest.mark.parametrize("ctx_args,drafts,margin", [
    ({}, [4, 5, 6], 0.25),                               # all accepted: bonus token
    ({}, [4, 9, 6], 0.25),                               # rejection at row 1
    ({}, [], 0.25),                                      # plain step: no guard
    ({"ties_after": {3}}, [4, 5], 0.25),                 # tie at row 0: nothing emitted
    ({"ties_after": {5}}, [4, 5, 6, 7], 0.25),           # tie inside the accepted run
    ({"ties_after": {3, 5}}, [4, 5, 6], 0.0),            # guard off
    ({"refuse_rollback": True}, [4, 9, 9], 0.25),        # rollback refused, reported
])
def test_one_pass_is_the_per_row_step_on_a_scripted_context(ctx_args, drafts, margin):
    same_step(ctx_args, [1, 2, 3], drafts, tie_margin=margin)


def test_one_pass_penalises_each_row_like_the_per_row_step():
    penalised = SamplingParams(repeat_penalty=100.0, repeat_last_n=64)
    r = same_step({"target": lambda seen: 4}, [1, 2, 3], [4, 4], penalised)
    assert r.emitted == [4, 5]                           # row 1 sees the draft 4


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_engine_with_one_pass_matches_engine_with_the_per_row_step(tiny_model, monkeypatch,
                                                                   penalty):
    """The real tiny model, n-gram drafts of up to 4 on repeating prompts, near-tie guard on:
    swapping the step changes neither the output nor what was drafted, accepted, re-decided."""
    sampling = SamplingParams(repeat_penalty=penalty)
    config = EngineConfig(n_ctx=512, n_threads=1, cache_mb=0, policy=PolicyConfig(fixed_k=4))
    runs = {}
    for name, fn in (("per_row", PER_ROW), ("one_pass", step)):
        monkeypatch.setattr(localspec.speculative.engine, "step", fn)
        with Engine(tiny_model, config) as eng:
            runs[name] = []
            for prompt in REPEATING:
                gen = eng.generate(prompt, sampling, max_tokens=40)
                st = gen.stats
                runs[name].append((gen.complete_tokens(), st.steps, st.drafted, st.accepted,
                                   st.rechecks))
    assert runs["per_row"] == runs["one_pass"]
    assert sum(r[2] for r in runs["per_row"]) > 0           # drafts were verified, not only plain
