"""Probes: now and then a draft of another length than the policy chose, so that a cost curve
that overstates some batches is found out. The cost model learns only the sizes it is shown; a
curve that says r(3) = 6.3 where a 4-row batch costs 1.5 would otherwise keep every draft at one
token, and one that overstates r(7) keeps a copy at 43-52 drafts where 7 would pay more.

A probe drafts the size of LADDER (2, 4, 8, ..., 64 rows, the sizes CPU kernels handle best)
nearest the chosen k, in place of k, when all of these hold:
  - the steps have timed some size at least 10% off the cached curve (SUSPECT): the curve is
    wrong somewhere; and the cost model has (almost) no recent timing of the probe's size
    (`probe_timed`): there it is a guess, from the calibration or its rescaling;
  - the request's current run of right guesses is at least as long as the probe (and at least
    MIN_STREAK), and the proposal reaches that far: the text is being copied, so what is tested
    is the cost of the batch, not the acceptance model (which the loss budget guards);
  - the credit covers the probe's worst case. Every timed step earns `probe_share` of its cost
    in plain steps. A longer probe needs credit for r(k) (p + 1) / (k + 1) - r(k) (a batch of
    more rows costs at most in proportion), a shorter one for what the curve says it loses;
    once timed, a probe is charged what it cost beyond what the chosen draft would have paid
    for the tokens it emitted (a probe that pays earns credit back).
So probing loses at most `probe_share` of the decode time plus its starting credit, and on a
curve that the steps confirm it never happens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .costmodel import CostModel

CREDIT_START = 2.0   # plain steps of credit a new engine starts with: a first probe or two
CREDIT_MAX = 16.0    # credit kept at most: a long quiet stretch does not buy a burst
SUSPECT = math.log(1.1)   # probes only once the timings are 10% off the cached curve
                     # (CostModel.disagreement): a curve the steps confirm where they are is
                     # trusted where they are not
LADDER = (1, 3, 7, 15, 31, 63)   # the sizes probed (slices.FIRST_KS: what a first slice times)
MIN_STREAK = 8       # right guesses in a row before any probe: a chat's one-token echoes
                     # (the policy stays off there) are not a copy


@dataclass
class Probe:
    k: int               # drafts verified
    chosen: int          # what the policy would have drafted
    unit: float          # plain steps per emitted token the chosen draft promised (1 / gain)


class Exploration:
    """The probe budget of one engine (shared by its requests, like the cost model).

    >>> from localspec.policy.costmodel import CostModel
    >>> cm = CostModel([1.0, 1.06, 2.59, 6.26, 8.0, 9.0, 10.0, 11.0], 60.0)
    >>> ex = Exploration(share=0.02)
    >>> ex.widen(1, 1.88, offered=7, streak=40, cost=cm)      # nothing timed yet: trusted
    1
    >>> for _ in range(24):
    ...     cm.observe(0, 60.0); cm.observe(1, 1.23 * 60.0)   # r(1) is 1.23, not 1.06
    >>> ex.widen(1, 1.88, offered=7, streak=40, cost=cm)      # k = 1 chosen; probe 3
    3
    >>> ex.charge(ex.pending, n_emitted=4, ms=1.49 * 60.0, plain_ms=60.0); round(ex.credit, 2)
    2.64
    """

    def __init__(self, share: float = 0.02, timed: float = 0.5):
        self.share, self.timed = share, timed
        self.credit = CREDIT_START
        self.pending: Optional[Probe] = None
        self.n_probes = 0

    def widen(self, k: int, gain: float, offered: int, streak: int, cost: CostModel) -> int:
        """The k to draft: `k` (the policy's choice, whose predicted gain is `gain`), or a probe
        when the module docstring's conditions hold."""
        limit = min(offered, streak, cost.k_max)
        if self.share <= 0 or not cost.config.online or streak < MIN_STREAK or limit < 1 or \
                cost.disagreement < SUSPECT:
            return k
        r = cost.ratio_list()
        unit = r[k] / max(1.0, gain * r[k]) if k else 1.0   # plain steps a token, as chosen
        best = None
        for p in LADDER:
            if p == k or p > limit or cost.timings(p) >= self.timed:
                continue
            worst = r[k] * (p + 1) / (k + 1) - r[k] if p > k else max(0.0, r[p] - (p + 1) * unit)
            if worst <= self.credit and (best is None or abs(p - k) < abs(best - k)):
                best = p
        if best is None:
            return k
        self.pending = Probe(best, k, unit)
        self.n_probes += 1
        return best

    def earn(self, plain_steps: float) -> None:
        """A timed step that cost `plain_steps` plain steps."""
        self.credit = min(CREDIT_MAX, self.credit + self.share * plain_steps)

    def charge(self, probe: Probe, n_emitted: int, ms: float, plain_ms: float) -> None:
        """A probe was timed: it cost ms; the chosen draft would have paid probe.unit plain
        steps per token it emitted."""
        self.pending = None
        if plain_ms > 0:
            lost = ms / plain_ms - n_emitted * probe.unit
            self.credit = min(CREDIT_MAX, self.credit - lost)
