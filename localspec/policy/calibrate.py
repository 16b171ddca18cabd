"""Measures the verify cost curve r(k) of a model on this device, once, and caches it.

r(k) = time to decode k+1 tokens with logits on every row / time to decode one token. On a GPU it
stays near 1 up to k ~ 8-16; on a small CPU it climbs quickly, which is why k must adapt.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from typing import Optional, Sequence

from .costmodel import Stability, round_stability
from ..files import cache_dir
from ..llama import Context, system_info, tiled_matmul_off
from .draft_estimate import CostCurve
from ..llama.rpc import attached as rpc_attached

CALIBRATION_VERSION = 3       # 3: per-round stability is cached (older curves had none)
REMEASURE_NOISY = 2      # loads that re-measure a curve cached as noisy, at most


def curve_key(ctx: Context, n_gpu_layers: int, k_max: int) -> str:
    st = ctx.model.path.stat()
    ident = [CALIBRATION_VERSION, str(ctx.model.path.resolve()), st.st_size, int(st.st_mtime),
             ctx.n_threads, n_gpu_layers, k_max, system_info(), ctx.model.repacked,
             tiled_matmul_off()]
    if n_gpu_layers and rpc_attached():    # layers on other hosts: another device entirely
        ident.append(list(rpc_attached()))
    if ctx.model.placement:   # offloaded: which device and how many layers ("3/3 layers on
        ident.append(ctx.model.placement)  # Vulkan0 (llvmpipe...)"); CPU keys stay as they were
    ident = json.dumps(ident)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def time_batches(ctx: Context, sizes: Sequence[int], reps: int,
                 all_rows_upto: Optional[int] = None) -> list:
    """Seconds of one decode of a batch of each size after a 32-token prefix: [reps][sizes],
    rounds over every size, so drift on a shared machine hits all sizes alike. Logits of every
    row (a verify batch's), or of the last only past `all_rows_upto` rows (a prefill's). Leaves
    the context empty."""
    ctx.clear()
    vocab = ctx.model.n_vocab
    ctx.decode([(7 * i + 3) % vocab for i in range(32)], logits="none")
    base = ctx.n_past
    batches = [[(11 * j + 5) % vocab for j in range(n)] for n in sizes]
    ctx.decode(batches[0][:1], logits="all")      # warm-up
    ctx.truncate(base)
    rounds = []
    for _ in range(reps):
        row = []
        for toks in batches:
            rows = "all" if all_rows_upto is None or len(toks) <= all_rows_upto else "last"
            t = time.perf_counter()
            ctx.decode(toks, logits=rows)
            row.append(time.perf_counter() - t)
            ctx.truncate(base)
        rounds.append(row)
    ctx.clear()
    return rounds


def measure(ctx: Context, k_max: int = 16, reps: int = 5) -> CostCurve:
    """Decode batches of 1..k_max+1 tokens after a short prefix; keep the fastest of `reps` rounds.

    Leaves the context empty. Costs about reps * sum(r(k)) one-token decodes. notes["stability"]
    says how well the rounds agreed (costmodel.round_stability).
    """
    rounds = time_batches(ctx, range(1, k_max + 2), reps)
    times = [min(r[k] for r in rounds) for k in range(k_max + 1)]  # noise only ever adds time
    one = times[0]
    ratios = [max(1.0, t / one) for t in times]
    # Suffix minimum: a spike at k (noise) cannot make k dearer than a larger batch measured
    # cheaper. Real dips survive (repacked CPU kernels work in groups of 4: k=3 can beat k=2).
    for k in range(k_max - 1, 0, -1):
        ratios[k] = min(ratios[k], ratios[k + 1])
    ratios[0] = 1.0
    return CostCurve(tuple(round(r, 3) for r in ratios), ms_per_step=1000 * one,
                     notes={"stability": round_stability(rounds)})


def load_or_measure(ctx: Context, n_gpu_layers: int = 0, k_max: int = 16,
                    progress=None, force: bool = False, attempts: int = 1) -> CostCurve:
    """The cached curve for this model/device/threads, measuring it the first time (or when
    `force`: `localspec calibrate` re-measures on a quiet machine). A cached file that is not a
    curve (edited, truncated, another version) is measured again, with a note.

    A curve whose calibration rounds disagreed (a busy machine) is cached marked noisy and
    measured again on each of the next REMEASURE_NOISY loads, keeping the steadier one; within
    one call, up to `attempts` measurements are taken while they come out noisy."""
    key = curve_key(ctx, n_gpu_layers, k_max)
    path = cache_dir("calibration") / f"{key}.json"    # fails early if the cache is unusable
    cached = None
    if not force and path.exists():
        cached = _read_curve(path, k_max, key)
        if cached is None and progress:
            progress(f"the cached cost curve {path} is damaged; measuring it again.")
    if cached is not None:
        st = cached.notes.get("stability")
        if st is None or not st.noisy or cached.notes.get("remeasured", 0) >= REMEASURE_NOISY:
            return cached
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
    try:
        _write(path, ctx, curve, remeasured)
    except OSError as e:            # a full disk, a folder in the way: use it, say so, go on
        if progress:
            progress(f"localspec: warning: could not keep the cost curve in {path} "
                     f"({e.strerror or e}); the next run measures it again.")
    return CostCurve(curve.ratios, curve.ms_per_step, key,
                     {"stability": curve.notes["stability"], "remeasured": remeasured,
                      "attempts": tries})


def _write(path, ctx: Context, curve: CostCurve, remeasured: int) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps({"ratios": curve.ratios, "ms_per_step": curve.ms_per_step,
                                   "model": str(ctx.model.path), "threads": ctx.n_threads,
                                   "stability": asdict(curve.notes["stability"]),
                                   "remeasured": remeasured}))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def newest_cached(model_name: str, threads: int):
    """(CostCurve, path) of the newest curve cached here for a model file name and thread count
    (whatever device or build measured it), or None: what `localspec calibrate` measured last,
    for tools that have no context to compute a key from (the policy replay)."""
    found = []
    for path in cache_dir("calibration").glob("*.json"):
        try:
            data = json.loads(path.read_text())
            ok = data.get("threads") == threads and str(data.get("model", "")).endswith(model_name)
            curve = _parse_curve(data, len(data["ratios"]) - 1, path.stem) if ok else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if curve is not None:
            found.append((path.stat().st_mtime, str(path), curve))
    if not found:
        return None
    _, path, curve = max(found, key=lambda t: t[:2])
    return curve, path


def _read_curve(path, k_max: int, key: str):
    """The curve stored at `path`, or None unless it has the shape a measurement writes."""
    try:
        return _parse_curve(json.loads(path.read_text()), k_max, key)
    except (OSError, ValueError):
        return None


def _parse_curve(data, k_max: int, key: str):
    """The curve in a cache file's JSON, or None unless it has the shape a measurement writes:
    ratios r(0..k_max) of numbers >= 1 starting at 1, and a positive step time."""
    try:
        ratios, ms = data["ratios"], data["ms_per_step"]
        if not (isinstance(ratios, list) and len(ratios) == k_max + 1
                and all(isinstance(r, (int, float)) and r >= 1.0 for r in ratios)
                and isinstance(ms, (int, float)) and ms > 0):
            return None
        notes = {"remeasured": int(data.get("remeasured", 0))}
        if isinstance(data.get("stability"), dict):
            notes["stability"] = Stability(**data["stability"])
        return CostCurve(tuple(float(r) for r in ratios), float(ms), key, notes)
    except (ValueError, KeyError, TypeError):
        return None
