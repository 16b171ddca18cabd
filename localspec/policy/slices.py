"""A first run's calibration, in slices: which verify batches a slice times, how, and which of
its timings are believed. calibrate.py caches the samples and turns them into a curve.

A slice has a few seconds. It times groups of GROUP sizes, each SLICE_REPS times, the sizes of
a group in turn (a b c, b c a, c a b) with a one-token decode before each pass and after the
last, so a machine that slows down for a second hits every size of the group alike. Each batch
counts against the median of the three one-token decodes nearest it, and a size's r(k) is the
median of its samples: one stall, in a batch or in a one-token decode, moves nothing.

What cannot be true is thrown away, not averaged. A batch of n rows costs at most n one-token
decodes (n decodes of one row each would do its work), and at least about one: a sample outside
[1 / (1 + NOISE), n (1 + NOISE)] is a stall or a stalled reference, and dropped. A slice whose
sizes' medians fall by more than FALL as the batch grows, or a third of whose samples were
dropped, was taken on a machine too busy to time; all of it is thrown away, with one line on
stderr, and the prior and the steps' own timings stand in (costmodel.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import numpy as np

UNKNOWN_SLOPE = 0.3       # r(k) = 1 + 0.3 k where no batch was timed yet: a middling CPU's
DENSE_K = 16              # every k up to this is timed; past it only SPARSE_K, and r(k) between
SPARSE_K = (20, 24, 28, 31, 40, 47, 56, 63, 64)  # them is a straight line (a 65-row batch costs
                          # ~14 decodes on 2 cores: timing every k to 64 would take minutes).
                          # 31, 47, 63: batches of 32, 48, 64 rows, where the CPU's repacked
                          # gemm fills its 16-row blocks; one row more goes through its slower
                          # rest (AMD Zen 4: r(47) 17.5, r(48) 18.1; r(46) 19.8)
FIRST_KS = (1, 3, 7, 15, 31, 63)  # timed first: the sizes a request's loss budget reaches in
                          # turn (2-row batches first, 64-row ones once a copy runs), spread so
                          # that a first slice extrapolates from its largest size, not from r(3)
FULL_ROUNDS = 3           # plausible samples of every timed k, over the slices, finish a curve
MAX_ROUNDS = 8            # samples kept per size in the cache file (the newest)
GROUP = 3                 # sizes timed in turn within a slice
SLICE_REPS = 3            # samples of each size of a group per slice
NOISE = 0.25              # timing noise allowed past the physical bounds of one sample
FALL = 0.25               # a larger batch's median this much under a smaller one's: not a curve
AGREE = 0.10              # two samples within this of each other count as a size's value
JITTER_S = 0.001          # one-token decodes faster than this are timer-bound (costmodel's
                          # JITTER_MS): jitter, not load, so a slice of them is never thrown away


def timed_ks(k_max: int) -> list:
    """The k whose batches a calibration times: all up to DENSE_K, then SPARSE_K and k_max.

    >>> timed_ks(4), timed_ks(40)[-4:]
    ([1, 2, 3, 4], [24, 28, 31, 40])
    """
    dense = list(range(1, min(k_max, DENSE_K) + 1))
    sparse = sorted({k for k in SPARSE_K if DENSE_K < k <= k_max} | ({k_max} - set(dense)))
    return dense + sparse


def fill(points: dict, k_max: int) -> list:
    """r(0..k_max) from r at some k ({k: r}, k=0 is 1): straight lines between them, and past the
    largest one r(k) grows in proportion to k (the slope of the line from r(0) = 1).

    >>> fill({2: 2.0, 4: 3.0}, 6)
    [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
    """
    ks, rs = zip(*sorted({0: 1.0, **points}.items()))
    top = ks[-1]
    slope = (rs[-1] - 1.0) / top if top else UNKNOWN_SLOPE
    inside = np.interp(np.arange(top + 1), ks, rs)
    return [float(r) for r in inside] + [1.0 + slope * k for k in range(top + 1, k_max + 1)]


def suffix_min(ratios: list) -> list:
    """A spike at k (noise) cannot make k dearer than a larger batch measured cheaper. Real dips
    survive (repacked CPU kernels work in groups of 4: k=3 can beat k=2)."""
    for k in range(len(ratios) - 2, 0, -1):
        ratios[k] = min(ratios[k], ratios[k + 1])
    ratios[0] = 1.0
    return ratios


def plausible(k: int, r: float) -> bool:
    """Can a batch of k + 1 rows cost r one-token decodes? Not more than k + 1 of them, nor much
    less than one, give or take NOISE.

    >>> plausible(3, 6.26), plausible(3, 1.49), plausible(1, 0.5)
    (False, True, False)
    """
    return 1.0 / (1.0 + NOISE) <= r <= (k + 1) * (1.0 + NOISE)


def value(k: int, samples) -> Optional[float]:
    """A size's r(k) from its samples: the median of the plausible ones, once there are
    FULL_ROUNDS of them or two that agree within AGREE; None before (one sample is no value).

    >>> value(3, [1.5, 6.3, 1.4, 1.6]), value(3, [1.5, 1.55]), value(3, [1.5, 2.6]), value(3, [1.5])
    (1.5, 1.525, None, None)
    """
    ok = sorted(r for r in samples if plausible(k, r))
    if len(ok) >= FULL_ROUNDS or (len(ok) == 2 and ok[1] <= ok[0] * (1.0 + AGREE)):
        return statistics.median(ok)
    return None


def count(k: int, samples) -> int:
    """Plausible samples of a size."""
    return sum(plausible(k, r) for r in samples)


def order(samples: dict, k_max: int) -> list:
    """The timed sizes in the order a slice takes them: fewest plausible samples first, FIRST_KS
    before the others at equal counts.

    >>> order({}, 16)[:6], order({"1": [1.2] * 3, "3": [1.4] * 3}, 16)[:3]
    ([1, 3, 7, 15, 2, 4], [7, 15, 2])
    """
    ks = timed_ks(k_max)
    ranked = [k for k in FIRST_KS if k in ks] + [k for k in ks if k not in FIRST_KS]
    rank = {k: i for i, k in enumerate(ranked)}
    return sorted(ks, key=lambda k: (min(count(k, samples.get(str(k), [])), FULL_ROUNDS), rank[k]))


def plan(sizes: list) -> list:
    """The decodes of a slice, k per batch and 0 per one-token reference: groups of GROUP sizes,
    SLICE_REPS passes each, the order rotated per pass, a reference between passes.

    >>> plan([1, 3, 7, 15])
    [0, 1, 3, 7, 0, 3, 7, 1, 0, 7, 1, 3, 0, 15, 0, 15, 0, 15, 0]
    """
    out = []
    for g in range(0, len(sizes), GROUP):
        group = sizes[g:g + GROUP]
        for rep in range(SLICE_REPS):
            turn = rep % len(group)
            out += [0] + group[turn:] + group[:turn]
    return out + [0] if out else []


def ratios_of(events: list) -> dict:
    """{"t0": [reference seconds], "k": [r samples]} from a slice's (k, seconds) in the order
    they ran, k = 0 for a one-token reference: each batch over the median of the (up to) three
    references nearest it.

    >>> ratios_of([(0, 0.1), (1, 0.125), (0, 0.1), (3, 0.2), (0, 0.5)])   # a stalled reference
    {'t0': [0.1, 0.1, 0.5], '1': [1.25], '3': [2.0]}
    """
    refs = [(i, t) for i, (k, t) in enumerate(events) if k == 0]
    out: dict = {"t0": [t for _, t in refs]} if refs else {}
    if not refs:
        return out
    for i, (k, t) in enumerate(events):
        if k:
            near = sorted(refs, key=lambda ref: (abs(ref[0] - i), ref[0]))[:3]
            out.setdefault(str(k), []).append(t / statistics.median(r for _, r in near))
    return out


def judge(new: dict, whole: bool = True) -> tuple:
    """(the slice's samples to keep, why it was thrown away or None). A slice is thrown away
    whole when a third or more of its batch samples are implausible, or its sizes' medians fall
    by more than FALL as the batch grows; else only its implausible samples are dropped (they
    are counted, not cached). `whole` False: only samples are dropped (steps under a
    millisecond, where timer jitter, not load, makes a slice look wrong).

    >>> judge({"t0": [0.1] * 4, "1": [1.2, 1.3, 1.2], "3": [1.5, 6.3, 1.4]})[0]["3"]
    [1.5, 1.4]
    >>> judge({"t0": [0.1] * 4, "1": [2.4, 2.3, 2.4], "3": [1.5, 1.6, 1.4]})[1]
    'r(3) 1.5 under r(1) 2.4: the cost fell as the batch grew'
    """
    keep = {"t0": list(new.get("t0", []))}
    n = bad = 0
    worst = None
    medians = {}
    for key in sorted((x for x in new if x != "t0"), key=int):
        k, rs = int(key), new[key]
        ok = [r for r in rs if plausible(k, r)]
        n, bad = n + len(rs), bad + len(rs) - len(ok)
        for r in rs:
            if not plausible(k, r) and (worst is None or r / (k + 1) > worst[1] / (worst[0] + 1)):
                worst = (k, r)
        if ok:
            keep[key] = ok
        if len(ok) >= 2:
            medians[k] = statistics.median(ok)
    for k2, m2 in medians.items() if whole else ():
        for k1, m1 in medians.items():
            if k1 < k2 and m2 * (1.0 + FALL) < m1:
                return {}, (f"r({k2}) {m2:.1f} under r({k1}) {m1:.1f}: the cost fell as the "
                            "batch grew")
    if whole and n and 3 * bad >= n:
        k, r = worst
        return {}, (f"{bad} of {n} batches implausible, e.g. {k + 1} rows at {r:.1f} one-token "
                    f"decodes (more than {k + 1} separate ones)")
    return keep, None


def run_slice(ctx, samples: dict, k_max: int, deadline: float) -> dict:
    """Time batches until `deadline` (perf_counter) as plan() lays them out over order()'s sizes;
    the new samples as ratios_of() gives them (judge() them before keeping). A batch starts only
    if it should end in time with a reference after it, guessed from the references' median and
    the prior r(k). The prefix is one token, a shape every decode compiles anyway: a device that
    compiles kernels per batch shape on first use (Mesa's software Vulkan: seconds each) would
    otherwise build a 32-row prefill's for nothing. Leaves the context empty.

    Its cost, in one-token decodes: 2 (prefix and warm-up), then per group of sizes k
    SLICE_REPS x sum of r(k), and SLICE_REPS + 1 references."""
    clock = time.perf_counter
    if clock() >= deadline:                      # a budget of 0: the prior, at once
        return {}
    vocab = ctx.model.n_vocab
    ctx.clear()
    ctx.decode([3 % vocab], logits="none")
    base = ctx.n_past
    batches = {k: [(11 * j + 5) % vocab for j in range(k + 1)] for k in timed_ks(k_max)}
    batches[0] = [5 % vocab]
    events: list = []

    def timed(k: int) -> float:
        t = clock()
        ctx.decode(batches[k], logits="all")
        spent = clock() - t
        ctx.truncate(base)
        return spent

    one = timed(0)                               # the warm-up, and the first guess of a decode
    for k in plan(order(samples, k_max)):
        guess = one * (1.0 + UNKNOWN_SLOPE * k)
        if clock() + guess + (one if k else 0.0) > deadline:
            break
        events.append((k, timed(k)))
        if not k:
            one = statistics.median(t for j, t in events if j == 0)
    if events and events[-1][0] and clock() + one <= deadline:
        events.append((0, timed(0)))             # the last batches' reference
    ctx.clear()
    return ratios_of(events)


def merge(before: dict, new: dict) -> dict:
    """Cached samples plus a slice's, the newest MAX_ROUNDS per size."""
    out = {k: list(v) for k, v in before.items()}
    for k, v in new.items():
        out.setdefault(k, []).extend(v)
    return {k: v[-MAX_ROUNDS:] for k, v in out.items()}


def take_slice(ctx, samples: dict, k_max: int, deadline: float,
               say: Optional[Callable[[str], None]] = None) -> tuple:
    """(the samples with one judged slice added, how many of its samples were dropped): a slice
    thrown away leaves `samples` as they were, with one line to `say`. Steps under a
    millisecond (JITTER_S) are timer-bound: only their implausible samples are dropped."""
    new = run_slice(ctx, samples, k_max, deadline)
    kept, why = judge(new, whole=min(new.get("t0", [1.0])) >= JITTER_S)
    n_new = sum(len(v) for k, v in new.items() if k != "t0")
    dropped = n_new - sum(len(v) for k, v in kept.items() if k != "t0")
    if why and say is not None:
        say(f"localspec: threw away this run's timing of verify batches ({why}; another job "
            "running?): drafting starts from the earlier samples or the prior and follows the "
            "steps' own timings.")
    return merge(samples, kept), dropped
