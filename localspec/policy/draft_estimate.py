"""A draft model's policy: one running acceptance estimate per source against the cost curve,
the off-switch with its probes, and whether a draft model can pay on this device at all.

A verify batch of k+1 tokens costs r(k) one-token decodes (r(0) = 1). With per-token acceptance
a, a step emits E(k) = (1 - a^(k+1)) / (1 - a) tokens, so speculation runs at E(k) / (r(k) + c(k))
times plain speed, where c(k) is the proposer's own cost in target-decode units. The policy picks
the k that maximises that and drafts nothing (k = 0, plain decoding) when no k beats
`draft_min_gain`.
k depends only on the cost curve and the acceptance history, never on wall-clock time measured
during the request, so a run is reproducible once its cost curve is cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from .acceptance import DraftFeatures, Offer
from .config import PolicyConfig


def expected_tokens(a: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k. Example: a=0.5, k=2 -> 1.75."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class _Estimate:
    hits: float
    trials: float


class DraftPolicy:
    """Chooses k per step; learns acceptance per key: the n-gram proposer keys by source and
    match length ("history:4", "document:2"), the draft model by "draft".

    `cost[k]` is r(k), the measured verify cost of k drafts relative to a plain step (cost[0] = 1).
    `draft_cost` is the draft model's one-token decode in target-step units; it applies to the
    "draft" source only (n-gram lookup is free). A step of k drafts costs the draft k + 1 decodes:
    k to draft, one to take in the token the target emitted after the last step.
    """

    def __init__(self, cost: Sequence[float], config: PolicyConfig = PolicyConfig(),
                 draft_cost: float = 0.0):
        self.cost = list(cost)
        self.config = config
        self.draft_cost = draft_cost
        self._est: dict[str, _Estimate] = {}
        self._idle: dict[str, int] = {}

    def acceptance(self, source: str) -> float:
        c = self.config
        e = self._est.get(source)
        hits = (e.hits if e else 0.0) + c.draft_prior * c.draft_prior_weight
        trials = (e.trials if e else 0.0) + c.draft_prior_weight
        return hits / trials

    def speedup(self, source: str, k: int) -> float:
        """Predicted speed of drafting k tokens relative to plain decoding."""
        if k == 0:
            return 1.0
        extra = self._draft_steps(k) if source == "draft" else 0.0
        return expected_tokens(self.acceptance(source), k) / (self.cost[k] + extra)

    def draft_can_pay(self) -> bool:
        """Could the draft model clearly beat plain decoding on this device if it agreed with the
        target `draft_best_acceptance` of the time? If not, asking it costs time (its prefill,
        catching up after idle stretches, probes) that the best case barely pays back.
        Example: CPU curve r(3) = 1.75 and a draft decode costing 0.48 target steps: at a = 0.9
        the best k (3) promises 3.44 / (1.75 + 4 * 0.48) = 0.94x: no. A GPU-like flat curve with
        0.2: 3.44 / (1 + 0.8) = 1.9x: yes."""
        if self.config.fixed_k is not None:
            return True
        a, gain = self.config.draft_best_acceptance, self.config.draft_pays_gain
        return any(expected_tokens(a, k) / (self.cost[k] + self._draft_steps(k)) > gain
                   for k in range(1, len(self.cost)))

    def _draft_steps(self, k: int) -> float:
        return self.draft_cost * (k + 1)

    def choose_k(self, source: str, available: Optional[int] = None, probe: bool = False) -> int:
        """Best k for the next step; `available` caps it (e.g. the n-gram match's length).

        probe: the caller cannot learn acceptance while off (a draft model costs time to ask),
        so every `probe_every`-th idle step drafts one token anyway. Deterministic: it depends
        on the step count, not on timing."""
        c = self.config
        limit = min(c.k_max, len(self.cost) - 1, c.k_max if available is None else available)
        if c.fixed_k is not None:
            return max(0, min(c.fixed_k, limit))
        best_k, best = 0, c.draft_min_gain
        for k in range(1, limit + 1):
            s = self.speedup(source, k)
            if s > best:
                best_k, best = k, s
        if best_k == 0 and probe and limit > 0 and c.probe_every:
            self._idle[source] = self._idle.get(source, 0) + 1
            if self._idle[source] % c.probe_every == 0:
                return 1
        return best_k

    # -- the step interface (shared with adaptive.AdaptivePolicy; the replay drives both) ------
    KEY_LENGTHS = 4    # match lengths 1, 2, 3 and 4+ are learned apart

    @classmethod
    def key_for(cls, f: DraftFeatures) -> str:
        """Acceptance is learned per source and matched-suffix length: a one-token match in
        prose is a coin toss, a four-token one in copied code is nearly certain. Measured on the
        workloads' plain outputs: first-draft acceptance 0.38 / 0.55 / 0.65 / 0.69 for summary
        matches of length 1 / 2 / 3 / 4, and 0.24 / 0.63 / 0.82 / 0.94 for code edits."""
        return f"{f.source}:{min(f.ngram_len, cls.KEY_LENGTHS)}"

    def start(self) -> None:
        """A new request (estimates are per request already)."""

    def choose_draft(self, f: DraftFeatures) -> int:
        """How many of the proposer's tokens to draft (0: decode plainly)."""
        return self.choose_k(self.key_for(f), available=len(f.tokens))

    def choose(self, offer: Offer) -> int:
        """k for a proposer's offer: a draft model's by its source's estimate (probing while
        off), an n-gram match's by its source and match length."""
        if offer.features is None:
            return self.choose_k(offer.source, available=offer.limit, probe=True)
        return self.choose_draft(offer.features)

    def observe_step(self, f: Optional[DraftFeatures], k: int, n_accepted: int,
                     emitted: Sequence[int], verify_ms: Optional[float] = None,
                     propose_ms: float = 0.0) -> None:
        """A verified step; a plain one (k = 0) still teaches what its proposal would have
        scored. Timing is not used by this policy."""
        if f is None:
            return
        if k:
            self.observe(self.key_for(f), k, n_accepted)
        elif emitted and len(f.tokens):
            self.observe(self.key_for(f), 1, int(f.tokens[0] == emitted[0]))

    def observe(self, source: str, n_drafted: int, n_accepted: int) -> None:
        """Record a verified step: the first n_accepted drafts passed, the next one (if any) failed."""
        if n_drafted == 0:
            return
        e = self._est.setdefault(source, _Estimate(0.0, 0.0))
        trials = n_accepted + (1 if n_accepted < n_drafted else 0)
        e.hits = e.hits * self.config.draft_decay ** trials + n_accepted
        e.trials = e.trials * self.config.draft_decay ** trials + trials


@dataclass(frozen=True)
class CostCurve:
    """r(k) for k = 0..k_max, measured on one model + device + thread count."""

    ratios: tuple
    ms_per_step: float                # one-token decode, milliseconds
    key: str = ""
    notes: dict = field(default_factory=dict)
