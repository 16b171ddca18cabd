"""What a benchmark reports: a row per (case, mode) compared with plain decoding and the peer,
per-kind summaries (geometric means, worst case, identity), Markdown tables and the bar chart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from ..errors import LocalspecError
from .timing import Outcome
from .workloads import KINDS, Case


@dataclass
class Row:
    case: str
    kind: str
    mode: str
    prompt_tokens: int
    generated_tokens: int
    ttft_ms: float
    decode_tps: float
    ratio: Optional[float]            # decode tok/s over plain's on the same case
    vs_peer: Optional[float]          # decode tok/s over the peer's on the same case
    mean_accepted_len: Optional[float]
    acceptance_rate: Optional[float]
    identical: Optional[bool]         # None: plain itself, or not comparable (sampled peer)
    diverge_at: Optional[int] = None  # first output token index that differs from plain
    top2_gap: Optional[float] = None  # plain path's top-2 logit gap there
    text_identical: Optional[bool] = None   # same text as plain (the peer's stream can differ)
    stop_reason: str = ""
    load_avg: Optional[float] = None  # 1-minute load average after the case: other work running
    rounds: int = 1                   # > 1: tok/s and ratios are medians over the rounds
    ratio_range: Optional[list] = None   # [lowest, highest] per-round ratio to plain
    text: str = ""
    stats: dict = field(default_factory=dict)
    session: Optional[str] = None     # the workload session the case belongs to
    settings: str = ""                # what chose the drafts: the policy or the tool's settings
    cost_curve: Optional[dict] = None  # an adaptive mode's verify cost after the case (curve())


def group_of(row: Row) -> str:
    """What a summary line covers: the session ("session agent") or the case's kind."""
    return f"session {row.session}" if row.session else row.kind


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing element, len of the shorter if one is a prefix, None if equal.

    Example: [1, 2, 3], [1, 5] -> 1; [1, 2], [1, 2, 3] -> 2; [1], [1] -> None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def make_row(case: Case, mode, prompt_tokens: int, out: Outcome,
             plain: Optional[Outcome], peer: Optional[Outcome], greedy: bool,
             ref: Optional[Outcome] = None) -> Row:
    """The row of one (case, mode) run. Its ratio is over `ref` when given (a llama.cpp mode's
    over llamacpp-plain), else over plain; identity is always against localspec's plain."""
    st = out.stats
    row = Row(case.id, case.kind, mode.name, prompt_tokens, out.generated_tokens,
              round(out.ttft_ms, 1), round(out.decode_tps, 2), None, None,
              round(st.mean_accepted_len, 3) if st and mode.name != "plain" else None,
              round(st.acceptance_rate, 4) if st and mode.name != "plain" else None,
              None, stop_reason=out.stop_reason, text=out.text,
              stats=st.to_dict() if st else {}, session=case.session)
    ref = ref if ref is not None else plain
    if ref is not None and ref is not out:
        row.ratio = _ratio(out.decode_tps, ref.decode_tps)
    if plain is not None and plain is not out:
        row.text_identical = out.text == plain.text
        if getattr(mode, "is_llamacpp", False):
            # a child process: its text is all there is (greedy only: its sampler is not ours)
            row.identical = row.text_identical if greedy else None
        elif not mode.is_peer:        # greedy, or seeded: same seed, same tokens
            row.identical = out.tokens == plain.tokens
        elif greedy and out.tokens is not None:
            # the peer's last token is not observable: its tokens but the last, and its count
            seen = len(out.tokens)
            row.identical = out.generated_tokens == plain.generated_tokens and \
                out.tokens == plain.tokens[:seen]
    if peer is not None and not mode.is_peer:
        row.vs_peer = _ratio(out.decode_tps, peer.decode_tps)
    return row


def merge_rounds(row: Row, mode, rounds: Sequence[dict], peer_name: Optional[str],
                 ref_name: str = "plain") -> None:
    """Row of the first round -> the median over rounds ({mode name: Outcome} each). Each round's
    ratio compares runs made next to each other, so the median of per-round ratios is what drift
    of a shared machine spoils least; identity must hold in every round."""
    row.rounds = len(rounds)
    row.decode_tps = round(_median([o[mode.name].decode_tps for o in rounds]), 2)
    if row.ratio is not None:
        ratios = [_ratio(o[mode.name].decode_tps, o[ref_name].decode_tps) for o in rounds]
        ratios = [r for r in ratios if r is not None]
        if ratios:
            row.ratio = round(_median(ratios), 3)
            row.ratio_range = [min(ratios), max(ratios)]
    if row.vs_peer is not None:
        vs = [_ratio(o[mode.name].decode_tps, o[peer_name].decode_tps) for o in rounds]
        vs = [v for v in vs if v is not None]
        row.vs_peer = round(_median(vs), 3) if vs else None
    if row.identical is not None and getattr(mode, "is_llamacpp", False):
        row.identical = all(o[mode.name].text == o["plain"].text for o in rounds)
    elif row.identical is not None and not mode.is_peer:
        row.identical = all(o[mode.name].tokens == o["plain"].tokens for o in rounds)


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _ratio(a: float, b: float) -> Optional[float]:
    return round(a / b, 3) if a > 0 and b > 0 else None


