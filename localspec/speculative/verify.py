"""Rejection-sampling verification of drafted tokens (lossless speculative decoding).

Vocabulary used everywhere in localspec:
- *accepted* tokens: the leading drafted tokens the verifier keeps;
- the *recovered* token: drawn from the residual distribution at the first rejection;
- the *bonus* token: drawn from p_target after every draft was accepted.
Every step emits its accepted tokens plus exactly one recovered or bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from .sampling import Dist, PositionStream, draw


@dataclass(frozen=True)
class Verdict:
    n_accepted: int          # drafts kept, 0..k
    token: int               # the recovered token (n_accepted < k) or the bonus token
    bonus: bool              # True when every draft was accepted

    def emitted(self, drafts: Sequence[int]) -> list[int]:
        return [*drafts[: self.n_accepted], self.token]


def residual(p_target: Dist, p_draft: Dist) -> Dist:
    """norm(max(0, p_target - p_draft)) over the union of both supports.

    Example: p_target {1: .5, 2: .5}, p_draft {1: .75, 3: .25} -> {2: 1.0}.
    """
    ids = np.union1d(p_target.ids, p_draft.ids).astype(np.int32)
    pt = np.zeros(len(ids))
    pd = np.zeros(len(ids))
    pt[np.searchsorted(ids, p_target.ids)] = p_target.probs
    pd[np.searchsorted(ids, p_draft.ids)] = p_draft.probs
    r = np.maximum(pt - pd, 0.0)
    total = r.sum()
    if total <= 1e-12:  # p_target == p_draft up to rounding: rejection had probability ~0
        return p_target
    keep = r > 0
    return Dist(ids[keep], r[keep] / total)


def verify(drafts: Sequence[int], p_draft: Optional[Sequence[Dist]],
           target_at: Callable[[int], Dist], stream: PositionStream, out_pos: int) -> Verdict:
    """Verify k drafted tokens against the target; `out_pos` is the output position of drafts[0].

    target_at(i) -> p_target at draft position i (0..k); called lazily, in order, so penalties
    can see drafts[:i]. p_draft None means point-mass drafts (n-gram lookup, greedy drafting).

    Rule, for draft x at position i (u, u' uniform from the stream at output position
    out_pos + i):
        accept  if  u < min(1, p_target(x) / p_draft(x))
        else    emit recovered ~ norm(max(0, p_target - p_draft)) using u', and stop.
    With a point mass p_draft(x) = 1 this is "draw y ~ p_target with u; accept iff y == x,
    else emit y", which is exactly what plain sampling draws at that position: same seed, same
    text, speculation on or off. Greedy (point-mass p_target) accepts while x == argmax.
    Example (greedy): drafts [5, 9, 4], target argmaxes [5, 9, 7, 2] -> n_accepted 2, token 7.
    """
    for i, x in enumerate(drafts):
        pt = target_at(i)
        u = stream.u(out_pos + i, 0)
        if p_draft is None:
            y = draw(pt, u)
            if y != x:
                return Verdict(i, y, False)
            continue
        pd = p_draft[i]
        ratio = pt.prob(x) / max(pd.prob(x), 1e-30)
        if u >= min(1.0, ratio):
            return Verdict(i, draw(residual(pt, pd), stream.u(out_pos + i, 1)), False)
    k = len(drafts)
    return Verdict(k, draw(target_at(k), stream.u(out_pos + k, 0)), True)
