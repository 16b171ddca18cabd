"""Measures the verify cost curve r(k) of a model on this device, once, and caches it.

r(k) = time to decode k+1 tokens with logits on every row / time to decode one token. On a GPU it
stays near 1 up to k ~ 8-16; on a small CPU it climbs quickly, which is why k must adapt.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

from .costmodel import Stability, ratio_stability, round_stability
from .slices import (DENSE_K, FULL_ROUNDS, SPARSE_K, UNKNOWN_SLOPE, fill,  # noqa: F401
                     plausible, suffix_min, take_slice, timed_ks, value)
from ..files import cache_dir, env_number, jsonsafe
from ..files.atomic import atomic_write, set_aside, warn
from ..llama import Context, system_info, tiled_matmul_off
from .draft_estimate import CostCurve
from ..llama.libs import cpu_lib_stamp
from ..llama.rpc import attached as rpc_attached

CALIBRATION_VERSION = 4       # 3: per-round stability is cached (older curves had none);
                              # 4: the 16-row tile edges timed, sliced curves use sparse k
REMEASURE_NOISY = 2      # loads that re-measure a curve cached as noisy, at most
BUDGET_ENV = "LOCALSPEC_CALIBRATION_S"
FIRST_RUN_BUDGET_S = 3.0  # a run without a finished curve times batches this long, then answers


def first_run_budget() -> float:
    """Seconds a run may spend timing batches before it answers (LOCALSPEC_CALIBRATION_S)."""
    return env_number(BUDGET_ENV, FIRST_RUN_BUDGET_S, "seconds",
                      "how long a run may time verify batches before it answers", zero_ok=True)


def curve_key(ctx: Context, n_gpu_layers: int, k_max: int) -> str:
    st = ctx.model.path.stat()
    ident = [CALIBRATION_VERSION, str(ctx.model.path.resolve()), st.st_size, int(st.st_mtime),
             ctx.n_threads, n_gpu_layers, k_max, system_info(), ctx.model.repacked,
             tiled_matmul_off(), cpu_lib_stamp()]
    if n_gpu_layers and rpc_attached():    # layers on other hosts: another device entirely
        ident.append(list(rpc_attached()))
    if ctx.model.placement:   # offloaded: which device and how many layers ("3/3 layers on
        ident.append(ctx.model.placement)  # Vulkan0 (llvmpipe...)"); CPU keys stay as they were
    ident = json.dumps(ident)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def time_batches(ctx: Context, sizes: Sequence[int], reps: int,
                 all_rows_upto: Optional[int] = None, budget_s: Optional[float] = None) -> list:
    """Seconds of one decode of a batch of each size after a prefix of 32 tokens: [reps][sizes],
    rounds over every size, so drift on a shared machine hits all sizes alike. Logits of every
    row (a verify batch's), or of the last only past `all_rows_upto` rows (a prefill's).

    With `budget_s`, the whole call (prefix and warm-up included) keeps within it: a batch is
    not started unless it should end in time, guessed from the warm-up's one-token decode and
    the prior r(k); the last round may then be short, or a row empty. Its prefix is then one
    token, a shape every decode compiles anyway: a device that compiles kernels per batch shape
    on first use (Mesa's software Vulkan: seconds each) would otherwise build a 32-row prefill's
    for nothing. Leaves the context empty."""
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    ctx.clear()
    vocab = ctx.model.n_vocab
    prefix = 32 if budget_s is None else 1
    ctx.decode([(7 * i + 3) % vocab for i in range(prefix)], logits="none")
    base = ctx.n_past
    batches = [[(11 * j + 5) % vocab for j in range(n)] for n in sizes]
    t = time.perf_counter()
    ctx.decode(batches[0][:1], logits="all")      # warm-up, and the guess of one decode's time
    one = time.perf_counter() - t
    ctx.truncate(base)
    rounds = []
    for _ in range(reps):
        row = []
        rounds.append(row)
        for toks in batches:
            guess = one * (1 + UNKNOWN_SLOPE * (len(toks) - 1))
            if deadline is not None and time.perf_counter() + guess > deadline:
                break
            rows = "all" if all_rows_upto is None or len(toks) <= all_rows_upto else "last"
            t = time.perf_counter()
            ctx.decode(toks, logits=rows)
            row.append(time.perf_counter() - t)
            ctx.truncate(base)
        if deadline is not None and time.perf_counter() > deadline:
            break
    ctx.clear()
    return rounds


def measure(ctx: Context, k_max: int = 16, reps: int = 5) -> CostCurve:
    """Decode batches of k+1 tokens for k in 0 and timed_ks(k_max) after a short prefix; keep the
    fastest of `reps` rounds; r(k) between timed k on straight lines.

    Leaves the context empty. Costs about reps * sum(r(k)) one-token decodes over the timed k.
    notes["stability"] says how well the rounds agreed (costmodel.round_stability).
    """
    ks = timed_ks(k_max)
    rounds = time_batches(ctx, [1] + [k + 1 for k in ks], reps)
    times = [min(r[i] for r in rounds) for i in range(len(ks) + 1)]  # noise only adds time
    one = times[0]
    ratios = suffix_min(fill({k: max(1.0, t / one) for k, t in zip(ks, times[1:])}, k_max))
    return CostCurve(tuple(round(r, 3) for r in ratios), ms_per_step=1000 * one,
                     notes={"stability": round_stability(rounds, ks), "samples": {
                         "t0": [r[0] for r in rounds],
                         **{str(k): [r[i + 1] / r[0] for r in rounds] for i, k in enumerate(ks)}}})


def curve_from_samples(samples: dict, k_max: int, key: str = "") -> CostCurve:
    """The curve of r(k) samples gathered in slices, maybe over several runs: {"t0": [seconds
    of one-token decodes], "1": [r(1) ...], ...}. Each r(k) was timed against one-token decodes
    of its own slice, so a slice taken while the machine was busier throughout counts as
    slower, not steeper. Per k slices.value(): the median of the plausible samples, once there
    are enough of them (one sample is no value; a batch dearer than its rows' one-token decodes
    is no sample). Straight lines between the k that have one (the sparse ones past DENSE_K
    too), past the largest r(k) grows in proportion: measure()'s curve.

    >>> curve_from_samples({"t0": [0.1, 0.2], "1": [1.5, 1.6, 1.4], "2": [2.0, 2.0]}, 3).ratios
    (1.0, 1.5, 2.0, 2.5)
    >>> curve_from_samples({"t0": [0.1], "1": [1.5] * 3, "3": [6.3], "4": [2.5] * 3}, 5).ratios
    (1.0, 1.5, 1.833, 2.167, 2.5, 2.875)
    """
    points = {k: max(1.0, v) for k in range(1, k_max + 1)
              if (v := value(k, samples.get(str(k), []))) is not None}
    ratios = suffix_min(fill(points, k_max))   # a spike cannot make k dearer
    timed = timed_ks(k_max)                     # the sizes a slice times: k past 16 sparse
    per_k = [[r for r in samples.get(str(k), []) if plausible(k, r)] for k in timed]
    base = samples.get("t0", [])
    return CostCurve(tuple(round(r, 3) for r in ratios), 1000 * min(base) if base else 50.0, key,
                     {"stability": ratio_stability(per_k, base, timed), "samples": samples,
                      "complete": min((len(x) for x in per_k), default=len(base)) >= FULL_ROUNDS,
                      "timed": sorted(points)})


def load_or_measure(ctx: Context, n_gpu_layers: int = 0, k_max: int = 16,
                    progress=None, force: bool = False, attempts: int = 1,
                    budget_s: Optional[float] = None) -> CostCurve:
    """The cached curve for this model/device/threads, measuring it the first time (or when
    `force`: `localspec calibrate` re-measures on a quiet machine). A cached file that is not a
    curve (edited, truncated, another version) is measured again, with a note.

    A curve whose calibration rounds disagreed (a busy machine) is cached marked noisy and
    measured again on each of the next REMEASURE_NOISY loads, keeping the steadier one; within
    one call, up to `attempts` measurements are taken while they come out noisy.

    With `budget_s` (a run that must answer soon), a missing, unfinished or noisy curve gets
    one slice of at most that many seconds instead (sliced())."""
    k_max = min(k_max, ctx.n_batch - 1)    # a verify batch is one decode chunk (--ctx 64)
    key = curve_key(ctx, n_gpu_layers, k_max)
    path = cache_dir("calibration") / f"{key}.json"    # fails early if the cache is unusable
    cached = None
    if not force and path.exists():
        cached = _read_curve(path, k_max, key)
    if cached is not None and cached.notes.get("complete", True):
        st = cached.notes.get("stability")
        if st is None or not st.noisy or cached.notes.get("remeasured", 0) >= REMEASURE_NOISY:
            return cached
    if budget_s is not None and not force:
        return sliced(ctx, path, cached, k_max, budget_s, progress)
    if progress:
        who = f"{ctx.model.path.name} with {ctx.n_threads} thread{'s' * (ctx.n_threads != 1)}"
        progress(f"localspec: re-timing batched verification of {who}..." if force else
                 f"localspec: the last calibration of {who} was noisy (another job running?); "
                 "timing batched verification again..." if cached is not None else
                 f"localspec: first speculative run of {who} here: timing batched verification "
                 f"to pick draft lengths (once, about a minute; cached in {path.parent}, later "
                 "runs skip it)...")
    started = time.perf_counter()
    curve, tries = None, 0
    for tries in range(1, max(1, attempts) + 1):
        new = measure(ctx, k_max)
        if curve is None or new.notes["stability"].spread < curve.notes["stability"].spread:
            curve = new
        if not curve.notes["stability"].noisy:
            break
    if progress:
        progress(f"localspec: calibrated in {time.perf_counter() - started:.1f} s.")
    if cached is not None and cached.notes["stability"].spread < curve.notes["stability"].spread:
        curve = cached                               # the earlier one was steadier: keep it
    remeasured = cached.notes.get("remeasured", 0) + 1 if cached is not None else 0
    _keep(path, ctx, curve, remeasured, progress)
    return CostCurve(curve.ratios, curve.ms_per_step, key,
                     {"stability": curve.notes["stability"], "remeasured": remeasured,
                      "attempts": tries, "complete": True})


def sliced(ctx: Context, path, cached: Optional[CostCurve], k_max: int, budget_s: float,
           progress=None) -> CostCurve:
    """One slice of at most `budget_s` seconds added to the samples cached so far: a first run
    answers after it with a rough curve (which the engine refines from every step's timing),
    and each later run adds a slice until every k has FULL_ROUNDS plausible samples. A slice
    that cannot be true is thrown away, with one line (slices.judge). A finished curve that
    came out noisy gets slices too, at most REMEASURE_NOISY times."""
    if cached is None and progress:
        who = f"{ctx.model.path.name} with {ctx.n_threads} thread{'s' * (ctx.n_threads != 1)}"
        progress(f"localspec: first speculative run of {who} here: timing batched verification "
                 f"for up to {budget_s:g} s to pick draft lengths (the next runs finish it; "
                 f"cached in {path.parent})...")
    started = time.perf_counter()
    before = cached.notes.get("samples", {}) if cached is not None else {}
    samples, dropped = take_slice(ctx, before, k_max, started + budget_s, progress or warn)
    curve = curve_from_samples(samples, k_max, path.stem)
    curve.notes["dropped"] = dropped
    if cached is None and progress:
        progress(f"localspec: calibrated in {time.perf_counter() - started:.1f} s"
                 f"{'' if curve.notes['complete'] else ' (a first slice)'}.")
    was_final = cached is not None and cached.notes.get("complete", True)
    curve.notes["remeasured"] = cached.notes.get("remeasured", 0) + 1 if was_final else 0
    _keep(path, ctx, curve, curve.notes["remeasured"], progress)
    return curve


def _keep(path, ctx: Context, curve: CostCurve, remeasured: int, progress) -> None:
    """Write the curve; a full disk or a folder in the way is a warning: use it and go on."""
    try:
        _write(path, ctx, curve, remeasured)
    except OSError as e:
        if progress:
            progress(f"localspec: warning: could not keep the cost curve in {path} "
                     f"({e.strerror or e}); the next run measures it again.")


def _write(path, ctx: Context, curve: CostCurve, remeasured: int) -> None:
    """The curve as the cache file's JSON, atomically and owner-only (files/atomic.py)."""
    text = json.dumps({"ratios": curve.ratios, "ms_per_step": curve.ms_per_step,
                       "model": str(ctx.model.path), "threads": ctx.n_threads,
                       "stability": asdict(curve.notes["stability"]), "remeasured": remeasured,
                       "samples": curve.notes.get("samples", {}),
                       "complete": curve.notes.get("complete", True)})
    atomic_write(Path(path), lambda f: f.write(text.encode()))


def newest_cached(model_name: str, threads: int):
    """(CostCurve, path) of the newest curve cached here for a model file name and thread count
    (whatever device or build measured it), or None: what `localspec calibrate` measured last,
    for tools that have no context to compute a key from (the policy replay)."""
    found = []
    for path in cache_dir("calibration").glob("*.json"):
        data = _read_json(path)
        if isinstance(data, dict) and data.get("threads") == threads and \
                str(data.get("model", "")).endswith(model_name):
            curve = _parse_curve(path, data, None, path.stem)
            if curve is not None:
                found.append((path.stat().st_mtime, str(path), curve))
    if not found:
        return None
    _, path, curve = max(found, key=lambda t: t[:2])
    return curve, path


def _read_curve(path, k_max: int, key: str):
    """The curve stored at `path`, or None (a file that is not one is set aside, one line)."""
    data = _read_json(path)
    return None if data is None else _parse_curve(path, data, k_max, key)


def _read_json(path):
    """A cache file's JSON, None when unreadable or not JSON (set aside, one line)."""
    try:
        return jsonsafe.loads(Path(path).read_bytes())
    except ValueError as e:
        _refuse(path, f"not a cost curve ({e})")
    except OSError:
        pass
    return None


def _parse_curve(path, data, k_max: Optional[int], key: str):
    """The curve in a cache file's JSON, or None (set aside, one line) unless validate_curve
    passes it: ratios r(0..k_max) of numbers >= 1 starting at 1, and a positive step time."""
    try:
        validate_curve(data, k_max)
    except ValueError as e:
        _refuse(path, str(e))
        return None
    samples, complete = data.get("samples", {}), data.get("complete", True)
    notes = {"remeasured": data.get("remeasured", 0), "complete": complete, "samples": samples}
    if "stability" in data:
        notes["stability"] = Stability(**data["stability"])
    return CostCurve(tuple(float(r) for r in data["ratios"]), float(data["ms_per_step"]), key,
                     notes)


_NUMBER = (int, float)
_STABILITY = {"rounds": int, "spread": _NUMBER, "worst_k": int, "worst_spread": _NUMBER,
              "base_spread": _NUMBER, "step_ms": _NUMBER}


def validate_curve(data, k_max: Optional[int]) -> None:
    """ValueError (why, in a few words) unless `data` has the types and ranges _write gives a
    curve: a crafted file (a `remeasured` of 1e300, samples that are not numbers) must not
    fail every later run. k_max None: any length of ratios."""
    def number(x, low: float, high: float) -> bool:
        return type(x) in (int, float) and low <= x <= high

    if not isinstance(data, dict):
        raise ValueError("not a cost curve (not an object)")
    ratios = data.get("ratios")
    if not (isinstance(ratios, list) and 2 <= len(ratios) <= 65
            and (k_max is None or len(ratios) == k_max + 1)
            and all(number(r, 1.0, 1e6) for r in ratios)):
        raise ValueError("its ratios are not a cost curve r(0..k) of numbers >= 1")
    if not number(data.get("ms_per_step"), 1e-6, 1e7):
        raise ValueError("its step time is not a positive number of ms")
    if type(data.get("remeasured", 0)) is not int or not 0 <= data.get("remeasured", 0) <= 1000:
        raise ValueError("its remeasured count is not a small whole number")
    if type(data.get("complete", True)) is not bool:
        raise ValueError("its complete flag is not true or false")
    st = data.get("stability", {})
    if not (isinstance(st, dict) and all(k in _STABILITY for k in st)
            and ("stability" not in data or set(st) >= set(_STABILITY) - {"step_ms"})
            and all(type(v) in ((int,) if _STABILITY[k] is int else _NUMBER) and
                    abs(v) <= 1e9 for k, v in st.items())):
        raise ValueError("its stability is not a calibration's")
    samples = data.get("samples", {})
    names = {"t0", *map(str, range(1, len(ratios)))}
    if not (isinstance(samples, dict) and set(samples) <= names and all(
            isinstance(v, list) and len(v) <= 1000 and all(number(x, 1e-12, 1e6) and x > 0
                                                          for x in v)
            for v in samples.values())):
        raise ValueError("its samples are not timings")


def _refuse(path, why: str) -> None:
    """One line and the file set aside (as every reader of localspec's files does with one it
    refuses): the next measurement writes a new one."""
    aside = set_aside(Path(path), None)
    moved = f"; moved it to {aside.name}" if aside is not None else ""
    warn(f"localspec: the cached cost curve {path} is damaged; measuring it again "
         f"({why}{moved}).")
