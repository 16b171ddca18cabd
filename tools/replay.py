"""Offline policy replay: scores draft policies on recorded plain greedy outputs, and the bound
that knows the future, in decode-time units (no model, no noise).

Greedy speculation emits plain decoding's tokens, so a recording (replay_record.py) fixes every
step's history: the real NgramProposer proposes, the policy under test chooses k, the drafted
tokens are checked against the recorded output, the near-tie guard cuts a step where a recorded
row's top-2 margin is under `tie_margin` (as the engine does), and the step is charged
r(k) + c from the "true" cost curve (c: the proposer's own cost). The policy is told the step's
verify time as r(k) x `base_ms`, so a cost model that learns online sees the true curve even
when its prior (the cached curve) is another one. Score = (n - 1) plain steps / that cost.
With `timing_noise` the times told to the policy jitter as on a shared machine (the score is
still charged the true curve): what online cost learning does with noisy timings.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from localspec.policy.acceptance import PLAIN
from localspec.policy.calibrate import newest_cached
from localspec.errors import LocalspecError
from localspec.speculative.proposers import NgramProposer

BASE_MS = 60.0     # a plain step, for the timings handed to policies (only ratios matter)


@dataclass(frozen=True)
class Recorded:
    id: str
    kind: str
    prompt: list
    out: list
    margin: list          # [n] top-2 logit margin of the row that chose out[j]
    p_top: list           # [n] its top-1 probability
    classes: dict = field(default_factory=dict)   # {token id: token_class}, PLAIN left out
    session: Optional[str] = None                 # workload session (tools/session_replay.py)
    order: int = 0                                # the case's line in its workloads file

    def token_classes(self) -> Callable:
        return lambda tokens: [self.classes.get(t, PLAIN) for t in tokens]


def load(path: str) -> list:
    with open(path) as f:
        data = json.load(f)
    classes = {int(t): c for t, c in data.get("token_class", {}).items()}
    return [Recorded(cid, c["kind"], c["prompt"], c["out"], c["margin"], c["p_top"], classes,
                     c.get("session"), c.get("order", 0))
            for cid, c in data["cases"].items()]


def _proposer(case: Recorded, ngram_max: int, tie: str, store=None) -> NgramProposer:
    """The engine's n-gram proposer on the case's prompt and first token; with `store` (a
    speculative.learning_store.LearningStore that does not learn: the caller remembers the
    output after the case) it also offers the draft store's continuations."""
    prop = NgramProposer(1, ngram_max, tie, token_classes=case.token_classes(), store=store)
    prop.begin(case.prompt)
    prop.accept(case.out[:1])
    return prop


def _close(prop: NgramProposer) -> None:
    prop.store = None             # the store outlives the case (a session's)
    prop.close()


def choose(policy, offers: list) -> tuple:
    """The engine's choice among a step's offers (drafting.propose): (features, k) of the offer
    with the best predicted gain, else (the first offer's features or None, 0)."""
    best = None
    for offer in offers:
        if len(offers) == 1:           # prompt lookup alone: the call wrappers watch
            k, gain = policy.choose_draft(offer.features), 0.0
        else:
            k, gain = policy.choose_scored(offer)
        if k > 0 and (best is None or gain > best[2]):
            best = (offer.features, k, gain)
    if best is not None:
        return best[0], best[1]
    return (offers[0].features if offers else None), 0


def extend_curve(points: Sequence[float], k_max: int = 16, anchors: Optional[dict] = None) -> list:
    """A full r(0..k_max) from r(0..len-1) plus optional {k: r} anchors further out, linear in
    between; beyond the last point, the last slope.

    >>> extend_curve([1, 1.55, 1.75, 1.75, 2.2], 8, {8: 3.0})
    [1.0, 1.55, 1.75, 1.75, 2.2, 2.4, 2.6, 2.8, 3.0]
    """
    pts = {k: float(r) for k, r in enumerate(points)}
    pts.update({int(k): float(r) for k, r in (anchors or {}).items()})
    ks = sorted(pts)
    out = []
    for k in range(k_max + 1):
        if k in pts:
            out.append(pts[k])
            continue
        lo = max((j for j in ks if j < k), default=ks[0])
        hi = min((j for j in ks if j > k), default=None)
        if hi is None:                       # extrapolate with the last slope
            a, b = ks[-2], ks[-1]
            out.append(pts[b] + (k - b) * (pts[b] - pts[a]) / (b - a))
        else:
            out.append(pts[lo] + (k - lo) * (pts[hi] - pts[lo]) / (hi - lo))
    return [round(r, 4) for r in out]


