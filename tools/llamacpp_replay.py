"""llama.cpp's two n-gram drafters, as the vendored llama.cpp of llama-cpp-python 0.3.36 writes
them, replayed offline beside localspec's adaptive policy (tools/replay.py) on recordings and
several CPU cost curves; and, per case, where localspec pays a step that llama.cpp did not.

    python tools/llamacpp_replay.py data/recordings/policy_heldout3_zen4.json [more.json ...]
        [--curves zen4,zen3,xeon,spr,zen5] [--kinds code-edit] [--per-case] [--json out.json]

ngram-simple (common/ngram-map.cpp, common_ngram_simple_draft; size_n 12, size_m 48): the last 12
tokens of the history (the pending token included) are searched backwards for their most recent
earlier occurrence; if at least 12 tokens follow it in the history before the pending token,
up to 48 of them are drafted, else nothing.
ngram-mod (common/speculative.cpp + ngram-mod.cpp; --spec-default's n_match 24, n_min 48,
n_max 64): a table maps every 24-token window of the history to the token after it (the latest
occurrence wins; the generated text's windows join in chunks, once 32 new tokens exist); the
draft chains lookups from the current 24-token window, and is kept only when at least 48
succeed (up to 64). Five steps in a row accepting under a quarter of their draft clear the table
(it is then rebuilt from the whole history at the next draft). Its table is a 4M-entry hash
without key checks; here a dict (collisions, rare at these sizes, are not modelled).
Both: the draft is cut to the budget left (tokens still to come minus one), verified greedily
(accept while it equals the recorded output), and the step costs r(k); no near-tie guard, no
proposer cost. localspec's policy is replayed by tools/replay.py with tie_margin 0, as it runs
on the CPU with its batch-invariant kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))            # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))  # policy_replay

from tools import replay as rp  # noqa: E402
from localspec.policy.config import K_LIMIT  # noqa: E402

K_LLAMACPP = 64


def _from_ms(ms: dict) -> list:
    """{batch rows: ms} -> r(0..64): r(k) = ms(k + 1) / ms(1), linear between measured sizes,
    the last slope beyond."""
    return rp.extend_curve([1.0], K_LLAMACPP, {rows - 1: v / ms[1] for rows, v in ms.items()})


# r(k) = cost of verifying k drafts over one plain step; Qwen2.5-Coder-1.5B Q4_K_M, 2 threads.
# A pair per CPU: (what localspec's verify batches cost: its batch-invariant ggml-cpu, what
# llama.cpp's cost: its own kernels). Zen 4: both measured in one session to 64 rows
# (docs/policy.md, "llama.cpp's CPU kernels by batch size": the tiled K-quant matmul off under
# 32 rows is what localspec's patch 0002 does, on is llama.cpp's build). The others: the points
# of docs/design.md's table, one curve for both, its last slope (about what a prefill token
# costs) carried on to k = 64.
# 6 and 7 rows were not measured: under the tiled kernel's 8 rows both settings are one kernel,
# so both take the off column's line from 5 to 8 rows.
_ZEN4_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 17, 24, 32, 64)
_ZEN4_ON = (32.6, 55.9, 74.1, 90.6, 113.9, 128.0, 145.0, 217.6, 229.9, 242.0, 264.1, 290.9,
            244.6, 288.0, 363.1, 398.9, 593.3)
_ZEN4_OFF = (32.9, 57.2, 76.2, 90.0, 111.0, 128.0, 145.0, 162.1, 180.9, 199.2, 235.3, 273.9,
             239.6, 263.1, 382.4, 398.9, 593.3)   # 32 and 64 rows: on again from 32 (patch 0002)
_zen3 = rp.extend_curve([1, 1.48, 1.96, 2.22, 2.68], K_LLAMACPP, {8: 5.86, 16: 8.44})
_xeon = rp.extend_curve([1, 1.53, 1.75, 1.8, 2.2], K_LLAMACPP, {8: 3.0, 16: 3.9})
_spr = rp.extend_curve([1, 1.56, 1.74, 1.74, 2.22], K_LLAMACPP, {8: 3.30, 16: 4.17})
# Zen 5 (family 26 model 2): `localspec calibrate --threads 2` of 2026-12-07 (stable, 5 rounds
# within 5.0%), localspec's own kernels, every k to 16 and the sparse ones to 64
# (docs/benchmarks.md, "AMD EPYC Zen 5: issue 63 in two rounds"); llama.cpp's kernels were not
# timed apart there, so one curve stands for both.
_zen5 = rp.extend_curve(
    [1, 1.14, 1.31, 1.42, 1.80, 1.94, 2.12, 2.27, 2.69, 2.83, 2.99, 3.50, 3.90, 4.03, 4.16, 4.18,
     4.74], K_LLAMACPP,
    {20: 5.43, 24: 6.11, 28: 6.86, 31: 7.36, 40: 9.14, 47: 10.27, 56: 12.15, 63: 13.26, 64: 13.79})
CURVES = {
    "zen4": (_from_ms(dict(zip(_ZEN4_ROWS, _ZEN4_OFF))), _from_ms(dict(zip(_ZEN4_ROWS, _ZEN4_ON)))),
    "zen3": (_zen3, _zen3),
    "xeon": (_xeon, _xeon),
    "spr": (_spr, _spr),
    "zen5": (_zen5, _zen5),
}


class NgramSimple:
    """common_ngram_simple_draft, token for token.

    >>> NgramSimple(2, 3).draft([9, 1, 2, 3, 4, 5, 6, 7, 1], 2)     # [1, 2] recurs at 1
    [3, 4, 5]
    """

    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.n, self.m = size_n, size_m

    def begin(self, prompt_tgt: Sequence[int]) -> None:
        pass

    def draft(self, tokens: Sequence[int], last: int) -> list:
        """`tokens`: what the target's KV cache holds; `last`: the token it decodes next."""
        n, cur = self.n, len(tokens)
        if cur <= n + self.m + 1:
            return []
        pattern = list(tokens[cur - n + 1:]) + [last]
        first = pattern[0]
        for j in range(cur - n - 1, 0, -1):           # position 0 never matches
            if tokens[j] == first and list(tokens[j:j + n]) == pattern:
                copy = min(self.m, cur - (j + n))
                return list(tokens[j + n:j + n + copy]) if copy >= n else []
        return []

    def accept(self, n_accepted: int) -> None:
        pass


