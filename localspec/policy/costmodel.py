"""What a verify batch costs: the cached calibration r(k) as a prior, refined online from the
timed steps of this process, and a stability check of the calibration rounds themselves.

Model (log space): a step of k drafts takes ms = exp(b + s_k) where b is this moment's one-token
decode time and s_k = log r(k) (s_0 = 0). Each observation is decayed, so b follows a drifting
machine; s_k is pulled towards the prior log r(k) with the weight of `prior_weight` observations,
so a few odd steps cannot rewrite the curve while a steady disagreement wins within tens of steps.
With recent plain steps (k = 0) b is measured directly; with only k = 3 steps, say, b and s_3
cannot be told apart and s_3 stays at its prior (the solution below says so exactly).

Reproducibility (decided, see README "Exactness"): online timing may change k, never the rule
that picks tokens. Greedy output depends on k only where a verify row's top-2 margin is a
near-tie (the tie guard re-decides those alone) and not at all on batch-invariant kernels (the
default CPU libraries, docs/exactness.md); sampled output is keyed by position. Who needs the
same k sequence run after run sets `online=False`: then r(k) is the cached curve and nothing
measured during the request changes a decision.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .slices import NOISE


@dataclass(frozen=True)
class CostConfig:
    online: bool = True           # learn from step timings (False: the cached curve, always)
    prior_weight: float = 4.0     # observations the cached curve is worth, per k
    noisy_prior_weight: float = 1.0   # ... when its calibration rounds disagreed
    decay: float = 0.99           # per observation: a half-life of ~69 steps
    clip: float = math.log(3.0)   # log residual cap, dearer: one descheduled step is no trend
    clip_fast: float = math.log(8.0)  # ... cheaper: noise only adds time, so a step faster than
                                  # believed is news (a curve timed on a stalling host)
    cheaper_tol: float = math.log(1.25)  # a size timed cheaper than its prior by more than this
                                  # stops believing the prior: its weight falls with the square
                                  # of the gap (a curve that overstates k is corrected at once)
    solve_every: int = 16         # observations between re-fits (each is ~40 numpy calls)
    slope_weight: float = 1.0     # observations the prior's overall steepness is worth


class CostModel:
    """r(k) for k = 0..k_max, the prior curve refined by `observe(k, ms)`.

    >>> cm = CostModel([1.0, 1.5, 2.0, 2.5], ms_per_step=50.0)
    >>> for _ in range(40):
    ...     cm.observe(0, 50.0); cm.observe(3, 250.0)      # k = 3 costs 5 steps, not 2.5
    >>> round(cm.ratio(3), 1), round(cm.slope, 2), round(cm.ratio(1), 2), round(cm.ms(0))
    (5.0, 2.64, 2.32, 50)

    The curve is steeper than cached at k = 3, so k = 1 (never timed) is assumed steeper too.
    """

    def __init__(self, prior: Sequence[float], ms_per_step: Optional[float] = None,
                 config: CostConfig = CostConfig(), noisy: bool = False):
        self.config = config
        self.prior = np.maximum(1.0, np.asarray(prior, dtype=np.float64))  # [k_max + 1]
        self.prior[0] = 1.0
        # no batch of k + 1 rows costs more than k + 1 one-token decodes (plus noise): a cached
        # curve saying so was timed through a stall (slices.plausible)
        self.prior = np.minimum(self.prior, (1.0 + NOISE) * np.arange(1, len(self.prior) + 1))
        self._p0 = np.log(self.prior)                # the cached curve's s_k
        self._p = self._p0.copy()                    # prior s_k, rescaled by the learned slope
        self._slope = 1.0                            # r(k) - 1 = slope x (cached r(k) - 1)
        self._lam = config.noisy_prior_weight if noisy else config.prior_weight
        # b's own prior: the calibration's one-token time, worth one observation; a fresh
        # machine state replaces it within a few steps.
        self._b0 = math.log(ms_per_step) if ms_per_step else None
        self._w = np.zeros(len(self.prior))          # decayed observation weight per k
        self._sy = np.zeros(len(self.prior))         # decayed sum of log ms per k
        self._s = self._p.tolist()                   # current s_k, floats: read every observe()
        self._k_max = len(self.prior) - 1
        self._b = self._b0
        self._r = self.prior.tolist()                # current r(k), floats: read every step
        self._pending: list = []                     # (k, log ms) observed since the last solve
        self._dirty = False
        self._solved_at = 0
        self._disagree = 0.0
        self.n_observed = 0

    @property
    def k_max(self) -> int:
        return self._k_max

    @property
    def slope(self) -> float:
        """How much steeper than the cached curve the timings say this machine is now."""
        self._refresh()
        return self._slope

    @property
    def disagreement(self) -> float:
        """How far the timings say the cached curve is off: |log(timed r(k) / cached r(k))|,
        its median over the timed k > 0 weighted by their timings (0 before a refit and
        before SUSPECT_TIMINGS timings; one size timed once through a stall decides nothing).
        A curve the steps confirm is not worth probing (explore.py)."""
        self._refresh()
        return self._disagree

    def ratio(self, k: int) -> float:
        """Current estimate of r(k), >= 1 (a batch is never cheaper than one token)."""
        return self.ratio_list()[k]

    def ratios(self) -> list:
        return list(self.ratio_list())

    def ratio_list(self) -> list:
        """[k_max + 1] current r(0..k_max), without a copy (for per-step loops); do not modify."""
        self._refresh()
        return self._r

    def ms(self, k: int) -> Optional[float]:
        """Estimated milliseconds of a step of k drafts now (None before any timing)."""
        self._refresh()
        return None if self._b is None else math.exp(self._b) * self._r[k]

    def observe(self, k: int, ms: float, now: bool = False) -> None:
        """One timed verify batch of k drafts (k + 1 rows); `now`: refit at once (a probe of a
        size the curve only guessed, whose answer the next choice should see)."""
        c = self.config
        if not c.online or ms <= 0 or not 0 <= k <= self._k_max:
            return
        y = math.log(ms)
        if self._b is not None:   # clip against the prediction as of the last solve
            pred = self._b + self._s[k]
            y = pred + max(-c.clip_fast, min(c.clip, y - pred))
        self._pending.append((k, y))    # decayed into _w, _sy at the next solve
        self.n_observed += 1
        self._dirty = True
        if now:
            self._solve()

    def timings(self, k: int) -> float:
        """The decayed weight of the timings of k drafts (1 per timing, 0.99 per later one)."""
        if self._pending:
            self._fold_pending()
        return float(self._w[k]) if 0 <= k <= self._k_max else 0.0

    def _refresh(self) -> None:
        if self._dirty and (self._b is None or
                            self.n_observed - self._solved_at >= self.config.solve_every):
            self._solve()

    def _solve(self) -> None:
        """Least squares over the decayed observations plus the priors:
            min  sum_k W_k (m_k - b - s_k)^2 + lam * sum_{k>0} (s_k - p_k)^2 + 1 * (b - b0)^2
        with s_0 = 0 and m_k the mean log time of k. For a fixed b, s_k = (W_k (m_k - b) +
        lam p_k) / (W_k + lam); putting that back leaves a weighted mean for b in which k > 0
        counts with v_k = W_k lam^2 / (W_k + lam)^2 (large W_k: s_k explains it, not b)."""
        self._dirty, self._solved_at = False, self.n_observed
        self._fold_pending()
        w = self._w
        seen = w > 0
        m = np.divide(self._sy, w, out=np.zeros_like(w), where=seen)
        lam = np.full(len(w), self._lam)
        for _ in range(2):       # the slope moves the priors, which move b: one more round
            b = self._solve_b(m, w, seen, lam)
            if b is None:
                return
            self._fit_slope(m - b, w, seen)
            lam = self._prior_weights(m - b, seen)
        b = self._solve_b(m, w, seen, lam)
        s = (w * (m - b) + lam * self._p) / (w + lam)
        s[0] = 0.0
        self._disagree = 0.0 if np.sum(w[1:]) < SUSPECT_TIMINGS else \
            _weighted_median(np.abs(m - b - self._p0)[1:], w[1:])
        self._b, self._s = float(b), s.tolist()
        self._r = np.maximum(1.0, np.exp(s)).tolist()

    def _fold_pending(self) -> None:
        """Each observation decays the earlier ones by `decay`: the pending ones in one go (the
        j-th of m carries decay^(m-1-j)), not two array updates per step."""
        d, m = self.config.decay, len(self._pending)
        self._w *= d ** m
        self._sy *= d ** m
        for j, (k, y) in enumerate(self._pending):
            f = d ** (m - 1 - j)
            self._w[k] += f
            self._sy[k] += f * y
        self._pending.clear()

    def _prior_weights(self, obs, seen):
        """[k_max + 1] the prior's weight per k: `lam`, but where k's timings say cheaper than
        the (rescaled) prior by more than cheaper_tol, lam x (tol / gap)^2. A batch cannot be
        timed faster than it is, so such a gap is the prior's error, not noise; dearer timings
        leave the weight alone (one stall must not rewrite a size)."""
        tol = self.config.cheaper_tol
        gap = np.where(seen, self._p - obs, 0.0)
        return self._lam * np.where(gap > tol, (tol / np.maximum(gap, tol)) ** 2, 1.0)

    def _solve_b(self, m, w, seen, lam):
        """The least-squares b for the current priors (None: nothing to go on)."""
        v = w * lam * lam / (w + lam) ** 2
        v[0] = w[0]
        num = float(np.sum((v * (m - self._p))[seen]))
        den = float(np.sum(v[seen]))
        if self._b0 is not None:
            num, den = num + self._b0, den + 1.0
        return num / den if den > 0.0 else None

    def _fit_slope(self, obs, w, seen) -> None:
        """A cached curve measured on a busy machine (or another machine) is usually wrong in
        its overall steepness, at every k alike. Timings of any k say so: fit one factor on
        (r(k) - 1) over the observed k > 0, pulled towards 1, and rescale every k's prior, so
        k that were never tried stop looking cheap too."""
        x = self.prior - 1.0                       # [k_max + 1] cached excess cost
        use = seen.copy()
        use[0] = False
        use &= x > 0.05
        if not use.any():
            return
        y = np.exp(obs[use]) - 1.0                 # observed excess cost
        wt, lam = w[use], self.config.slope_weight
        g = (float(np.sum(wt * x[use] * y)) + lam) / (float(np.sum(wt * x[use] ** 2)) + lam)
        self._slope = min(4.0, max(0.1, g))
        self._p = np.log(1.0 + self._slope * x)


def _weighted_median(values, weights) -> float:
    """The median of `values` weighted by `weights` (0 where no weight).

    >>> _weighted_median(np.array([0.1, 0.7, 0.2]), np.array([5.0, 1.0, 3.0]))
    0.1
    """
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    if not len(cum) or cum[-1] <= 0:
        return 0.0
    return float(values[order][np.searchsorted(cum, cum[-1] / 2)])


SUSPECT_TIMINGS = 16.0  # verify batches timed before disagreement() is more than noise


# -- calibration stability -------------------------------------------------------------------
NOISY_SPREAD = 0.08     # per-round r(k) disagreeing by more than 8% (median over k): noisy
JITTER_MS = 1.0         # one-token decodes faster than this (tiny models) are timer and
                        # scheduler jitter whatever the load: never judged noisy; online
                        # timing refines their curve


@dataclass(frozen=True)
class Stability:
    rounds: int
    spread: float          # median over k >= 1 of (max - min) / min of the per-round r(k)
    worst_k: int           # the k whose per-round r(k) disagreed most
    worst_spread: float
    base_spread: float     # (max - min) / min of the one-token time across rounds
    step_ms: float = 0.0   # the fastest one-token decode (0: unknown)

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD and not 0.0 < self.step_ms < JITTER_MS


def round_stability(times: Sequence[Sequence[float]],
                    ks: Optional[Sequence[int]] = None) -> Stability:
    """How much the calibration rounds agree. times: [rounds][1 + len(ks)] seconds, a one-token
    decode's first (ks: the k timed after it, default 1, 2, ...).
    A round's r(k) is its own time(k) / time(0), so a machine that is uniformly slower for a
    round does not count as noise; another job that comes and goes within a round does. With 4+
    rounds the highest and lowest r(k) are left out: one odd round is not a busy machine.

    >>> s = round_stability([[1.0, 1.5, 2.0], [1.0, 1.5, 2.1], [1.0, 1.6, 2.0]])
    >>> round(s.spread, 3), s.worst_k, s.noisy
    (0.058, 1, False)
    """
    rounds = [list(r) for r in times if r and r[0] > 0]
    n = len(rounds[0]) - 1 if rounds else 0
    return ratio_stability([[r[i] / r[0] for r in rounds] for i in range(1, n + 1)],
                           [r[0] for r in rounds], ks)


def ratio_stability(per_k: Sequence[Sequence[float]], base: Sequence[float],
                    ks: Optional[Sequence[int]] = None) -> Stability:
    """round_stability's verdict from the r(k) samples of each timed k (per_k[i] of k = ks[i];
    ks default 1, 2, ...) and the one-token times (seconds), however they were gathered
    (rounds, or slices of several runs)."""
    spreads = []
    for samples in per_k:
        rs = sorted(samples)
        if len(rs) >= 4:
            rs = rs[1:-1]
        spreads.append((rs[-1] - rs[0]) / rs[0] if rs else 0.0)
    base = list(base)
    worst = max(range(len(spreads)), key=spreads.__getitem__) if spreads else 0
    worst_k = ks[worst] if ks and spreads else worst + 1
    return Stability(max((len(x) for x in per_k), default=len(base)),
                     statistics.median(spreads) if spreads else 0.0, worst_k,
                     spreads[worst] if spreads else 0.0,
                     (max(base) - min(base)) / min(base) if base else 0.0,
                     1000.0 * min(base) if base else 0.0)


def stability_line(st: Stability, attempts: int = 1) -> str:
    """The line `localspec calibrate` prints about its own trustworthiness.

    >>> stability_line(Stability(5, 0.031, 3, 0.07, 0.12))
    'stability: stable (5 rounds; per-round r(k) within 3.1% (median over k), worst r(3) 7.0%; one-token time varied 12.0%)'
    """
    verdict = "NOISY (another job running?)" if st.noisy else \
        "timer-bound (steps under 1 ms; refined online)" if st.spread > NOISY_SPREAD else "stable"
    again = f", {attempts} attempts" if attempts > 1 else ""
    return (f"stability: {verdict} ({st.rounds} rounds{again}; per-round r(k) within "
            f"{100 * st.spread:.1f}% (median over k), worst r({st.worst_k}) "
            f"{100 * st.worst_spread:.1f}%; one-token time varied {100 * st.base_spread:.1f}%)")