def curve_from_json(path: str) -> list:
    """r(0..) from a JSON file that holds one: a calibration cache entry (`ratios`, what
    `localspec calibrate` writes) or a `localspec bench --json` file (`meta.verify_cost_curve`,
    the curve that run started from)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise LocalspecError(f"cannot read a cost curve from {path}: {e}") from None
    meta = data.get("meta") if isinstance(data, dict) else None
    ratios = data.get("ratios") if isinstance(data, dict) else None
    if ratios is None and isinstance(meta, dict):
        ratios = meta.get("verify_cost_curve")
    if not (isinstance(ratios, list) and len(ratios) >= 2 and
            all(isinstance(r, (int, float)) and r >= 1.0 for r in ratios)):
        raise LocalspecError(f"{path} holds no cost curve (a calibration file's `ratios` or a "
                             "bench JSON's `meta.verify_cost_curve`, numbers >= 1 from r(0) = 1)")
    return [float(r) for r in ratios]


def calibrated_curve(model_name: str, threads: int) -> tuple:
    """(r(0..), path) of this machine's newest cached calibration of `model_name` (a GGUF file
    name) with `threads` threads: the curve `localspec calibrate` measured here last."""
    found = newest_cached(model_name, threads)
    if found is None:
        raise LocalspecError(f"no calibration of {model_name} with {threads} threads on this "
                             f"machine: run `localspec calibrate --threads {threads}` first")
    curve, path = found
    return list(curve.ratios), path


@dataclass
class CaseScore:
    speedup: float
    steps: int = 0
    spec_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    cost: float = 0.0


def run_length(tokens: Sequence[int], out: Sequence[int], t: int) -> int:
    """How many of `tokens` match out[t:] from the start."""
    n = 0
    while n < len(tokens) and t + n < len(out) and tokens[n] == out[t + n]:
        n += 1
    return n


SPIKE_RATE, SPIKE = 0.03, (1.5, 2.5)   # timing noise: 3% of steps descheduled, 1.5-2.5x


def jitter(sigma: float, seed: str) -> Callable[[float], float]:
    """ms -> ms as a shared machine reports it: log-normal noise of `sigma` and occasional
    descheduled steps; a fixed sequence per seed (replays stay deterministic)."""
    rng = random.Random(seed)

    def noisy(ms: float) -> float:
        ms *= math.exp(rng.gauss(0.0, sigma))
        return ms * rng.uniform(*SPIKE) if rng.random() < SPIKE_RATE else ms
    return noisy


class CaseRun:
    """One recorded case replayed a step at a time, as the engine runs it: propose(room) says
    what the policy drafts, finish(drafts) verifies them against the recording, tells the
    policy and moves on. replay_case() runs one alone; tools/slots_replay.py ticks several."""

    def __init__(self, case: Recorded, make_policy: Callable, *, tie_margin: float = 0.25,
                 ngram_max: int = 8, tie: str = "earliest", store=None,
                 first_oracle: bool = False):
        self.case, self.t, self.recheck = case, 1, False
        self.tie_margin, self.first_oracle = tie_margin, first_oracle
        self.policy = make_policy()
        self.prop = _proposer(case, ngram_max, tie, store)
        self.score = CaseScore(1.0)
        self.policy.start()

    @property
    def done(self) -> bool:
        return self.t >= len(self.case.out)

    def propose(self, room: int) -> tuple:
        """(features or None, drafts) the engine's way: the proposer offers, the policy chooses
        k, k tokens are drafted; at most `room` of them."""
        out = self.case.out
        offers = [] if self.recheck else \
            self.prop.offers(min(room, len(out) - self.t, self.policy.config.k_max))
        if self.first_oracle:
            offers = [o for o in offers if o.features.tokens[0] == out[self.t]]
        f, k = choose(self.policy, offers)
        return f, (list(f.tokens[:k]) if f is not None else [])

    def survival(self, f, n: int) -> tuple:
        """The policy's predicted chance that drafts 0..j of `f` are all accepted, j < n."""
        return self.policy.survival(f, n) if f is not None and n else ()

    def finish(self, f, drafts: list, cost: float, told_ms: Optional[float],
               propose_ms: float = 0.0, trace: Optional[list] = None) -> int:
        """Verify `drafts` after position t, charge `cost`, tell the policy `told_ms` (None: an
        untimed step, as a slot's); returns the tokens emitted."""
        out, t, k = self.case.out, self.t, len(drafts)
        n_acc = run_length(drafts, out, t)
        step = _tie_cut(self.case.margin, t, n_acc, k, self.tie_margin)
        self.recheck = step is not None and step <= n_acc
        emitted = out[t:t + (step if self.recheck else n_acc + 1)]
        self.policy.observe_step(f, k, n_acc, emitted, verify_ms=told_ms, propose_ms=propose_ms)
        if trace is not None:
            trace.append((t, k, n_acc, len(emitted),
                          run_length(f.tokens, out, t) if f is not None else 0))
        self.prop.accept(emitted)
        self.t += len(emitted)
        sc = self.score
        sc.steps += 1
        sc.spec_steps += k > 0
        sc.drafted += k
        sc.accepted += n_acc
        sc.cost += cost
        return len(emitted)

    def close(self) -> CaseScore:
        _close(self.prop)
        n, sc = len(self.case.out), self.score
        sc.speedup = (n - 1) / sc.cost if sc.cost else 1.0
        return sc