class NgramMod:
    """common_speculative_impl_ngram_mod (draft_one, accept) over common_ngram_mod."""

    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64):
        self.n, self.n_min, self.n_max = n_match, n_min, n_max
        self.table: dict = {}
        self.i_last = self.n_draft_last = self.n_low = 0

    def _add(self, tokens: Sequence[int], lo: int, hi: int) -> None:
        for i in range(lo, hi):
            self.table[tuple(tokens[i:i + self.n])] = tokens[i + self.n]

    def begin(self, prompt_tgt: Sequence[int]) -> None:
        self.i_last = self.n_draft_last = 0
        if len(prompt_tgt) >= self.n:
            self._add(prompt_tgt, 0, len(prompt_tgt) - self.n)
            self.i_last = len(prompt_tgt) - self.n

    def draft(self, tokens: Sequence[int], last: int) -> list:
        n, cur = self.n, len(tokens)
        self.n_draft_last = 0
        if cur < n:
            return []
        if self.i_last + 32 < cur:                    # new windows join in chunks
            self._add(tokens, self.i_last, cur - n)
            self.i_last = cur - n
        window = list(tokens[cur - n + 1:]) + [last]
        result = []
        for i in range(self.n_max):
            token = self.table.get(tuple(window[i:i + n]))
            if token is None:
                if i < self.n_min:
                    return []
                break
            window.append(token)
            result.append(token)
        self.n_draft_last = len(result)
        return result

    def accept(self, n_accepted: int) -> None:
        if self.n_draft_last > 0:
            if n_accepted / self.n_draft_last < 0.25:
                self.n_low += 1
                if self.n_low >= 5:
                    self.table.clear()
                    self.n_low = self.i_last = 0
            else:
                self.n_low = 0


DRAFTERS = {"llamacpp-simple": NgramSimple, "llamacpp-mod": NgramMod}


def replay_drafter(case: rp.Recorded, drafter, curve: Sequence[float], k_cap: int = K_LLAMACPP,
                   trace: Optional[list] = None) -> rp.CaseScore:
    """llama-speculative-simple's loop on a recorded case, from its second token (the first is
    prefill's, as in tools/replay.py); `trace` collects (t, k, n_accepted, n_emitted) per step."""
    out, n = case.out, len(case.out)
    history = list(case.prompt) + out[:1]
    drafter.begin(case.prompt[:-1])
    score = rp.CaseScore(1.0)
    t = 1
    while t < n:
        draft = drafter.draft(history[:-1], history[-1])[:max(0, min(k_cap, n - t - 1))]
        k = len(draft)
        n_acc = rp.run_length(draft, out, t)
        emitted = out[t:t + n_acc + 1]
        drafter.accept(n_acc)
        if trace is not None:
            trace.append((t, k, n_acc, len(emitted)))
        history += emitted
        t += len(emitted)
        score.steps += 1
        score.spec_steps += k > 0
        score.drafted += k
        score.accepted += n_acc
        score.cost += curve[k]
    score.speedup = (n - 1) / score.cost if score.cost else 1.0
    return score


