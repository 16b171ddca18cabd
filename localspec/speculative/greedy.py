"""Greedy verification in one pass over a verify batch's rows: what verify() over target_dist()
rows and the step's near-tie guard over top2_gap() rows decide for greedy sampling and
point-mass drafts (n-gram lookup, a greedy draft model), without a Dist, a draw, a penalised
copy of each row or a second argmax per row. On a GPU, where a step takes a few milliseconds,
that per-row Python was 0.2-0.3 ms of a k = 8 step (docs/gpu.md); tests/test_greedy.py holds it
to the per-row path's answer on random batches with ties, near-ties and penalties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .sampling import SamplingParams


@dataclass(frozen=True)
class RowsVerdict:
    """What a verify batch's rows decided, by either path (the step's one pass or verify() with
    the near-tie guard), and the one rule for what the step emits and keeps from it."""

    n_accepted: int          # drafts the verifier kept, 0..k (as verify() counts)
    token: int               # the recovered or bonus token of row n_accepted
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


def argmax_verify(targets: Sequence[int], drafts: Sequence[int]) -> RowsVerdict:
    """Verify point-mass `drafts` against each row's greedy token, as the device computed them
    (Context.device_argmax): what greedy_verify decides with no penalty and no margin.
    Example: drafts [5, 9, 4], targets [5, 9, 7, 2] -> n_accepted 2, token 7."""
    n = 0
    while n < len(drafts) and targets[n] == drafts[n]:
        n += 1
    return RowsVerdict(n, int(targets[n]), None)


def greedy_verify(rows: np.ndarray, drafts: Sequence[int], sampling: SamplingParams,
                  recent: Sequence[int], margin: float) -> RowsVerdict:
    """Verify point-mass `drafts` against greedy rows [k + 1, n_vocab] float32.

    Row i is the target's next-token logits after drafts[:i]; its penalty window is the last
    repeat_last_n of recent + drafts[:i] (recent: the request's window before the step). Rows
    are penalised IN PLACE (they are the decode's output buffer, read once), so pass a copy to
    keep them. margin > 0 turns on the near-tie guard on rows 0..n_accepted.
    Example: drafts [5, 9, 4], row argmaxes [5, 9, 7, 2] -> n_accepted 2, token 7, tie None.
    """
    k, penalty = len(drafts), sampling.repeat_penalty
    history = list(recent)             # empty when the penalty is off
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
            return RowsVerdict(i, best, tie)
    raise AssertionError("unreachable: row k always returns")
