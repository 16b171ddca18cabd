"""The draft policy an engine gives each request, and its use at every step: Drafting builds a
request's acceptance model and regret guard (policy/adaptive.py) on the cost model its requests
share; propose() picks each step's draft, observe() teaches the policy what the step did.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from ..llama import Context
from ..policy.adaptive import AdaptivePolicy
from ..policy.calibrate import first_run_budget, load_or_measure
from ..policy.config import PolicyConfig
from ..policy.costmodel import CostConfig, CostModel
from ..policy.draft_estimate import DraftPolicy
from ..policy.explore import Exploration
from .config import EngineConfig
from .factory import fit_to_device
from .proposers import EMPTY, Proposal, Proposer
from .step import StepResult


class Drafting:
    """Builds each request's AdaptivePolicy; owns what is learnt across requests (the machine's
    verify cost and the draft model's cost per token). The cost model starts from the calibrated
    curve of this model/device/threads and learns from every step's timing. A draft model that
    cannot pay on this device is dropped here, once, when the curve is first known."""

    def __init__(self, config: EngineConfig, progress: Optional[Callable[[str], None]] = None):
        self.config, self._progress = config, progress
        self.cost: Optional[CostModel] = None   # learns this machine across requests
        self.explore: Optional[Exploration] = None   # its probes of other draft lengths
        self.curve = None                       # the calibration it started from (bench record)
        self._draft_cost = 0.0
        self._measuring = threading.Lock()      # slots sharing this object measure once

    def policy(self, ctx: Context, proposer: Proposer, override: Optional[PolicyConfig] = None
               ) -> tuple:
        """(the request's policy, the proposer to run): the proposer may lose its draft model
        here, and then be None (no speculation left)."""
        config = override or self.config.policy
        if config.fixed_k is not None:    # no choice to make: no cost curve to measure
            flat = [1.0] * (config.k_max + 1)
            return AdaptivePolicy(CostModel(flat, config=CostConfig(online=False)), config,
                                  DraftPolicy(flat, config)), proposer
        with self._measuring:            # --parallel's slots share this object: one measures
            if self.cost is None:
                self._measure(ctx, proposer)
        rules = DraftPolicy(self.cost.prior.tolist(), config, self._draft_cost)
        proposer = fit_to_device(proposer, rules)
        if proposer is None:
            return None, None
        if not proposer.uses_draft_model:
            self._draft_cost = 0.0
        return AdaptivePolicy(self.cost, config, rules, self.explore), proposer

    def _measure(self, ctx: Context, proposer: Proposer) -> None:
        """The cost curve (cached, or timed now) and what the proposer's drafting costs. The
        slot measuring is held busy, so that other slots' ticks never pad rows into it."""
        with ctx.hold():
            curve = load_or_measure(ctx, self.config.n_gpu_layers, self.config.policy.k_max,
                                    progress=self._progress, budget_s=first_run_budget())
        st = curve.notes.get("stability")     # a rough or unfinished curve: trust the steps
        rough = (st is not None and st.noisy) or not curve.notes.get("complete", True)
        self.cost = CostModel(curve.ratios, curve.ms_per_step,
                              CostConfig(online=self.config.refit_cost), noisy=rough)
        policy = self.config.policy      # probes need timings: none with refit_cost off
        self.explore = Exploration(policy.probe_share if self.config.refit_cost else 0.0,
                                   policy.probe_timed)
        self.curve = curve
        self._draft_cost = proposer.draft_cost(curve, self._progress)


def propose(ctx: Context, proposer: Proposer, policy: AdaptivePolicy, room: int) -> Proposal:
    """The draft length's one way: the proposer offers, the policy chooses k, the proposer
    drafts k. An offer not taken goes to the plain step, which says what it would have
    scored (the acceptance model learns while speculation is off)."""
    passed, best, lookup = EMPTY, None, None
    for offer in proposer.offers(min(room, policy.config.k_max)):
        if offer.features is None and best is not None:
            break                    # a draft model only fills in where lookup has nothing
        k, gain = policy.choose_scored(offer)        # sources compete by predicted gain
        if k > 0 and (best is None or gain > best[2]):
            best = (offer, k, gain)
        elif passed is EMPTY and offer.features is not None:
            passed = Proposal([], None, offer.source, offer.features)
            lookup = offer
    # A slot of a shared context: rows the coming tick carries anyway are free to fill with
    # more of a lookup match (drafting it costs nothing); a lone context says k.
    chosen = best[1] if best is not None else 0
    free = ctx.free_drafts(chosen, min(room, policy.config.k_max))
    if free > chosen:
        if best is None and lookup is not None:
            best = (lookup, 0, 0.0)
        if best is not None and best[0].features is not None:
            best = (best[0], max(chosen, min(free, best[0].limit)), best[2])
    return proposer.draft(best[0], best[1]) if best is not None else passed


def observe(policy: AdaptivePolicy, proposal: Proposal, result: StepResult,
            propose_ms: float) -> None:
    """Update the policy from one step: acceptance, the guard and the cost curve's refit
    (the draft store's learning is the proposer's, config.learn)."""
    if proposal.source == "draft":     # the draft model keeps its scalar estimate
        if result.n_drafted:
            policy.draft.observe("draft", result.n_drafted, result.n_accepted)
        return
    # n-gram proposals and plain steps: acceptance, the guard and the cost curve update
    policy.observe_step(proposal.features, result.n_drafted, result.n_accepted,
                        result.emitted, result.verify_ms, propose_ms)