def paid_positions(trace: Sequence) -> dict:
    """{position: step} of the tokens a policy paid a step for (each step's last token, the one
    the model chose itself)."""
    return {s[0] + s[2]: s for s in trace}


def why_paid(step: tuple, k_max: int = K_LIMIT) -> str:
    """Why localspec paid a step for a token that llama.cpp had drafted and got accepted, from
    localspec's step (t, k, n_accepted, n_emitted, matching run of its offer)."""
    t, k, n_acc, _, run = step
    if run == 0:
        return "no useful match"          # no offer, or its first token was wrong
    if k == 0:
        return "declined a right match"
    if n_acc < k:
        return "its match ran out first"  # drafted, and rejected before this token
    if run > k:
        return "drafted shorter than its match"
    return f"{k_max}-token cap" if k >= k_max else "its match ran out first"


def localspec_policy(prior: Sequence[float], k_max: int = K_LIMIT,
                     settings: Optional[dict] = None):
    """A maker of the adaptive policy (scripts/bench/policy_replay.py's "new") believing `prior`,
    with `settings` changed (policy_replay's --variant keys) and drafts of at most k_max (past
    K_LIMIT a what-if: the limit is lifted in this process)."""
    from policy_replay import make_policies
    import localspec.policy.config as pc
    pc.K_LIMIT = max(pc.K_LIMIT, k_max)
    variant = {**(settings or {}), "k_max": k_max}
    return make_policies(["k"], list(prior[:k_max + 1]), variants={"k": variant})["k"]


def replay_all(cases: Sequence[rp.Recorded], curves: dict, k_cap: int = K_LLAMACPP,
               ours_k_max: int = K_LIMIT, tie_margin: float = 0.0,
               settings: Optional[dict] = None) -> list:
    """A row per (curve, case): each policy's speedup and counts, the bound, and the causes of
    the steps localspec paid where the better llama.cpp drafter had an accepted draft.
    `curves`: {name: (localspec's r(0..64), llama.cpp's)}."""
    rows = []
    for cname, (curve, stock) in curves.items():
        for c in cases:
            ls_trace: list = []
            s = rp.replay_case(c, localspec_policy(curve, ours_k_max, settings),
                               curve[:ours_k_max + 1],
                               tie_margin=tie_margin, trace=ls_trace, propose_cost=0.002,
                               k_max=ours_k_max)
            row = {"curve": cname, "case": c.id, "kind": c.kind, "n": len(c.out),
                   "bound_k16": round(rp.bound_case(c, curve[:17], tie_margin=0.0), 4),
                   "bound_kmax": round(rp.bound_case(c, curve[:ours_k_max + 1], tie_margin=0.0,
                                                     k_max=ours_k_max), 4),
                   "localspec": _counts(s)}
            traces = {}
            for name, make in DRAFTERS.items():
                traces[name] = []
                row[name] = _counts(replay_drafter(c, make(), stock, k_cap, traces[name]))
            best = max(DRAFTERS, key=lambda m: row[m]["speedup"])
            ours = paid_positions(ls_trace)
            theirs = {t + i for (t, k, a, _) in traces[best] for i in range(a)}
            row["best"] = best
            row["paid_where_llamacpp_drafted"] = dict(Counter(
                why_paid(ours[j], ours_k_max) for j in sorted(theirs) if j in ours))
            rows.append(row)
    return rows


def _counts(s: rp.CaseScore) -> dict:
    return {"speedup": round(s.speedup, 4), "steps": s.steps, "spec_steps": s.spec_steps,
            "drafted": s.drafted, "accepted": s.accepted}


