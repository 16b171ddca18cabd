"""Greedy verification of a verify batch in one pass over its rows (a prototype for the step).

Same answer as step.step (`verify()` over `target_dist()` rows, then `near_tie()` over `top2_gap()`
rows) for greedy sampling and point-mass drafts, without what a GPU step cannot afford: a Dist, a
draw and two random numbers per row, a second argmax and a penalised copy of each row for the
guard, and rows past the first rejection. Not wired into the engine: scripts/bench/step_overhead.py
swaps greedy_step in for step to measure what it saves (docs/gpu-offline-recipe.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from localspec.speculative.sampling import PositionStream, SamplingParams
from localspec.speculative.step import StepResult, step


@dataclass(frozen=True)
class GreedyVerdict:
    n_accepted: int          # drafts whose row's argmax equals them, 0..k (as verify() counts)
    token: int               # argmax of row n_accepted: the recovered or bonus token
    tie: Optional[int]       # first row 0..n_accepted closer than the margin, or None

    def emitted(self, drafts: Sequence[int]) -> list:
        """What the step emits: up to a near-tie only what the rows before it decided."""
        if self.tie is not None:
            return list(drafts[:self.tie])
        return [*drafts[:self.n_accepted], self.token]

    @property
    def kept(self) -> int:
        """Drafts whose KV rows stay (the tie row's token is re-decided by a one-token decode)."""
        return self.tie - 1 if self.tie is not None else self.n_accepted


def penalize_row(row: np.ndarray, window: Sequence[int], penalty: float) -> None:
    """llama.cpp's repetition penalty on `row` in place: the same float32 arithmetic as
    sampling.apply_penalty, without copying the row.
    Example: [2, -1, .5], [0, 1], 2 -> [1, -2, .5]."""
    if penalty == 1.0 or len(window) == 0:
        return
    seen = np.unique(np.asarray(window, dtype=np.int64))
    vals = row[seen]
    row[seen] = np.where(vals > 0, vals / penalty, vals * penalty)


def greedy_verify(rows: np.ndarray, drafts: Sequence[int], sampling: SamplingParams,
                  recent: Sequence[int], margin: float) -> GreedyVerdict:
    """Verify point-mass `drafts` against greedy rows [k + 1, n_vocab] float32.

    Row i is the target's next-token logits after drafts[:i]; its penalty window is the last
    repeat_last_n of recent + drafts[:i] (recent: the request's window before the step). Rows
    are penalised IN PLACE (they are the decode's output buffer, read once), so pass a copy to
    keep them. margin > 0 turns on the near-tie guard on rows 0..n_accepted.
    Example: drafts [5, 9, 4], row argmaxes [5, 9, 7, 2] -> n_accepted 2, token 7, tie None.
    """
    k, penalty = len(drafts), sampling.repeat_penalty
    history = list(recent) if penalty != 1.0 else []
    tie = None
    for i in range(k + 1):
        row = rows[i]
        if penalty != 1.0:      # the window target_dist() would use for this row
            penalize_row(row, sampling.penalty_window(history + list(drafts[:i])), penalty)
        best = int(row.argmax())
        if k and margin > 0 and tie is None:
            # Margin between the best and the second best: the argmax plus one pass.
            second = max(row[:best].max(initial=-np.inf), row[best + 1:].max(initial=-np.inf))
            if float(row[best] - second) < margin:
                tie = i              # keep verifying: n_accepted feeds the policy and stats
        if i == k or best != drafts[i]:
            return GreedyVerdict(i, best, tie)
    raise AssertionError("unreachable: row k always returns")


def greedy_step(ctx, proposal, sampling: SamplingParams, history: Sequence[int],
                stream: PositionStream, out_pos: int, tie_margin: float = 0.0,
                survival: Sequence[float] = ()) -> StepResult:
    """step.step's contract and result, verified by greedy_verify. Sampled decoding and drafts
    with probabilities (a draft model sampling) go to step.step unchanged."""
    if not sampling.greedy or proposal.p_draft is not None:
        return step(ctx, proposal, sampling, history, stream, out_pos, tie_margin, survival)
    clock = time.perf_counter
    drafts, n_past = list(proposal.tokens), ctx.n_past
    t1 = clock()
    rows = ctx.verify_rows([history[-1], *drafts], survival)   # [k + 1, n_vocab] float32
    t2 = clock()
    drafts = drafts[:len(rows) - 1]       # a shared tick may have kept fewer rows
    verdict = greedy_verify(rows, drafts, sampling, sampling.penalty_window(history), tie_margin)
    rolled_back = ctx.truncate(n_past + 1 + verdict.kept)
    return StepResult(verdict.emitted(drafts), len(drafts), verdict.n_accepted,
                      verdict.tie is not None, rolled_back, 1000 * (t2 - t1), 1000 * (clock() - t2))