def replay_case(case: Recorded, make_policy: Callable, curve: Sequence[float], *,
                propose_cost: float = 0.0, tie_margin: float = 0.25, ngram_max: int = 8,
                tie: str = "earliest", k_max: int = 16, trace: Optional[list] = None,
                timing_noise: float = 0.0, seed: int = 0, store=None,
                first_oracle: bool = False) -> CaseScore:
    """Run one recorded case through NgramProposer + make_policy() against the true `curve`;
    `trace` (a list) collects (t, k, n_accepted, n_emitted, matching run) per step;
    `timing_noise` > 0: the policy is told jittered times (jitter(), seeded by seed and case);
    `first_oracle`: offers whose first token is wrong are withheld from the policy (a ceiling:
    what knowing which offers are right, but not how far, would give)."""
    told = jitter(timing_noise, f"{seed}:{case.id}") if timing_noise > 0 else (lambda ms: ms)
    run = CaseRun(case, make_policy, tie_margin=tie_margin, ngram_max=ngram_max, tie=tie,
                  store=store, first_oracle=first_oracle)
    try:
        while not run.done:
            f, drafts = run.propose(k_max)
            k = len(drafts)          # rechecks are charged too: a conservative charge
            run.finish(f, drafts, curve[k] + propose_cost, told(curve[k] * BASE_MS),
                       propose_cost * BASE_MS, trace)
    finally:
        score = run.close()
    return score


def clear_run(margin: Sequence[float], t: int, run: int, tie_margin: float) -> int:
    """How many of `run` matching drafts from position t a step can keep: the largest j <= run
    with rows t..t+j all clear of near-ties (each decision and the one after it at or above
    tie_margin), as the bound and the replay's reports cut a run."""
    for j in range(1, run + 1):
        if tie_margin > 0 and min(margin[t + j - 1], margin[t + j]) < tie_margin:
            return j - 1
    return run


def _tie_cut(margin: Sequence[float], t: int, n_acc: int, k: int, tie_margin: float):
    """The engine's near-tie guard: the first row 0..n_acc of a k-draft batch (row i chose
    out[t + i]) whose margin is under tie_margin, or None. Plain steps are never cut."""
    if k == 0 or tie_margin <= 0:
        return None
    for i in range(n_acc + 1):
        if t + i < len(margin) and margin[t + i] < tie_margin:
            return i
    return None


def bound_case(case: Recorded, curve: Sequence[float], *, tie_margin: float = 0.25,
               ngram_max: int = 8, tie: str = "earliest", k_max: int = 16,
               store=None) -> float:
    """The best any policy drafting a prefix of the matcher's proposal can do, knowing the
    future: at each position t the proposal's length and matching run are known, and a dynamic
    programme picks how many tokens each step emits (j + 1 with j <= run, rows t..t+j clear of
    near-ties, at the cheapest r(k) over k in j..proposal length: a curve can dip) to minimise
    the total cost. Ignores the proposer's own cost: an upper bound for every policy here.

    >>> c = Recorded("x", "code-edit", [5, 1, 2, 3, 4, 6], [1, 2, 3, 4, 6], [9.0] * 5, [1.0] * 5)
    >>> round(bound_case(c, [1.0, 1.5, 1.8, 2.0, 2.2]), 3)     # out[1:] drafted at once: r(3)
    2.0
    """
    out, n = case.out, len(case.out)
    runs, avail = [0] * n, [0] * n
    prop = _proposer(case, ngram_max, tie, store)
    try:
        for t in range(1, n):
            for o in prop.offers(min(k_max, n - t)):     # with a store: the better offer
                run = run_length(o.features.tokens, out, t)
                if (run, o.limit) > (runs[t], avail[t]):
                    runs[t], avail[t] = run, o.limit
            prop.accept(out[t:t + 1])
    finally:
        _close(prop)
    best = [0.0] * (n + 1)              # best[t]: least cost to emit out[t:]
    for t in range(n - 1, 0, -1):
        best[t] = curve[0] + best[t + 1]
        for j in range(1, clear_run(case.margin, t, min(runs[t], n - t - 1), tie_margin) + 1):
            step = min(curve[j:avail[t] + 1])
            best[t] = min(best[t], step + best[t + j + 1])
    return (n - 1) / best[1] if n > 1 and best[1] else 1.0


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