def print_tables(rows: list, per_case: bool, k_max: int = K_LIMIT) -> None:
    """The per-case table (per_case) and the per-kind one; k_max: localspec's draft limit in
    the replay, the second bound's (what a future-knowing policy drafting up to it could do)."""
    names = ["localspec", *DRAFTERS]
    if per_case:
        print("| curve | case | n | localspec | llamacpp-simple | llamacpp-mod | bound (k<=16) | "
              f"bound (k<={k_max}) | localspec drafted/accepted | best llama.cpp "
              "drafted/accepted | localspec paid a step where llama.cpp's draft was accepted |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            b = r[r["best"]]
            why = ", ".join(f"{v} {k}" for k, v in sorted(r["paid_where_llamacpp_drafted"].items(),
                                                          key=lambda kv: -kv[1])) or "-"
            print(f"| {r['curve']} | {r['case']} | {r['n']} | "
                  + " | ".join(f"{r[m]['speedup']:.3f}" for m in names)
                  + f" | {r['bound_k16']:.3f} | {r['bound_kmax']:.3f} | "
                  f"{r['localspec']['drafted']}/{r['localspec']['accepted']} | "
                  f"{b['drafted']}/{b['accepted']} | {why} |")
        print()
    print("| curve | kind | cases | localspec | llamacpp-simple | llamacpp-mod | bound (k<=16) | "
          f"bound (k<={k_max}) | localspec / best llama.cpp | cases localspec ahead |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    groups = defaultdict(list)
    for r in rows:
        groups[r["curve"], r["kind"]].append(r)
        groups[r["curve"], "all"].append(r)
    for (cname, kind), rs in groups.items():
        g = {m: rp.geomean([r[m]["speedup"] for r in rs]) for m in names}
        best = max(DRAFTERS, key=lambda m: g[m])
        ahead = sum(r["localspec"]["speedup"] >= max(r[m]["speedup"] for m in DRAFTERS)
                    for r in rs)
        print(f"| {cname} | {kind} | {len(rs)} | " + " | ".join(f"{g[m]:.3f}x" for m in names)
              + f" | {rp.geomean([r['bound_k16'] for r in rs]):.3f}x"
              f" | {rp.geomean([r['bound_kmax'] for r in rs]):.3f}x | "
              f"{g['localspec'] / g[best]:.3f} ({best}) | {ahead}/{len(rs)} |")
    causes = defaultdict(Counter)
    for r in rows:
        causes[r["curve"]].update(r["paid_where_llamacpp_drafted"])
    print()
    for cname, cnt in causes.items():
        print(f"{cname}: steps localspec paid for tokens the better llama.cpp drafter had "
              f"accepted: " + ", ".join(f"{v} {k}" for k, v in cnt.most_common()))


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recordings", nargs="+")
    ap.add_argument("--curves", default="zen4,zen3,xeon,spr",
                    help=f"named curves, comma-separated ({', '.join(CURVES)})")
    ap.add_argument("--curve", action="append", default=[],
                    metavar="NAME=1,r(1),...[/1,r(1),...]",
                    help="another curve, localspec's [/ llama.cpp's when its kernels cost "
                         "otherwise] (extended to k = 64 with the last slope); repeatable")
    ap.add_argument("--kinds", default=None, help="only these kinds (comma-separated)")
    ap.add_argument("--k-cap", type=int, default=K_LLAMACPP,
                    help="cut llama.cpp's drafts to this many tokens")
    ap.add_argument("--localspec-k-max", type=int, default=K_LIMIT,
                    help=f"localspec's draft limit in the replay (K_LIMIT, {K_LIMIT} as shipped; "
                    "16 was the limit before 2026-11-27; a larger one is lifted in this process)")
    ap.add_argument("--tie-margin", type=float, default=0.0,
                    help="localspec's near-tie guard (0: off, as on the CPU with its batch-"
                         "invariant kernels; 0.25: on, as where batches are not trusted)")
    ap.add_argument("--localspec-settings", metavar="key=value,...",
                    help="localspec's policy with these settings changed (policy_replay.py's "
                         "--variant keys, e.g. loss_budget=0.3,min_gain=1.15)")
    ap.add_argument("--per-case", action="store_true")
    ap.add_argument("--json", help="also write every row here")
    a = ap.parse_args(argv)
    curves = {name: CURVES[name] for name in a.curves.split(",") if name}
    for text in a.curve:
        name, _, pts = text.partition("=")
        ours, _, theirs = pts.partition("/")
        pair = [rp.extend_curve([float(x) for x in c.split(",")], K_LLAMACPP)
                for c in (ours, theirs or ours)]
        curves[name] = tuple(pair)
    cases = [dataclass_with_prefix(c, p, len(a.recordings)) for p in a.recordings
             for c in rp.load(p)]
    if a.kinds:
        cases = [c for c in cases if c.kind in a.kinds.split(",")]
    settings = None
    if a.localspec_settings:
        from policy_replay import parse_variants
        settings = parse_variants([f"x:{a.localspec_settings}"])["x"]
    rows = replay_all(cases, curves, a.k_cap, a.localspec_k_max, a.tie_margin, settings)
    print_tables(rows, a.per_case, a.localspec_k_max)
    if a.json:
        Path(a.json).write_text(json.dumps({
            "command": " ".join(["python", "tools/llamacpp_replay.py", *(argv or sys.argv[1:])]),
            "recordings": a.recordings, "k_cap": a.k_cap, "localspec_k_max": a.localspec_k_max,
            "tie_margin": a.tie_margin, "curves": {n: {"localspec": c[0], "llamacpp": c[1]}
                                                   for n, c in curves.items()},
            "rows": rows}) + "\n")
    return 0


def dataclass_with_prefix(c: rp.Recorded, path: str, n_files: int) -> rp.Recorded:
    import dataclasses
    return c if n_files == 1 else dataclasses.replace(c, id=f"{Path(path).stem}/{c.id}")


if __name__ == "__main__":
    sys.exit(main())
