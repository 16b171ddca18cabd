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

from typing import Callable, Dict, Optional

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
