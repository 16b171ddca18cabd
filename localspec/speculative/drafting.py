"""The draft policy an engine gives each request: per-request acceptance model and regret guard
(policy/adaptive.py) on one cost model the engine's requests share, which starts from the
calibrated curve of this model/device/threads and learns from every step's timing. A draft model
that cannot pay on this device is dropped here, once, when the curve is first known.
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
from .config import EngineConfig
from .factory import fit_to_device
from .proposers import Proposer


class Drafting:
    """Builds each request's AdaptivePolicy; owns what is learnt across requests (the machine's
    verify cost and the draft model's cost per token)."""

    def __init__(self, config: EngineConfig, progress: Optional[Callable[[str], None]] = None):
        self.config, self._progress = config, progress
        self.cost: Optional[CostModel] = None   # learns this machine across requests
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
        return AdaptivePolicy(self.cost, config, rules), proposer

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
        self._draft_cost = proposer.draft_cost(curve, self._progress)
