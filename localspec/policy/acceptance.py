"""Predicts, per drafted position, the chance that the target accepts the draft token, from what
is known when the proposal is made at no model cost; learns online within a request.

p_i = P(draft i accepted | drafts 0..i-1 accepted) is a logistic model of the draft's features
(match length, how many earlier occurrences continue the same way, whether the draft token is a
line break or a sentence end, the running streak and recent share of correct guesses). Its prior
weights were fitted offline on recorded plain outputs (`scripts/bench/policy_replay.py fit`);
within a request one logit offset follows what the verifier says. Deterministic: same inputs,
same p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class DraftFeatures:
    """What the proposer knows about its continuation (csrc/ngram.h: PROPOSE, SUPPORT)."""

    tokens: Sequence[int]     # [n] the continuation: the most that could be drafted
    source: str               # "history" | "document"
    ngram_len: int            # length of the matched suffix (>= 1)
    n_occ: int = 1            # earlier occurrences of that suffix visited (<= 64)
    agree: Optional[Sequence[int]] = None  # [n] of those, how many continue with tokens[0..i]
    breaks: Optional[Sequence[int]] = None  # [n] token_class() of each continuation token
    trust: float = 0.0        # logit the proposer adds from its own record (the draft store:
                              # how often its first tokens were right lately, across requests)


@dataclass(frozen=True)
class Offer:
    """What a proposer can draft now, before it spends anything on drafting: an n-gram match (its
    continuation and support, free to draft) or a draft model that is ready (up to `limit`
    tokens, one decode each). The policy reads it and chooses k; the proposer then drafts k."""

    source: str                               # "history" | "document" | "draft"
    limit: int                                # the most tokens the proposer can give (>= 1)
    features: Optional[DraftFeatures] = None  # n-gram: what the acceptance model reads


PLAIN, NEWLINE, STOP = 0, 1, 2   # token_class(): where copied text tends to part


def token_class(piece: bytes) -> int:
    """NEWLINE if the token's text holds a line break, STOP if it ends a sentence, else PLAIN.
    A summary quoting its source leaves it at a line break far more often than mid-line.

    >>> token_class(b".\\n"), token_class(b" end."), token_class(b" the")
    (1, 2, 0)
    """
    if b"\n" in piece:
        return NEWLINE
    return STOP if any(c in piece for c in (b".", b"!", b"?")) else PLAIN


class TokenClasses:
    """token_class of token ids, looked up through `piece(id) -> bytes` once per id."""

    def __init__(self, piece):
        self._piece = piece
        self._cache: dict = {}

    def __call__(self, tokens: Sequence[int]) -> list:
        out = []
        for t in tokens:
            c = self._cache.get(t)
            if c is None:
                c = self._cache[t] = token_class(self._piece(t))
            out.append(c)
        return out


RECENT_PRIOR = 0.5          # `recent` before any evidence
RECENT_DECAY = 0.9          # per output token: the last ~10 proposals count


@dataclass
class RequestState:
    """What a request has shown so far, kept the same way by the policy (after each verified
    step) and by the offline fit (stepping through a plain output one token at a time).

    streak: output tokens the proposer had guessed right, in a row; longest: the longest such
    streak so far; lines: the line breaks among the streak's tokens (known where the proposal
    classes its tokens); recent: decayed share of output tokens the proposer guessed right (an
    accepted draft token counts as a right guess, the token after the last accepted one as a
    wrong one); seen / missed: per token id, how often a checked position offered it and how
    often it was the one rejected there (`hazard`)."""

    streak: int = 0
    recent: float = field(default_factory=lambda: RECENT_PRIOR)
    longest: int = 0
    lines: int = 0
    seen: dict = field(default_factory=dict)
    missed: dict = field(default_factory=dict)

    def hazard(self, token: int) -> float:
        """missed / (seen + 1) of a token id: how often this request's text parted from its
        source where the source had this token (0 for one never rejected). An edit repeats
        itself (a rename rejects the old name at each use; a chat leaves a quoted list at the
        same marker), so a copy is likelier to end at such a token than its other features say."""
        m = self.missed.get(token)
        return m / (self.seen[token] + 1.0) if m else 0.0

    def verified(self, f: Optional[DraftFeatures], k: int, n_accepted: int,
                 emitted: Sequence[int]) -> None:
        """One step: k drafts of f, n_accepted passed, `emitted` came out (f None: no proposal;
        k = 0: not drafted, f's first token is compared with what plain decoding emitted)."""
        if not emitted:                  # a near-tie at row 0: nothing was decided
            return
        if f is None or not len(f.tokens):
            self.streak = self.lines = 0
            return
        hits = n_accepted if k else int(f.tokens[0] == emitted[0])
        missed = (n_accepted < k) if k else not hits
        seen = self.seen
        for t in f.tokens[:hits + missed]:
            seen[t] = seen.get(t, 0) + 1
        if missed:
            t = f.tokens[hits]
            self.missed[t] = self.missed.get(t, 0) + 1
        for _ in range(hits):
            self.recent = RECENT_DECAY * self.recent + (1.0 - RECENT_DECAY)
        if missed:
            self.recent *= RECENT_DECAY
        self.longest = max(self.longest, self.streak + hits)
        self.streak = 0 if missed else self.streak + hits
        if missed:
            self.lines = 0
        elif hits and f.breaks is not None:
            self.lines += sum(1 for b in f.breaks[:hits] if b == NEWLINE)


# Feature vector of draft position i (the row the target checks it on is i rows past the last
# verified one). Names in FEATURES order; `phis` builds them. Measured and left out (no gain in
# the cross-validated replay): the target's top-2 margin or top-1 probability at the last
# verified row, the match's true extent past ngram_max, the occurrence's distance, whether it is
# in the prompt, one-hot short match lengths. hazard: RequestState.hazard of draft token i (0
# for a draft-store offer: its text is other outputs', and with it the store's fitted
# corrections predicted the held-out sessions worse, log loss 0.485 against 0.478).
FEATURES = ("bias", "log_len", "share", "lone", "log_support", "log_streak", "depth", "recent",
            "newline", "stop", "newline_recent", "hazard")

# Prior weights: logistic regression on the recorded plain outputs of the shipped workloads
# (Qwen2.5-Coder-1.5B greedy, data/recordings/policy_plain.json, 60,932 conditional positions),
# refitted with `python scripts/bench/policy_replay.py fit data/recordings/policy_plain.json`:
# held-out log loss 0.064 per position over two folds, against 0.10-0.13 for a constant rate.
# The hazard weight came later (2026-12-04) and was fitted alone on top of the other eleven
# (a logistic fit with their logit as a fixed offset): -0.72 on policy_plain.json, -1.31 on
# policy_plain_zen4.json, -1.10 on the four held-out recordings; -1.0 is shipped. Refitting all
# twelve lowers the held-out log loss to 0.0605 / 0.0582 but moves every other weight, and
# replayed worse on code edits than the shipped eleven plus this one (docs/policy.md).
PRIOR_WEIGHTS = (-5.217, 0.564, 3.137, -0.348, 1.295, 0.736, 0.487, 1.716, -4.893, -2.710, 2.604,
                 -1.0)


def phis(f: DraftFeatures, n: int, state: RequestState) -> np.ndarray:
    """[n, len(FEATURES)] features of draft positions 0..n-1.

    log_len: log of the matched length if drafts 0..i-1 are accepted (ngram_len + i).
    share = agree[i] / agree[i-1] (agree[-1] = n_occ): of the occurrences that agreed so far,
    the fraction that also continue with token i; a lone occurrence is flagged apart (its
    share is 1 by construction). newline / stop: draft token i is a line break / ends a
    sentence, where text that quotes its source tends to leave it.

    >>> phis(DraftFeatures([7, 8], "history", 2, n_occ=4, agree=[2, 1]), 2, RequestState())[:, 2]
    array([0.5, 0.5])
    """
    i = np.arange(n, dtype=np.float64)
    if f.agree is not None:
        cur = np.asarray(f.agree[:n], dtype=np.float64)
        prev = np.concatenate(([float(f.n_occ)], cur[:-1]))
    else:
        cur = prev = np.ones(n)
    x = np.empty((n, len(FEATURES)))
    x[:, 0] = 1.0
    x[:, 1] = np.log(f.ngram_len + i)
    x[:, 2] = np.divide(cur, prev, out=np.zeros(n), where=prev > 0)
    x[:, 3] = float(f.n_occ <= 1)
    x[:, 4] = np.log1p(cur)
    x[:, 5] = math.log1p(min(state.streak, 64))
    x[:, 6] = np.log1p(i)
    x[:, 7] = state.recent
    if f.breaks is not None:
        b = np.asarray(f.breaks[:n])
        x[:, 8] = b == NEWLINE
        x[:, 9] = b == STOP
    else:
        x[:, 8] = x[:, 9] = 0.0
    x[:, 10] = x[:, 8] * state.recent
    x[:, 11] = 0.0 if f.source == "store" else [state.hazard(t) for t in f.tokens[:n]]
    return x


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


# The prior weights were fitted on prompt lookup's proposals. A draft-store proposal with the same
# features is right more or less often: its counts come from other requests, so a branch point
# (a share under 1: the tool name after `{"tool": "`) says more, and a long context, a long
# streak or deep positions less, than in the request's own text. Corrections for store
# positions, added to the prior logit: bias + len log(ngram_len / 4) + share (share_i - 1) +
# lone [n_occ <= 1] + streak log(1 + streak) + support log(1 + agree_i) + depth log(1 + i).
# Fitted by likelihood on the store's proposals over the recorded sessions
# (`python -m tools.session_replay fit data/recordings/sessions_zen4.json --terms ...`) and checked
# on held-out sessions (data/recordings/sessions_heldout_zen4.json): log loss 0.478 there, against
# 0.558 for the earlier bias + len pair (docs/store.md).
STORE_TERMS = ("bias", "len", "share", "lone", "streak", "support", "depth")
STORE_WEIGHTS = (1.125, -0.586, 3.067, -0.105, -1.068, -0.526, -0.73)


@dataclass(frozen=True)
class AcceptanceConfig:
    weights: tuple = PRIOR_WEIGHTS
    learn_rate: float = 0.03      # step of the online offset per observed position (faster
                                  # steps chased noise in the replay: 0.08 lost 1-2%)
    offset_limit: float = 3.0     # |offset| cap, in logits
    p_floor: float = 0.001
    p_ceil: float = 0.998         # nothing is certain: a copied run ends somewhere
    store_weights: tuple = STORE_WEIGHTS  # corrections of draft-store positions (above)


@dataclass
class AcceptanceModel:
    """Per request. predict() gives p_0..p_{n-1}; observe() feeds back what the verifier (or,
    for a proposal that was not drafted, plain decoding) decided for those positions.

    Online part: one logit offset, moved by the gradient of the log-likelihood of each
    observed position (y - p). Positions after the first rejection are not observed (the
    conditional model says nothing about them)."""

    config: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    offset: float = 0.0
    n_observed: int = 0

    def __post_init__(self):
        self._wl = tuple(float(w) for w in self.config.weights)   # [len(FEATURES)]
        self._pos: dict = {}        # (ngram_len, store offer) -> _position_terms

    def base_logits(self, f: DraftFeatures, n: int, state: RequestState) -> list:
        """[n] prior logits of positions 0..n-1 (no online offset): phis(f, n, state) @ weights,
        in plain floats without building the feature matrix. This runs every step, on 1-16
        positions, where a dozen numpy calls cost more than the arithmetic (~3x, measured)."""
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11 = self._wl
        recent = state.recent
        lone_occ, log_streak = float(f.n_occ <= 1), math.log1p(min(state.streak, 64))
        const = w0 + w3 * lone_occ + w5 * log_streak + w7 * recent
        store = f.source == "store"
        if store:
            sb, sl, s_share, s_lone, s_streak, s_support, _ = self.config.store_weights
            const += sb + sl * math.log(f.ngram_len / 4) + s_lone * lone_occ + \
                s_streak * log_streak + f.trust - s_share
            w2, w4 = w2 + s_share, w4 + s_support
        newline = w8 + w10 * recent
        pos = self._position_terms(f.ngram_len, n, store)
        agree, breaks, tokens = f.agree, f.breaks, f.tokens
        missed, hazard = (None if store else state.missed), state.hazard
        lone = w2 + w4 * _LOG2          # no support counts: one occurrence that agrees
        z, prev = [], f.n_occ
        for i in range(n):
            if agree is None:
                zi = const + lone + pos[i]
            else:
                cur = agree[i]
                zi = const + (w2 * cur / prev if prev > 0 else 0.0) + w4 * math.log1p(cur) + \
                    pos[i]
                prev = cur
            if missed and tokens[i] in missed:
                zi += w11 * hazard(tokens[i])
            if breaks is not None:
                b = breaks[i]
                if b == NEWLINE:
                    zi += newline
                elif b == STOP:
                    zi += w9
            z.append(zi)
        return z

    def _position_terms(self, ngram_len: int, n: int, store: bool = False) -> list:
        """w_log_len log(ngram_len + i) + w_depth log(1 + i) for i < n (or more), the store's
        depth correction added for its offers; per match length and source, computed once."""
        t = self._pos.get((ngram_len, store))
        if t is None or len(t) < n:
            w = self._wl
            depth = w[6] + (self.config.store_weights[6] if store else 0.0)
            t = self._pos[ngram_len, store] = [
                w[1] * math.log(ngram_len + i) + depth * math.log1p(i)
                for i in range(max(n, _POSITIONS))]
        return t

    def probs(self, base: Sequence[float]) -> list:
        """Acceptance probabilities from base_logits(), with the online offset, clipped."""
        c, off = self.config, self.offset
        lo, hi = c.p_floor, c.p_ceil
        return [min(hi, max(lo, _sigmoid(z + off))) for z in base]

    def predict(self, f: DraftFeatures, n: int, state: RequestState,
                base: Optional[Sequence[float]] = None) -> np.ndarray:
        """[n] conditional acceptance probabilities of the first n draft positions."""
        n = min(n, len(f.tokens))
        if n <= 0:
            return np.zeros(0)
        return np.array(self.probs(self.base_logits(f, n, state) if base is None else base[:n]))

    def observe(self, f: DraftFeatures, n_checked: int, n_accepted: int,
                state: RequestState, base: Optional[Sequence[float]] = None) -> None:
        """The first n_accepted of n_checked positions passed; position n_accepted (if it is
        < n_checked) failed. Later positions were not tested on their own: no evidence.
        `base`: base_logits() of this f and state, if already at hand."""
        c = self.config
        n = min(n_checked, n_accepted + 1, len(f.tokens))
        if n <= 0:
            return
        if base is None or len(base) < n:
            base = self.base_logits(f, n, state)
        for i in range(n):
            y = 1.0 if i < n_accepted else 0.0
            p = _sigmoid(float(base[i]) + self.offset)
            self.offset = max(-c.offset_limit, min(c.offset_limit,
                                                   self.offset + c.learn_rate * (y - p)))
            self.n_observed += 1


_POSITIONS = 32       # position terms tabled at first use (k_max is 16 by default)
_LOG2 = math.log(2.0)


def expected_tokens(p: Sequence[float], k: int) -> float:
    """Tokens a step of k drafts emits on average: 1 + p_0 + p_0 p_1 + ... (k terms after 1),
    the recovered or bonus token included.

    >>> expected_tokens([0.5, 0.5], 2)
    1.75
    """
    total, run = 1.0, 1.0
    for i in range(k):
        run *= p[i]
        total += run
    return total


def expected_by_k(p: np.ndarray) -> np.ndarray:
    """[n] E(1..n) at once: 1 + cumulative sums of the prefix products."""
    return 1.0 + np.cumsum(np.cumprod(p))
