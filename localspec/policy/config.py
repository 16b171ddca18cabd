"""The draft policy's settings, in one frozen dataclass: how many tokens a step may draft, the
n-gram policy's constants (adaptive.py) and the draft model's scalar estimate's
(draft_estimate.py). K_LIMIT is the one cap on a draft's length, checked where requests enter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .acceptance import AcceptanceConfig

K_LIMIT = 64    # the most drafts one verify batch may carry: the calibrated curve's length; a
                # request asking for more (CLI --k, protocol k, HTTP localspec.k) is refused.
                # Past 31 drafts a batch stays exact by raising ggml-cpu's invariant row limit
                # for that decode (llama/exact_rows.exact_for); on code edits the
                # copy runs for hundreds of tokens and a 64-token draft costs ~14 decodes, not
                # 64 (docs/policy.md, "Drafts past 16")


@dataclass(frozen=True)
class GuardConfig:
    """The regret guard (adaptive.RegretGuard): when speculation is switched off for a while."""

    decay: float = 0.85           # per speculative step: the guard judges the last ~7
    min_steps: int = 6            # speculative steps before the first judgement
    threshold: float = 0.9        # realised gain under this: back off (the acceptance model
                                  # is trusted near break-even; the guard catches a bad prior)
    backoff: int = 24             # plain steps before speculating again; doubles per failure
    backoff_max: int = 384
    step_cap: float = 2.0         # a step weighs at most this many plain steps' time in the
                                  # window: one deep draft that misses is one piece of evidence,
                                  # not the verdict (seen: one 15-token miss paused a summary
                                  # running at 1.2x for 24 steps)


@dataclass(frozen=True)
class PolicyConfig:
    """Every setting of the draft policy. k_max and fixed_k apply to every proposer; the n-gram
    fields to prompt lookup's proposals (adaptive.AdaptivePolicy); the draft_* fields to a draft
    model's (draft_estimate.DraftPolicy: one running acceptance estimate per source)."""

    k_max: int = K_LIMIT              # the most drafts a step may verify (<= K_LIMIT)
    fixed_k: Optional[int] = None     # set: always draft this many (no adaptation, no guard)
    # n-gram proposals
    min_gain: float = 1.1             # predicted speed over plain that a draft must beat: the
                                      # drafts taken are those predicted best, and in prose they
                                      # are accepted less than predicted (held-out replay)
    loss_budget: float = 0.4          # plain steps a draft may risk per token of the longest
                                      # copied run the request has shown (+1): deep drafts on
                                      # steep CPUs wait for evidence that the text copies
    loss_budget_long: float = 1.0     # the same while the current run of right guesses is at
    long_run: int = 16                # least long_run: a copy in progress ramps up to 32-64
                                      # drafts in fewer steps (llama.cpp's ngram-simple drafts
                                      # 48 after a 12-token match; docs/policy.md, issue 45)
    long_lines: int = 2               # or holds this many line breaks (0: off): a block of
                                      # lines copied whole, where a quote in prose ends at the
                                      # line break (the Zen 4 curve's code edits: 1.047 -> 1.054
                                      # of llama.cpp's best over 32 cases, prose unchanged)
    store_evidence: int = 2           # a draft-store offer whose first tokens followed this
                                      # context at least this often before counts them as a
                                      # run of right guesses the request has shown (the loss
                                      # budget); 0: only the request's own runs count
    probe_share: float = 0.02         # decode time probes may lose at most: once the steps
                                      # disagree with the cost curve, on text being copied, now
    probe_timed: float = 0.5          # and then a draft of 1, 3, 7, ..., 63 (the nearest to the
                                      # chosen k with fewer recent timings than this), so a curve
                                      # that overstates some batches is found out (explore.py)
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    # a draft model's proposals
    draft_prior: float = 0.6          # acceptance assumed before any evidence
    draft_prior_weight: float = 2.0   # how many observations the prior is worth
    draft_decay: float = 0.95         # per-observation forgetting: text changes character
    draft_min_gain: float = 1.02      # a step drafts only when the estimate promises this gain
    draft_best_acceptance: float = 0.9  # a draft model must promise draft_pays_gain at this
    draft_pays_gain: float = 1.1        # acceptance, or it is dropped: its prefill, KV catch-up
                                        # and probes are not in the per-token cost model
    probe_every: int = 128            # a draft model that is off still tries k=1 this often:
                                      # a probe first catches the draft up over the idle stretch
                                      # (measured: 2.3-3.2 s for ~128 tokens, 0.5B on 2 cores)

    def __post_init__(self):
        if not 1 <= self.k_max <= K_LIMIT:
            raise ValueError(f"k_max must be 1..{K_LIMIT}, got {self.k_max}")
        if self.fixed_k is not None and not 0 <= self.fixed_k <= self.k_max:
            raise ValueError(f"fixed_k must be 0..{self.k_max}, got {self.fixed_k}")
