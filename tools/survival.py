"""How well the acceptance prior predicts a draft's survival, by kind and by the run of right
guesses a request is on: predicted chance that drafts 0..j-1 all pass against how often they
did, on recorded plain outputs (no policy in the loop, so no policy's choices bias it).

    python tools/survival.py data/recordings/policy_plain_zen4.json [more.json ...]
        [--kinds code-edit,summarize] [--depths 1,4,16,32,63] [--weights w0,w1,...] [--json F]

The recording is stepped through a token at a time, as the offline fit does (tools/replay.py,
training_rows): at every position where the n-gram matcher has a proposal, the prior's
conditional p_i over the proposal's first 64 positions gives the predicted survival S(j) =
p_0 ... p_{j-1}, and the recorded output says whether the first j drafts would all have
passed. Rows: the request's current streak (output tokens guessed right in a row before the
proposal). Each cell is "predicted / real (n)", n the proposals at least j tokens long.
What a policy decides on is this curve: it drafts deep only where S(j) stays high. A prior can
fit the per-position log loss well and still be several times off here, and differently per
kind (docs/policy.md, "Survival by kind").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))            # the repository

from tools import replay as rp  # noqa: E402
from localspec.policy.acceptance import AcceptanceConfig, AcceptanceModel  # noqa: E402

STREAKS = ((0, 0), (1, 4), (5, 12), (13, 30), (31, None))
DEPTHS = (1, 4, 16, 32, 63)
MAX_DEPTH = 64


def streak_label(lo: int, hi: Optional[int]) -> str:
    return str(lo) if hi == lo else f"{lo}+" if hi is None else f"{lo}-{hi}"


def _bucket(streak: int) -> int:
    for b, (lo, hi) in enumerate(STREAKS):
        if streak >= lo and (hi is None or streak <= hi):
            return b
    raise AssertionError(streak)


def survival_table(cases: Sequence[rp.Recorded], weights: Optional[Sequence[float]] = None,
                   depths: Sequence[int] = DEPTHS) -> dict:
    """{kind: {(streak bucket, depth): [predicted sum, real count, n]}} over the cases."""
    config = AcceptanceConfig() if weights is None else AcceptanceConfig(weights=tuple(weights))
    model = AcceptanceModel(config)      # the prior alone: its online offset stays at 0
    table: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0, 0]))
    deepest = max(depths)
    for case in cases:
        for t, f, state in rp.plain_proposals(case, k_max=MAX_DEPTH):
            run = rp.run_length(f.tokens, case.out, t)
            cells, b, s = table[case.kind], _bucket(state.streak), 1.0
            for j, pj in enumerate(model.predict(f, deepest, state), 1):
                s *= float(pj)
                if j in depths:
                    cell = cells[b, j]
                    cell[0] += s
                    cell[1] += run >= j
                    cell[2] += 1
    return table


def print_table(table: dict, depths: Sequence[int] = DEPTHS) -> None:
    for kind in sorted(table):
        cells = table[kind]
        print(f"\n{kind}: predicted / real survival of the first j drafts (proposals)")
        print("| streak | " + " | ".join(f"j = {j}" for j in depths) + " |")
        print("|---" * (len(depths) + 1) + "|")
        for b, (lo, hi) in enumerate(STREAKS):
            row = []
            for j in depths:
                pred, real, n = cells.get((b, j), (0.0, 0, 0))
                row.append(f"{pred / n:.2f} / {real / n:.2f} ({n})" if n else "-")
            print(f"| {streak_label(lo, hi)} | " + " | ".join(row) + " |")


def as_json(table: dict) -> dict:
    return {kind: [{"streak": streak_label(*STREAKS[b]), "depth": j, "predicted": round(p / n, 4),
                    "real": round(r / n, 4), "n": n}
                   for (b, j), (p, r, n) in sorted(cells.items()) if n]
            for kind, cells in table.items()}


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", metavar="recording.json")
    ap.add_argument("--kinds", help="comma-separated kinds (default: every kind recorded)")
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)),
                    help=f"the draft lengths j to report, 1..{MAX_DEPTH - 1} (default %(default)s)")
    ap.add_argument("--weights", help="a prior to judge instead of the shipped one: "
                                      "len(FEATURES) comma-separated weights")
    ap.add_argument("--json", help="also write the table here")
    a = ap.parse_args(argv)
    try:
        depths = tuple(int(v) for v in a.depths.split(","))
        if not all(1 <= j < MAX_DEPTH for j in depths):
            raise ValueError
    except ValueError:
        raise SystemExit(f"error: --depths {a.depths!r}: expected integers 1..{MAX_DEPTH - 1}, "
                         "comma-separated")
    weights = None
    if a.weights:
        from localspec.policy.acceptance import FEATURES
        try:
            weights = [float(v) for v in a.weights.split(",")]
        except ValueError:
            weights = []
        if len(weights) != len(FEATURES):
            raise SystemExit(f"error: --weights: expected {len(FEATURES)} numbers "
                             f"({', '.join(FEATURES)})")
    cases = []
    for path in a.paths:
        try:
            cases += rp.load(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"error: cannot read the recording {path}: {e!r:.200}")
    if a.kinds:
        kinds = set(a.kinds.split(","))
        cases = [c for c in cases if c.kind in kinds]
    if not cases:
        raise SystemExit("error: no recorded case of those kinds")
    table = survival_table(cases, weights, depths)
    print_table(table, depths)
    if a.json:
        Path(a.json).write_text(json.dumps(as_json(table), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
