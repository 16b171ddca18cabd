"""Why a bench mode ran at its speed, beside the speed: what chose its drafts (the adaptive
policy's settings, a fixed k, llama.cpp's drafter) and the verify cost curve an adaptive mode
started from and learned. report.py puts them in its tables.
"""

from __future__ import annotations

from typing import Optional

from .llamacpp import SETTINGS as LLAMACPP_SETTINGS
from .peer import PEER_K


def mode_settings(mode, engine) -> str:
    """What chose a mode's drafts, in a few words ("" for plain decoding)."""
    if mode.is_llamacpp:
        return LLAMACPP_SETTINGS[mode.name]
    if mode.is_peer:
        return f"LlamaPromptLookupDecoding, k = {mode.fixed_k or PEER_K}"
    if mode.proposer == "none" or engine is None:
        return ""
    p = engine.config.policy
    if p.fixed_k is not None:
        return f"{mode.proposer}, k = {p.fixed_k} every step"
    return (f"{mode.proposer}, adaptive k <= {p.k_max}: min_gain {p.min_gain:g}, loss budget "
            f"{p.loss_budget:g} ({p.loss_budget_long:g} in runs of {p.long_run}+"
            f"{f' or {p.long_lines}+ lines' if p.long_lines else ''}), probes "
            f"<= {100 * p.probe_share:g}% of decode time")


def curve_record(engine) -> Optional[dict]:
    """An engine's verify cost curve: its calibration (where from: finished, or still in slices;
    noisy or not; how many of its samples were dropped as implausible), what the steps have
    taught its cost model since, and the probes that did (explore.py). None: no curve (plain,
    a fixed k, or no request yet)."""
    drafting = getattr(engine, "drafting", None)
    if drafting is None or drafting.curve is None or drafting.cost is None:
        return None
    notes = drafting.curve.notes
    st = notes.get("stability")
    source = "calibrated" if notes.get("complete", True) else "sliced, unfinished"
    if st is not None and st.noisy:
        source += ", noisy"
    return {"source": source, "calibrated": list(drafting.curve.ratios),
            "learned": [round(r, 3) for r in drafting.cost.ratios()],
            "ms_per_step": round(drafting.curve.ms_per_step, 3),
            "dropped_samples": notes.get("dropped", 0),
            "probes": drafting.explore.n_probes if drafting.explore is not None else 0}