def geomean(values: Iterable[float]) -> Optional[float]:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def summarize(rows: Sequence[Row]) -> list:
    """Per kind (and "all") and mode: geometric-mean ratio to plain, the worst case, geometric-
    mean ratio to the peer, and how many outputs were identical to plain."""
    out = []
    kinds = [k for k in KINDS if any(group_of(r) == k for r in rows)]
    kinds += sorted({group_of(r) for r in rows} - set(KINDS))
    modes = list(dict.fromkeys(r.mode for r in rows))
    for kind in kinds + ["all"]:
        for mode in modes:
            sel = [r for r in rows if r.mode == mode and kind in (group_of(r), "all")]
            if not sel:
                continue
            rated = [r for r in sel if r.ratio is not None]
            worst = min(rated, key=lambda r: r.ratio) if rated else None
            checked = [r for r in sel if r.identical is not None]
            g, gp = geomean(r.ratio for r in sel), geomean(r.vs_peer for r in sel)
            out.append({
                "kind": kind, "mode": mode, "cases": len(sel),
                "geomean_ratio": round(g, 3) if g else None,
                "worst_ratio": worst.ratio if worst else None,
                "worst_case": worst.case if worst else None,
                "geomean_vs_peer": round(gp, 3) if gp else None,
                "identical": sum(bool(r.identical) for r in checked) if checked else None,
                "compared": len(checked),
                "decode_tps": round(geomean(r.decode_tps for r in sel) or 0.0, 2),
                **mechanism(sel),
            })
    return out


def mechanism(rows: Sequence[Row]) -> dict:
    """Why a mode ran at its speed, over its rows: the mean draft of the steps that drafted,
    the share of drafted tokens accepted, tokens per step, the settings that chose the drafts
    and (adaptive modes) the cost curve the last row ended with."""
    total = {key: sum(r.stats.get(key, 0) for r in rows)
             for key in ("drafted", "spec_steps", "accepted", "steps", "step_tokens")}
    settings = next((r.settings for r in rows if r.settings), "")
    curve = next((r.cost_curve for r in reversed(rows) if r.cost_curve), None)
    return {"mean_draft": round(total["drafted"] / total["spec_steps"], 2)
            if total["spec_steps"] else None,
            "acceptance": round(total["accepted"] / total["drafted"], 4)
            if total["drafted"] else None,
            "tokens_per_step": round(total["step_tokens"] / total["steps"], 3)
            if total["steps"] else None,
            "settings": settings, "cost_curve": curve}


SHOWN_K = (1, 3, 7, 15, 31, 63)   # the sizes a table shows of a cost curve


def curve_text(curve: Optional[dict]) -> str:
    """A cost curve record in a few words: where it came from, r at SHOWN_K as calibrated, and
    as learned by the end if it moved (the probes that found it out).

    >>> curve_text({"source": "first slice", "calibrated": [1.0, 1.06, 2.59, 6.26],
    ...             "learned": [1.0, 1.23, 1.36, 1.49], "probes": 2})
    'first slice r(1,3) 1.06 6.26 -> learned 1.23 1.49 (2 probes)'
    """
    if not curve:
        return "-"
    cal, learned = curve.get("calibrated") or [], curve.get("learned") or []
    ks = [k for k in SHOWN_K if k < len(cal)]
    text = f"{curve.get('source', '')} r({','.join(map(str, ks))}) " + \
        " ".join(f"{cal[k]:.2f}" for k in ks)
    if learned and any(abs(learned[k] / cal[k] - 1) > 0.02 for k in ks if k < len(learned)):
        text += " -> learned " + " ".join(f"{learned[k]:.2f}" for k in ks if k < len(learned))
    if curve.get("probes"):
        text += f" ({curve['probes']} probe{'s' * (curve['probes'] != 1)})"
    return text.strip()



def versus_llamacpp(rows: Sequence[Row]) -> list:
    """Per kind (and "all") and speculative localspec mode: the geometric mean over the cases
    both ran of (its ratio to plain) / (each llama.cpp mode's ratio to llamacpp-plain), and
    "best": over the llama.cpp mode with the higher geometric mean in that kind (the smaller of
    the quotients). Above 1: localspec's speculation gains more over its plain decoding than
    llama.cpp's over its own.

    Example: code-edit, ngram 1.50x, llamacpp-mod 1.40x, llamacpp-simple 1.25x on one case ->
    {"kind": "code-edit", "mode": "ngram", "cases": 1, "vs": {"llamacpp-mod": 1.071,
    "llamacpp-simple": 1.2}, "vs_best": 1.071}."""
    theirs = [m for m in dict.fromkeys(r.mode for r in rows)
              if m.startswith("llamacpp-") and m != "llamacpp-plain"]
    ours = [m for m in dict.fromkeys(r.mode for r in rows)
            if m != "plain" and not m.startswith(("llamacpp-", "peer"))]
    ratio = {(r.case, r.mode): r.ratio for r in rows if r.ratio}
    kinds = [k for k in KINDS if any(group_of(r) == k for r in rows)]
    kinds += sorted({group_of(r) for r in rows} - set(KINDS))
    out = []
    for kind in kinds + ["all"]:
        cases = list(dict.fromkeys(r.case for r in rows if kind in (group_of(r), "all")))
        for mode in ours if theirs else ():
            vs = {}
            for t in theirs:
                both = [c for c in cases if (c, mode) in ratio and (c, t) in ratio]
                g = geomean(ratio[(c, mode)] / ratio[(c, t)] for c in both)
                if g:
                    vs[t] = round(g, 3)
            n = sum((c, mode) in ratio for c in cases)
            if vs:
                out.append({"kind": kind, "mode": mode, "cases": n, "vs": vs,
                            "vs_best": min(vs.values())})
    return out



