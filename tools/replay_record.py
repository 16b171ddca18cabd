"""Records what the policy replay needs: each workload case's plain greedy output plus, per output
position, the target's confidence in the row that chose it (top-1 probability, top-2 logit margin)
and the one-token decode time. The n-gram features are not stored: the replay recomputes them
from the tokens, so matcher changes need no new recording.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Optional, Sequence

import numpy as np

from localspec.llama.buildflags import cpu_model, read_cpuinfo

RECORDING_VERSION = 2


def row_confidence(row: np.ndarray) -> tuple[int, float, float]:
    """(argmax, top-1 probability, top-2 logit margin) of one logits row [n_vocab] float32.

    Example: logits [0, ln 3, -inf] -> (1, 0.75, ln 3)."""
    best = int(np.argmax(row))
    top = float(row[best])
    second = max(row[:best].max(initial=-np.inf), row[best + 1:].max(initial=-np.inf))
    p_top = 1.0 / float(np.exp(row.astype(np.float64) - top).sum())
    return best, p_top, top - float(second)


def greedy_trace(ctx, prompt: Sequence[int], max_tokens: int, is_eog: Callable[[int], bool]):
    """Plain greedy decoding as the engine does it (prefill, then one-token decodes with the
    logits of their one row), keeping per output position j: out[j], the top-1 probability and
    top-2 margin of the row that chose out[j], and the decode time of that row in ms (the
    prefill's for j = 0). Leaves the context empty."""
    ctx.clear()
    t = time.perf_counter()
    row = ctx.decode(list(prompt), logits="last")[0]
    ms = 1000 * (time.perf_counter() - t)
    out, p_top, margin, step_ms = [], [], [], []
    while True:
        tok, p1, gap = row_confidence(row)
        if is_eog(tok):
            break
        out.append(tok)
        p_top.append(round(p1, 4))
        margin.append(round(gap, 3))
        step_ms.append(round(ms, 2))
        if len(out) >= max_tokens or ctx.n_past + 1 >= ctx.n_ctx:
            break
        t = time.perf_counter()
        row = ctx.decode([tok], logits="all")[0]
        ms = 1000 * (time.perf_counter() - t)
    ctx.clear()
    return {"out": out, "p_top": p_top, "margin": margin, "step_ms": step_ms}


def record(path: str, threads: int = 2, exact: bool = False, cases: Optional[list] = None,
           say: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
           workloads: Optional[str] = None, model: str = "default") -> dict:
    """Record every case of `workloads` (default: the shipped ones), or the ids in `cases`, with
    `model` (catalog name or path) into JSON at `path`, rewritten after each case; cases already
    there are kept (a stopped run resumes). Kinds take turns, so a partial recording covers all
    of them."""
    from localspec.bench import load_workloads
    from localspec.speculative.engine import Engine, EngineConfig

    data = {"version": RECORDING_VERSION, "threads": threads, "exact": exact,
            "cpu": cpu_model(read_cpuinfo()), "cases": {}}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("version") == RECORDING_VERSION and old.get("exact") == exact:
            data = old
    with Engine(model, EngineConfig(proposer="none", exact=exact, n_threads=threads)) as eng:
        if data.get("model", eng.model.path.name) != eng.model.path.name:
            data["cases"] = {}             # another model's outputs: nothing to resume
        data["model"] = eng.model.path.name
        order = {c.id: i for i, c in enumerate(load_workloads(workloads, ids=cases))}
        for case in _by_turns(load_workloads(workloads, ids=cases)):
            if case.id in data["cases"]:
                continue
            eng.reset()
            load = os.getloadavg()[0]
            prompt = eng.tokenize_prompt(case.messages())
            trace = greedy_trace(eng.ctx, prompt, case.max_tokens, eng.model.is_eog)
            data["cases"][case.id] = {"kind": case.kind, "prompt": prompt, "load": load,
                                      "session": case.session, "order": order[case.id], **trace}
            data["token_class"] = token_class_map(data, eng.model.token_piece)
            _save(path, data)
            say(f"{case.id}: {len(trace['out'])} tokens, "
                f"median step {np.median(trace['step_ms'][1:] or [0]):.1f} ms, "
                f"load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    return data


def token_class_map(data: dict, piece: Callable[[int], bytes]) -> dict:
    """{token id: acceptance.token_class} for every id in the recording that is not PLAIN:
    what the replay needs to build the draft features the engine gets from the vocabulary."""
    from localspec.policy.acceptance import PLAIN, token_class
    ids = set()
    for c in data["cases"].values():
        ids.update(c["prompt"])
        ids.update(c["out"])
    classes = {t: token_class(piece(t)) for t in sorted(ids)}
    return {str(t): c for t, c in classes.items() if c != PLAIN}


def _by_turns(cases: list) -> list:
    """Cases reordered so that kinds alternate: a, b, c, a, b, c, ..."""
    kinds: dict = {}
    for c in cases:
        kinds.setdefault(c.kind, []).append(c)
    out = []
    while any(kinds.values()):
        for group in kinds.values():
            if group:
                out.append(group.pop(0))
    return out


def _save(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)