# -- fitting the acceptance prior -----------------------------------------------------------
def plain_proposals(case: Recorded, ngram_max: int = 8, tie: str = "earliest", k_max: int = 16):
    """Yields (t, proposal features, request state) at every output position t >= 1 where the
    matcher has a proposal of up to k_max tokens, the state as plain decoding would keep it (a
    token at a time, the proposal's first token checked against the output); the state moves
    on after each yield."""
    from localspec.policy.acceptance import RequestState
    out, n = case.out, len(case.out)
    prop = _proposer(case, ngram_max, tie)
    try:
        state = RequestState()
        for t in range(1, n):
            f = prop.features(min(k_max, n - t))
            if f is not None:
                yield t, f, state
            state.verified(f, 0, 0, out[t:t + 1])
            prop.accept(out[t:t + 1])
    finally:
        _close(prop)


def training_rows(case: Recorded, ngram_max: int = 8, tie: str = "earliest", k_max: int = 16):
    """(X [m, len(FEATURES)], y [m], depth [m]) for every output position t the matcher has a
    proposal for, and every draft position i (= depth) up to its first miss: the conditional
    samples the acceptance model predicts, in plain_proposals()' request state."""
    import numpy as np

    from localspec.policy.acceptance import FEATURES, phis
    xs, ys, depth = [], [], []
    for t, f, state in plain_proposals(case, ngram_max, tie, k_max):
        run = run_length(f.tokens, case.out, t)
        m = min(run + 1, len(f.tokens))
        xs.append(phis(f, m, state))
        ys.extend(float(i < run) for i in range(m))
        depth.extend(range(m))
    return (np.vstack(xs) if xs else np.zeros((0, len(FEATURES)))), np.array(ys), \
        np.array(depth)


def fit_prior(rows: Sequence):
    """Acceptance prior weights (numpy, [len(FEATURES)]) from training_rows() of several cases.
    Each case weighs the same, and within a case draft position i weighs 1/(i+1): otherwise a
    few long copied code files (hundreds of positions per step, nearly all accepted) drown the first-token
    decisions in prose, where the choice between drafting and not is actually made."""
    import numpy as np
    xs, ys, ws = [], [], []
    for X, y, depth in rows:
        if len(y) == 0:
            continue
        w = 1.0 / (1.0 + depth)
        xs.append(X)
        ys.append(y)
        ws.append(w * 1000.0 / w.sum())
    return fit_logistic(np.vstack(xs), np.concatenate(ys), sample_weight=np.concatenate(ws))


def fit_logistic(X, y, l2: float = 1.0, iters: int = 30, sample_weight=None, offset=None,
                 penalize_bias: bool = False):
    """Logistic regression by Newton steps with an L2 penalty (on column 0, the bias, only with
    `penalize_bias`); `offset` [m]: a fixed logit each row starts from (fitting corrections to
    an existing model)."""
    import numpy as np
    sw = np.ones(len(y)) if sample_weight is None else np.asarray(sample_weight, dtype=float)
    z0 = 0.0 if offset is None else np.asarray(offset, dtype=float)
    w = np.zeros(X.shape[1])
    reg = np.full(X.shape[1], l2)
    if not penalize_bias:
        reg[0] = 0.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(z0 + X @ w)))
        grad = X.T @ (sw * (p - y)) + reg * w
        hess = (X * (sw * p * (1 - p))[:, None]).T @ X + np.diag(reg) + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def log_loss(X, y, w, sample_weight=None, offset=None) -> float:
    """Mean log loss of y under sigmoid(offset + X @ w), weighted by `sample_weight`."""
    import numpy as np
    z0 = 0.0 if offset is None else np.asarray(offset, dtype=float)
    p = np.clip(1.0 / (1.0 + np.exp(-(z0 + X @ w))), 1e-9, 1 - 1e-9)
    sw = np.ones(len(y)) if sample_weight is None else np.asarray(sample_weight, dtype=float)
    return float(np.sum(sw * -(y * np.log(p) + (1 - y) * np.log(1 - p))) / np.sum(sw))
