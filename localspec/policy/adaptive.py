"""The per-request draft policy: predicted acceptance per position (acceptance.py) against the
learned verify cost (costmodel.py) picks k, and a regret guard turns speculation off for a while
when the request's speculative steps realise fewer tokens per millisecond than plain ones.

k = argmax over 1..n of E(k) / r(k), E(k) = 1 + p_0 + p_0 p_1 + ...; 0 (plain) unless the best
beats `min_gain`, and only k whose loss if all are rejected, r(k) - 1 plain steps, fits the
request's loss budget: `loss_budget` x (the longest run of right guesses it has shown + 1).
The cost model may be shared by every request of one engine (it learns the machine); the
acceptance model and the guard belong to one request (they learn the text).
"""

from __future__ import annotations

from typing import Optional, Sequence

from .acceptance import AcceptanceModel, DraftFeatures, Offer, RequestState
from .config import GuardConfig, PolicyConfig
from .costmodel import CostModel
from .draft_estimate import DraftPolicy
from .explore import Exploration

TRACK_PRIOR = 4.0   # survival(): pseudo-drafts, predicted and accepted alike, each request
                    # starts with (its first drafts are weighed as predicted)
PLAIN_EMA = 0.8     # the guard's plain-step time: the last ~5 plain steps of the request


class RegretGuard:
    """Realised gain = tokens the speculative steps emitted x (what one plain step costs now) /
    (what they cost), over a decayed window. Below `threshold` after `min_steps`: plain decoding
    for `backoff` steps, then a probe (a fresh window); a failed probe doubles the backoff, a
    good window resets it. A step dearer than `step_cap` plain steps enters the window scaled
    down to that weight (its own gain unchanged), so no single step decides.

    >>> g = RegretGuard()
    >>> for step in range(10):
    ...     if g.allows():
    ...         g.speculative(n_emitted=1, ms=150.0, plain_ms=60.0)   # nothing accepted
    ...     else:
    ...         g.plain()
    >>> g.allows(), g.n_backoffs
    (False, 1)
    """

    def __init__(self, config: GuardConfig = GuardConfig()):
        self.config = config
        self._gain_num = self._gain_den = 0.0
        self._steps = 0
        self._off = 0                       # plain steps left before the next probe
        self._backoff = config.backoff
        self.n_backoffs = 0

    def allows(self) -> bool:
        return self._off == 0

    @property
    def gain(self) -> Optional[float]:
        return self._gain_num / self._gain_den if self._gain_den > 0 else None

    def speculative(self, n_emitted: int, ms: float, plain_ms: float) -> None:
        """A step that drafted: it emitted n_emitted tokens in ms; a plain step costs plain_ms."""
        c = self.config
        if ms > c.step_cap * plain_ms > 0:
            w = c.step_cap * plain_ms / ms
            n_emitted, ms = n_emitted * w, ms * w
        self._gain_num = self._gain_num * c.decay + n_emitted * plain_ms
        self._gain_den = self._gain_den * c.decay + ms
        self._steps += 1
        if self._steps < c.min_steps:
            return
        if self.gain < c.threshold:
            self._off = self._backoff
            self._backoff = min(2 * self._backoff, c.backoff_max)
            self.n_backoffs += 1
            self._gain_num = self._gain_den = 0.0
            self._steps = 0
        elif self._steps >= 2 * c.min_steps:
            self._backoff = c.backoff        # a probe that pays: forget earlier failures

    def plain(self) -> None:
        """A step that did not draft."""
        if self._off:
            self._off -= 1


def best_draft(p: Sequence[float], r: Sequence[float]) -> tuple:
    """(k, E(k) / r(k)) at the k in 1..len(p) that maximises the predicted gain, the first on a
    tie, E(k) = 1 + p_0 + p_0 p_1 + ... (acceptance.expected_by_k, here in floats: 1-16
    positions, every step); (0, 0.0) for no positions.

    >>> best_draft([0.9, 0.9, 0.1], [1.0, 1.5, 1.8, 2.0])
    (2, 1.5055555555555555)
    """
    best_k, best, run, e = 0, 0.0, 1.0, 1.0
    for k, pk in enumerate(p, 1):
        run *= pk
        e += run
        if e / r[k] > best:
            best_k, best = k, e / r[k]
    return best_k, best


def _survivals(probs: Sequence[float], scale: float = 1.0) -> tuple:
    """Running products scale x p_0, scale x p_0 p_1, ...: the chance drafts 0..j all pass."""
    out, run = [], scale
    for p in probs:
        run *= p
        out.append(run)
    return tuple(out)