# -- tables and plots --------------------------------------------------------------------------
def _fmt(v, spec: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _identity(r) -> str:
    if r.identical is None:
        return "-"
    if r.identical:
        return "yes" if r.text_identical is not False else "yes (text differs)"
    if r.diverge_at is None:
        return "NO (text)"            # llama.cpp's tool: only its text is known
    gap = "" if r.top2_gap is None else f", gap {r.top2_gap:.3f}"
    return f"NO @{r.diverge_at}{gap}"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h)
              for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(row) for row in body])


def format_rows(rows) -> str:
    """Per case and mode, as a Markdown table."""
    ranged = any(r.ratio_range for r in rows)
    header = ["case", "kind", "mode", "prompt", "gen", "TTFT ms", "tok/s", "x plain",
              *(["rounds' range"] if ranged else []), "x peer", "mean draft", "acc len",
              "acc rate", "identical"]
    body = [[r.case, r.kind, r.mode, str(r.prompt_tokens), str(r.generated_tokens),
             f"{r.ttft_ms:.0f}", f"{r.decode_tps:.2f}", _fmt(r.ratio),
             *([_range(r.ratio_range)] if ranged else []), _fmt(r.vs_peer),
             _fmt(mechanism([r])["mean_draft"], ".1f"), _fmt(r.mean_accepted_len),
             _fmt(r.acceptance_rate, ".0%"), _identity(r)]
            for r in rows]
    return _table(header, body)


def _range(pair) -> str:
    return "-" if not pair else f"{pair[0]:.2f}-{pair[1]:.2f}"


def format_summary(summary) -> str:
    """Per kind and mode: geometric means, worst case, identity count, and why (the mean draft,
    acceptance, tokens a step), as a Markdown table; then, per mode, what chose its drafts."""
    header = ["kind", "mode", "cases", "tok/s (geomean)", "x plain (geomean)", "worst x plain",
              "x peer (geomean)", "identical to plain", "mean draft", "accepted",
              "tokens/step"]
    body = []
    for s in summary:
        worst = "-" if s["worst_ratio"] is None else f"{s['worst_ratio']:.2f} ({s['worst_case']})"
        ident = "-" if s["identical"] is None else f"{s['identical']}/{s['compared']}"
        body.append([s["kind"], s["mode"], str(s["cases"]), f"{s['decode_tps']:.2f}",
                     _fmt(s["geomean_ratio"]), worst, _fmt(s["geomean_vs_peer"]), ident,
                     _fmt(s.get("mean_draft"), ".1f"), _fmt(s.get("acceptance"), ".0%"),
                     _fmt(s.get("tokens_per_step"))])
    modes = {s["mode"]: s for s in summary if s["kind"] == "all"}
    how = [[m, s.get("settings") or "-", curve_text(s.get("cost_curve"))]
           for m, s in modes.items() if s.get("settings") or s.get("cost_curve")]
    table = _table(header, body)
    return table + ("\n\n" + _table(["mode", "drafts chosen by", "verify cost curve"], how)
                    if how else "")


def format_versus(versus) -> str:
    """versus_llamacpp()'s answer as a Markdown table."""
    theirs = list(dict.fromkeys(t for v in versus for t in v["vs"]))
    header = ["kind", "mode", "cases", *(f"x {t} (geomean)" for t in theirs), "x best llama.cpp"]
    body = [[v["kind"], v["mode"], str(v["cases"]), *(_fmt(v["vs"].get(t), ".3f") for t in theirs),
             _fmt(v["vs_best"], ".3f")] for v in versus]
    return _table(header, body)


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LocalspecError("--plot needs matplotlib: pip install 'localspec[plot]' "
                             "(or drop --plot).") from None


def plot_ratios(rows, path: Path) -> None:
    """Grouped bars: one group per case (ordered by kind), one bar per non-plain mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in rows))
    modes = [m for m in dict.fromkeys(r.mode for r in rows) if m != "plain"]
    ratio = {(r.case, r.mode): r.ratio or 0.0 for r in rows}
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(cases) + 2), 4.5))
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(cases))]
        ax.bar(xs, [ratio.get((c, mode), 0.0) for c in cases], width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("decode tokens/s / plain")
    ax.set_title("localspec bench: speed relative to plain decoding")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
