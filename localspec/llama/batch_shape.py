"""How a batch of several sequences' steps is shaped for llama.cpp, and what a shape costs.

With a KV buffer per sequence (slots.py), llama.cpp splits a batch into parts that each take
the same number of rows from a run of consecutive sequence ids (llama_batch_allocr::split_equal
with `sequential`, src/llama-batch.cpp of the vendored llama.cpp): steps of 1, 1 and 9 rows for
sequences 0, 1, 2 run as 3 rows (1 each), then 8 rows of sequence 2 — two passes over the
weights. Padding every sequence of the span to the longest step (rows whose results are thrown
away, idle sequences in the gap included) makes it one pass. Which is cheaper depends on the
machine's curve of batch cost by rows: plan() compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

RowCost = Callable[[int], float]     # cost of one pass of n rows, in one-token decodes


def default_row_cost(n: int) -> float:
    """A middling CPU curve (between the Xeon's and the AMD parts' measured ones) for when no
    calibration is at hand."""
    return 1.0 + 0.3 * (n - 1)


def split_cost(lengths: Dict[int, int], cost: RowCost) -> float:
    """The cost of llama.cpp's own split of steps `lengths` (seq id -> rows)."""
    left = {s: n for s, n in lengths.items() if n > 0}
    total = 0.0
    while left:
        run = [min(left)]
        while run[-1] + 1 in left:
            run.append(run[-1] + 1)
        m = min(left[s] for s in run)
        total += cost(m * len(run))
        for s in run:
            left[s] -= m
            if left[s] == 0:
                del left[s]
    return total


def plan(lengths: Dict[int, int], free: Dict[int, int], cost: RowCost,
         row_cap: int) -> Optional[int]:
    """The row count to pad every sequence from min(lengths) to max(lengths) to, or None to
    send the steps as they are. `free`: cells each sequence has left (an idle one in the gap
    is padded too, its rows dropped after); padding never passes row_cap rows in all."""
    if len(lengths) < 2:
        return None
    lo, hi = min(lengths), max(lengths)
    width = max(lengths.values())
    span = range(lo, hi + 1)
    if width * len(span) > row_cap or any(free.get(s, 0) < width for s in span):
        return None
    if all(lengths.get(s) == width for s in span):
        return None                      # one pass already
    return width if cost(width * len(span)) < split_cost(lengths, cost) else None


def groups(lengths: Dict[int, int], row_cap: int) -> List[Dict[int, int]]:
    """The batches a tick runs steps of `lengths` (seq id -> rows) in: in sequence order, a new
    one whenever the next step would take the batch past row_cap rows."""
    out: list = []
    rows = 0
    for s in sorted(lengths):
        n = lengths[s]
        if n <= 0:
            continue
        if out and rows + n <= row_cap:
            out[-1][s] = n
            rows += n
        else:
            out.append({s: n})
            rows = n
    return out


def tick_cost(lengths: Dict[int, int], cost: RowCost, row_cap: int,
              free: Optional[Dict[int, int]] = None) -> float:
    """What a tick of steps `lengths` costs: one batch padded to one pass where plan() says so
    (`free`: cells left per sequence, None: plenty), else llama.cpp's split of each group."""
    parts = groups(lengths, row_cap)
    if len(parts) == 1:
        steps = parts[0]
        span = range(min(steps), max(steps) + 1)
        width = plan(steps, free if free is not None else {s: row_cap for s in span}, cost,
                     row_cap)
        if width is not None:
            return cost(width * len(span))
    return sum(split_cost(g, cost) for g in parts)


@dataclass(frozen=True)
class Step:
    """A slot's step as its policy chose it, for trim(): its drafts, and for each j the
    predicted chance that drafts 0..j are all accepted."""
    drafts: int
    survival: tuple = ()


def trim(steps: Dict[int, Step], cost: RowCost, row_cap: int,
         free: Optional[Dict[int, int]] = None) -> Dict[int, int]:
    """Drafts to keep per slot (seq id -> count <= its choice) so that the tick's expected
    tokens per unit of cost is highest: each slot chose its drafts as if alone (its r(k)),
    but in a shared tick a longer step can cost a whole extra pass over the weights (llama.cpp
    splits unequal steps) while the others' single rows ride along nearly free. Tries cutting
    one slot at a time to none or to another slot's length, takes the best cut, repeats."""
    gains = {s: [0.0] for s in steps}
    for s, st in steps.items():
        for p in st.survival[:st.drafts]:
            gains[s].append(gains[s][-1] + p)
    kept = {s: min(st.drafts, len(gains[s]) - 1) for s, st in steps.items()}

    def value(k: Dict[int, int]) -> float:
        tokens = len(k) + sum(gains[s][n] for s, n in k.items())
        return tokens / tick_cost({s: n + 1 for s, n in k.items()}, cost, row_cap, free)

    best = value(kept)
    while True:
        move = None
        for s in kept:
            for c in {0} | set(kept.values()):
                if c < kept[s]:
                    v = value({**kept, s: c})
                    if v > best * (1 + 1e-9):
                        best, move = v, {**kept, s: c}
        if move is None:
            return kept
        kept = move