class AdaptivePolicy:
    """One request's policy. The step calls, in order:
    start() after prefill; per step the proposer calls choose_draft(features), then the
    step calls observe_step(...) with what verification decided and what it cost."""

    def __init__(self, cost: CostModel, config: PolicyConfig = PolicyConfig(),
                 draft: Optional[DraftPolicy] = None, explore: Optional[Exploration] = None):
        self.cost = cost
        self.config = config
        # probes of other draft lengths, on a budget the engine's requests share (like the cost
        # model): what the cost curve overstates is found out (explore.py)
        self.explore = explore if explore is not None else \
            Exploration(config.probe_share, config.probe_timed)
        # A draft model's proposals have none of the n-gram features: they keep the scalar
        # acceptance estimate of draft_estimate.DraftPolicy (and its probes), on the prior cost curve.
        self.draft = draft if draft is not None else DraftPolicy(cost.prior.tolist(), config)
        self.acceptance = AcceptanceModel(config.acceptance)
        self.guard = RegretGuard(config.guard)
        self.state = RequestState()
        self._seen = (None, None)   # the last proposal predicted, and its base logits
        self._plain_ms: Optional[float] = None   # this request's plain steps, smoothed
        self._predicted = self._got = 0.0        # drafts predicted accepted / accepted
        self.tracking = False                    # keep survival()'s tally (a slot's request)

    def start(self) -> None:
        """A new request: nothing is known about its text yet."""
        self.state = RequestState()
        self._plain_ms = None
        self._predicted = self._got = 0.0

    def choose(self, offer: Offer) -> int:
        """k for a proposer's offer (0: decode plainly). A draft model's offer has no features:
        it keeps the scalar estimate of draft_estimate.DraftPolicy and its probes."""
        if offer.features is None:
            return self.draft.choose_k(offer.source, available=offer.limit, probe=True)
        return self.choose_scored(offer)[0]

    def predict(self, f: DraftFeatures) -> list:
        """p_0..p_{n-1} of the proposal's positions (n capped by k_max)."""
        return self.acceptance.probs(self._logits(f))

    def survival(self, f: DraftFeatures, n: int) -> tuple:
        """For j < n: the chance that draft positions 0..j are all accepted, as predicted and
        then scaled down by how this request's drafts have fared against such predictions so
        far (a shared tick weighs a slot's drafts by it, and the predictions are confident
        where a copy is edited line by line). The step's own choice is left as it was. The
        tally is kept only where `tracking` is set (a slot's request): lone steps skip it."""
        scale = min(1.0, (self._got + TRACK_PRIOR) / (self._predicted + TRACK_PRIOR))
        return _survivals(self.acceptance.probs(self.acceptance.base_logits(f, n, self.state)),
                          scale)

    def _logits(self, f: DraftFeatures, depth: Optional[int] = None) -> list:
        """The proposal's prior logits of its first `depth` positions (None: all it may draft),
        kept for observe_step() to learn from."""
        n = min(len(f.tokens), self.config.k_max, self.cost.k_max)
        if depth is not None:
            n = min(n, depth)
        base = self.acceptance.base_logits(f, n, self.state)
        self._seen = (f, base)
        return base

    def choose_draft(self, f: DraftFeatures) -> int:
        return self.choose_scored(Offer(f.source, len(f.tokens), f))[0]

    def choose_scored(self, offer: Offer) -> tuple:
        """(k, predicted gain E(k)/r(k)) for an offer: offers from several sources (prompt
        lookup, the draft store) compete by the gain; a draft model's offer scores 0 (it is
        taken only where no n-gram offer is)."""
        f = offer.features
        if f is None:
            return self.choose(offer), 0.0
        if self.config.fixed_k is not None:
            return max(0, min(self.config.fixed_k, len(f.tokens))), 1.0
        depth, r = 0, None
        if self.guard.allows():         # paused: the cost curve is not read (its refit waits)
            r = self.cost.ratio_list()
            depth = self._depth(r, self._evidence(f))
        base = self._logits(f, max(1, depth))   # also when off: the plain step learns from p_0
        if r is None or not base:
            return 0, 0.0
        k, gain = best_draft(self.acceptance.probs(base), r) if depth else (0, 0.0)
        if gain <= self.config.min_gain:
            k, gain = 0, 0.0
        n = min(len(f.tokens), self.config.k_max, len(r) - 1)   # now and then a probe
        return self.explore.widen(k, gain, n, self.state.streak, self.cost), gain

    def _evidence(self, f: DraftFeatures) -> int:
        """A run of right guesses an offer brings with it: the leading draft-store tokens that
        followed this context at least `store_evidence` times before (their counts are what
        the request would otherwise have to show itself, a token at a time)."""
        need = self.config.store_evidence
        if not need or f.source != "store" or f.agree is None:
            return 0
        n = 0
        while n < len(f.agree) and f.agree[n] >= need:
            n += 1
        return n

    def _depth(self, r: Sequence[float], shown: int = 0) -> int:
        """How many drafts the loss budget lets this request risk: the k before the first whose
        r(k) - 1 plain steps lost (a draft missing at once) exceed `loss_budget` x (the longest
        run of right guesses the request has shown + 1); `loss_budget_long` instead while the
        current run is at least `long_run` long or has copied `long_lines` line breaks (a copy
        in progress ramps up in fewer steps; a summary whose quote ended is back on the slow
        ramp). On a GPU, r(k) ~ 1: never binding;
        on a 2-core CPU, 15 drafts risk ~6 steps. Only these positions are predicted: on chat,
        2-5 of up to 16 (the Python per step that runs whether or not anything is drafted)."""
        c, run = self.config, max(self.state.longest, shown)
        copying = max(self.state.streak, shown) >= c.long_run or \
            0 < c.long_lines <= self.state.lines
        rate = c.loss_budget_long if copying else c.loss_budget
        budget = 1.0 + rate * (run + 1)
        n, d = min(c.k_max, len(r) - 1), 0
        while d < n and r[d + 1] <= budget:
            d += 1
        return d

    def observe_step(self, f: Optional[DraftFeatures], k: int, n_accepted: int,
                     emitted: Sequence[int], verify_ms: Optional[float] = None,
                     propose_ms: float = 0.0) -> None:
        """f: the proposal's features (None: no match, or a forced plain re-decode); k drafted,
        n_accepted of them passed the verifier, `emitted` the tokens the step produced (the
        near-tie guard may cut them short, even to none); verify_ms the batch's decode time,
        propose_ms the proposer's."""
        probe, self.explore.pending = self.explore.pending, None
        probe = probe if probe is not None and probe.k == k else None
        if verify_ms is not None:
            self.cost.observe(k, verify_ms, now=probe is not None)   # a probe's answer: at once
            if not k:
                self._plain_ms = verify_ms if self._plain_ms is None else \
                    PLAIN_EMA * self._plain_ms + (1.0 - PLAIN_EMA) * verify_ms
            plain_ms = self._plain_reference()
            self.explore.earn(verify_ms / plain_ms)
            if probe is not None:
                self.explore.charge(probe, len(emitted), verify_ms, plain_ms)
        if f is not None and len(f.tokens):
            base = self._seen[1] if self._seen[0] is f else None
            if k:
                if self.tracking:     # a slot's request: survival() scales by this tally
                    self._track(f, k, n_accepted, base)
                self.acceptance.observe(f, k, n_accepted, self.state, base)
            elif emitted:             # not drafted: plain decoding says what it would have scored
                self.acceptance.observe(f, 1, int(f.tokens[0] == emitted[0]), self.state, base)
        if k:
            ms = (verify_ms if verify_ms is not None else self._model_ms(k)) + propose_ms
            self.guard.speculative(len(emitted), ms, self._plain_reference())
        else:
            self.guard.plain()
        self.state.verified(f, k, n_accepted, emitted)

    def _track(self, f: DraftFeatures, k: int, n_accepted: int, base) -> None:
        """Add a drafted step's predicted accepted drafts (sum of survivals) and its accepted
        ones to the request's totals, which survival() scales its predictions by."""
        if base is None or len(base) < k:
            base = self.acceptance.base_logits(f, k, self.state)
        self._predicted += sum(_survivals(self.acceptance.probs(base[:k])))
        self._got += n_accepted

    def _plain_reference(self) -> float:
        """What a plain step costs the request now: its own recent plain steps (the engine's cost
        model carries the previous request's context length and minute: seen ~7% low at the
        start of a summary), else the cost model's estimate."""
        if self._plain_ms is not None:
            return self._plain_ms
        return self._model_ms(0)

    def _model_ms(self, k: int) -> float:
        """Without timings (online off): the cost curve in plain-step units stands in for ms."""
        ms = self.cost.ms(k)
        return ms if ms is not None else self.cost.ratio(k)
