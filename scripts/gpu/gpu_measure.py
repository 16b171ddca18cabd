"""The GPU measurements of issue 16, in one process: cost curve, identity, draft cost, slots.

    python scripts/gpu/gpu_measure.py --target T.gguf [--draft D.gguf] [--also M.gguf ...]
                                      [--gpu-layers -1] [--k-max 32] [--tokens 64] [--json out.json]
                                      [--what curve,identity,draft,parallel] [--prompts 20]
                                      [--exact] [--contexts 200]

With --exact (a patched GPU library: patch 0009 or 0010), rows and identity run with localspec's
batch-invariant row limit on, as --exact runs them, and curve measures r(k) with the limit off
and then on, so the switch's price sits beside llama.cpp's own kernels' in one process.

- r(k) for k = 0..k_max of every model (calibrate.measure, best of 5 rounds), and which k the
  policy picks on that curve at a given acceptance (it should draft long where r(k) is flat);
- identity: greedy speculative output vs plain on the test suite's 20 prompts, with n-gram
  drafting (adaptive policy) and with scripted drafts of k=8 that are all correct (every row of
  every batch is used), divergences with their top-2 gap from a one-token decode;
- the draft model's one-token decode in target steps, and whether the can-it-pay check keeps it;
- parallel: the prompts as concurrent greedy n-gram requests through `--parallel` slots (one
  shared context, one batch per tick) against each run alone, text and tokens, and the aggregate
  tokens/s of the slots against one request at a time.

Each curve says whether CUDA graphs were on (`graphs`): GGML_CUDA_DISABLE_GRAPHS=1 in the
environment turns them off for the process, which is how gpu_run.sh measures patch 0011
(one captured graph per batch shape) against the direct launches in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from localspec.policy.calibrate import measure
from localspec.speculative.engine import Engine, EngineConfig
from localspec.speculative.parallel import Slots
from localspec.llama import Context, ContextParams, Model, ModelParams, system_info
from localspec.llama.exact_rows import device_exact_rows_on
from localspec.policy.config import PolicyConfig
from localspec.policy.draft_estimate import DraftPolicy
from localspec.speculative.sampling import SamplingParams, top2_gap

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))   # scripts/bench/
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from step_overhead import ScriptedProposer  # noqa: E402
from test_speculative import PROMPTS  # noqa: E402  (the suite's 20 identity prompts)

ACCEPTANCE = (0.5, 0.7, 0.8, 0.9, 0.95)


def exact_switch(on: bool):
    """The patched GPU library's row limit on for the block (as --exact sets it), off after;
    nothing when `on` is False. One error line where no GPU library of this build is patched."""
    return device_exact_rows_on() if on else contextlib.nullcontext()


def curve(path: str, layers: int, k_max: int, threads, exact: bool = False) -> dict:
    with exact_switch(exact), Model(path, ModelParams(n_gpu_layers=layers)) as model, \
            Context(model, ContextParams(n_ctx=2048, n_threads=threads)) as ctx:
        c = measure(ctx, k_max)
    picks = {}
    for cap in sorted({16, k_max}):
        picks[cap] = {a: DraftPolicy(c.ratios, PolicyConfig(k_max=cap, draft_prior=a,
                                                            draft_prior_weight=1e9)).choose_k("x")
                      for a in ACCEPTANCE}
    return {"model": Path(path).name, "ms_per_step": round(c.ms_per_step, 3),
            "ratios": list(c.ratios), "policy_k": picks, "exact": exact,
            # CUDA reads this once a process: a curve with graphs off is another process's
            "graphs": not os.environ.get("GGML_CUDA_DISABLE_GRAPHS")}


def first_divergence(a, b):
    d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return d if d is not None or len(a) == len(b) else min(len(a), len(b))


def rows(path: str, layers: int, threads, n_max: int = 16, context: int = 200,
         exact: bool = False) -> dict:
    """Whether each row of an n-token batch equals the same tokens decoded one at a time, for
    n = 2..n_max after `context` tokens: per n, the rows bit-identical, the largest |logit|
    difference and the rows whose argmax differs. Where rows part tells which kernels do. With
    `exact`, the patched GPU library's row limit is on (every row must then be identical)."""
    import numpy as np
    with exact_switch(exact), Model(path, ModelParams(n_gpu_layers=layers)) as model, \
            Context(model, ContextParams(n_ctx=2048, n_threads=threads)) as ctx:
        toks = model.tokenize(" ".join(PROMPTS) * (8 + context // 150))[:context + n_max]
        ctx.decode(toks[:context], logits="none")
        alone = []
        for t in toks[context:]:
            alone.append(np.array(ctx.decode([t])[0], dtype=np.float32))
        out = {"model": Path(path).name, "context": context, "exact": exact, "by_n": {}}
        for n in range(2, n_max + 1):
            ctx.truncate(context)
            batch = np.array(ctx.decode(toks[context:context + n], logits="all"), dtype=np.float32)
            ref = np.stack(alone[:n])
            diff = np.abs(batch - ref).max(axis=1)
            out["by_n"][n] = {"identical_rows": int((diff == 0).sum()),
                              "max_abs_diff": float(f"{float(diff.max()):.3g}"),
                              "argmax_flips": int((batch.argmax(1) != ref.argmax(1)).sum())}
    return out


def identity_modes(scripted_ks) -> list:
    """[(mode name, scripted k or None for n-gram drafting)] of an identity run."""
    return [("ngram", None)] + [(f"scripted-k{k}", k) for k in scripted_ks]


def identity(path: str, layers: int, n_tokens: int, threads, scripted_ks=(8,),
             exact: bool = False) -> dict:
    """Plain vs speculative greedy on PROMPTS, n-gram (adaptive) and scripted drafts of each k in
    `scripted_ks` (all correct: every row of every verify batch of k + 1 rows is used), so a
    device's batch sizes can be told apart. `exact`: as --exact runs (the GPU library's row
    limit on, no near-tie guard)."""
    cfg = EngineConfig(proposer="ngram", n_ctx=2048, n_threads=threads, n_gpu_layers=layers,
                       cache_mb=0, exact=exact)   # no saved states: each prompt evaluated cold
    out = {"model": Path(path).name, "prompts": len(PROMPTS), "exact": exact}
    with Engine(path, cfg) as eng, \
            Context(eng.model, ContextParams(2048, n_threads=threads)) as one:
        ngram = eng.proposer
        refs = []
        for prompt in PROMPTS:
            eng.reset()
            gen = eng.generate(prompt, max_tokens=n_tokens, speculate=False)
            refs.append(gen.complete_tokens())
        for mode, k in identity_modes(scripted_ks):
            same, diverged, rechecks, drafted, accepted = 0, [], 0, 0, 0
            for prompt, ref in zip(PROMPTS, refs):
                eng.proposer = ngram if k is None else \
                    ScriptedProposer(ref, "accept", eng.model.n_vocab)
                policy = None if k is None else PolicyConfig(fixed_k=k)
                eng.reset()
                gen = eng.generate(prompt, max_tokens=n_tokens, policy=policy)
                toks = gen.complete_tokens()
                st = gen.stats
                rechecks, drafted, accepted = (rechecks + st.rechecks, drafted + st.drafted,
                                               accepted + st.accepted)
                d = first_divergence(ref, toks)
                if d is None:
                    same += 1
                    continue
                ctx_tokens = eng.tokenize_prompt(prompt) + ref[:d]
                one.clear()          # the last token decoded alone, as in plain decoding
                if len(ctx_tokens) > 1:
                    one.decode(ctx_tokens[:-1], logits="none")
                gap = top2_gap(one.decode(ctx_tokens[-1:])[0], SamplingParams())
                diverged.append({"prompt": prompt, "at": d, "top2_gap": round(gap, 4)})
            out[mode] = {"identical": same, "diverged": diverged, "rechecks": rechecks,
                         "drafted": drafted, "accepted": accepted}
        eng.proposer = ngram
    return out


def parallel(path: str, layers: int, n_tokens: int, threads, n_slots: int = 4) -> dict:
    """The prompts through `n_slots` slots at once (one thread per slot, each taking the next
    prompt) against each prompt alone in a context of a slot's size: identical texts and tokens,
    and tokens/s over the whole set both ways."""
    slot_ctx = 1024
    cfg = EngineConfig(proposer="ngram", n_ctx=slot_ctx, n_threads=threads, n_gpu_layers=layers,
                       cache_mb=0)
    with Engine(path, cfg) as eng:
        t = time.perf_counter()
        alone = []
        for prompt in PROMPTS:
            gen = eng.generate(prompt, max_tokens=n_tokens)
            alone.append(gen.complete_tokens())
        alone_s = time.perf_counter() - t
        out = {"model": Path(path).name, "prompts": len(PROMPTS), "slots": n_slots}
        with Slots(eng.model, replace(cfg, n_ctx=slot_ctx * n_slots),
                   n_slots) as slots:
            jobs: queue.Queue = queue.Queue()
            for i, prompt in enumerate(PROMPTS):
                jobs.put((i, prompt))
            together: list = [None] * len(PROMPTS)
            errors: list = []

            def worker(engine):
                while True:
                    try:
                        i, prompt = jobs.get_nowait()
                    except queue.Empty:
                        return
                    try:
                        together[i] = engine.generate(prompt, max_tokens=n_tokens).complete_tokens()
                    except Exception as e:        # noqa: BLE001  (a result, not a crash)
                        errors.append(f"prompt {i}: {e!r}")
            t = time.perf_counter()
            workers = [threading.Thread(target=worker, args=(e,)) for e in slots.engines]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            slots_s = time.perf_counter() - t
            out["ticks"], out["stalls"] = slots.shared.ticks, slots.shared.stalls
    n_alone = sum(len(a) for a in alone)
    n_together = sum(len(x) for x in together if x is not None)
    diverged = [{"prompt": i, "at": first_divergence(a, x)} for i, (a, x) in
                enumerate(zip(alone, together)) if x is not None and a != x]
    out.update({"identical": sum(1 for a, x in zip(alone, together) if a == x),
                "diverged": diverged, "errors": errors,
                "alone_tps": round(n_alone / alone_s, 1),
                "slots_tps": round(n_together / slots_s, 1),
                "speedup": round((n_together / slots_s) / (n_alone / alone_s), 3)})
    return out


def draft_cost(target: dict, draft_path: str, layers: int, threads) -> dict:
    d = curve(draft_path, layers, 1, threads)
    cost = d["ms_per_step"] / target["ms_per_step"]
    keeps = DraftPolicy(target["ratios"], PolicyConfig(), cost).draft_can_pay()
    return {"draft": d["model"], "draft_ms_per_step": d["ms_per_step"],
            "cost_in_target_steps": round(cost, 3), "draft_can_pay": keeps}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--also", nargs="*", default=[], help="more models: curve + identity")
    ap.add_argument("--gpu-layers", type=int, default=-1)
    ap.add_argument("--k-max", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS),
                    help="identity on the first N of the suite's prompts")
    ap.add_argument("--what", default="curve,identity,draft",
                    help="comma-separated: curve, identity, rows (each row of 2-16-token "
                         "batches against one-token decodes), draft (draft cost needs "
                         "--draft), parallel (the target only)")
    ap.add_argument("--slots", type=int, default=4, help="parallel: slots at once")
    ap.add_argument("--scripted-ks", default="8",
                    help="identity: the k of each scripted-draft run (comma-separated)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--exact", action="store_true",
                    help="rows and identity with the patched GPU library's batch-invariant row "
                         "limit on, as --exact runs them; curve measured with it off, then on")
    ap.add_argument("--contexts", default="200",
                    help="rows: the context lengths to check after (comma-separated)")
    ap.add_argument("--rows-max", type=int, default=16, help="rows: batches of 2..N rows")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    what = {w.strip() for w in a.what.split(",") if w.strip()}
    del PROMPTS[a.prompts:]
    res = {"system": system_info(), "gpu_layers": a.gpu_layers, "curves": [], "identity": [],
           "finished": False}

    def save():       # after every model: a run cut short keeps what it finished
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
    if "parallel" in what:
        res["parallel"] = p = parallel(a.target, a.gpu_layers, a.tokens, a.threads, a.slots)
        print(f"{p['model']}: {p['slots']} slots: {p['identical']}/{p['prompts']} identical to "
              f"their lone run, {p['slots_tps']} tok/s against {p['alone_tps']} one at a time "
              f"({p['speedup']}x), {p['ticks']} ticks, errors {p['errors']}", file=sys.stderr)
        save()
    for path in [a.target, *a.also]:
        t = time.perf_counter()
        if "curve" in what:
            for exact in ((False, True) if a.exact else (False,)):
                res["curves"].append(c := curve(path, a.gpu_layers, a.k_max, a.threads, exact))
                save()
                print(f"{c['model']}{' (row limit on)' if exact else ''}"
                      f"{'' if c['graphs'] else ' (CUDA graphs off)'}: one-token decode "
                      f"{c['ms_per_step']:.2f} ms; r(k) "
                      + " ".join(f"{r:.2f}" for r in c["ratios"]), file=sys.stderr)
                print(f"  policy k at acceptance {ACCEPTANCE}: {c['policy_k']}", file=sys.stderr)
        if "rows" in what:
            for context in (int(x) for x in a.contexts.split(",") if x):
                res.setdefault("rows", []).append(r := rows(
                    path, a.gpu_layers, a.threads, a.rows_max, context, a.exact))
                save()
                print(f"{r['model']} after {context} tokens: rows identical to one-token "
                      "decodes, by batch size: "
                      + ", ".join(f"{n}: {v['identical_rows']}/{n} (max diff {v['max_abs_diff']})"
                                  for n, v in r["by_n"].items()), file=sys.stderr)
        if "identity" in what:
            ks = [int(k) for k in a.scripted_ks.split(",") if k]
            res["identity"].append(i := identity(path, a.gpu_layers, a.tokens, a.threads, ks,
                                                 a.exact))
            save()
            for mode, _ in identity_modes(ks):
                m = i[mode]
                print(f"{i['model']}: identity {mode}: {m['identical']}/{i['prompts']} identical, "
                      f"{m['accepted']}/{m['drafted']} accepted, {m['rechecks']} rechecks, gaps "
                      f"at divergence {[d['top2_gap'] for d in m['diverged']]} "
                      f"({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    if a.draft and "draft" in what and res["curves"]:
        res["draft"] = draft_cost(res["curves"][0], a.draft, a.gpu_layers, a.threads)
        print(f"draft: {res['draft']}", file=sys.stderr)
    res["finished"] = True
    save()


if __name__ == "__main__":
    main()
