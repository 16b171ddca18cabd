"""Per-step Python overhead of speculative decoding: time inside llama.cpp vs everything else.

On a GPU a 1.5B decode step takes a few milliseconds, so what Python does around it (propose,
batch setup, logits rows, sampler chain per row, verification, bookkeeping) becomes a large
share. This drives the real engine with a fixed k and times it from outside: llama_decode and
llama_get_logits (which waits for the GPU) are "device" time, everything else in a step is
overhead. "engine" runs step.step as shipped (greedy point-mass drafts: greedy.greedy_verify's
one pass); "per-row" runs it with one_pass=False (verify() over target_dist() rows, then the
near-tie guard: the step before the one pass), everything around it being the engine's own code.
A scripted proposer makes every step draft exactly k tokens:

  accept   drafts the reference (plain greedy) output: every row is verified, k+1 tokens a step
  reject   drafts a wrong first token: k+1 rows decoded, verification stops at row 0

    python scripts/bench/step_overhead.py MODEL.gguf [--ks 0,4,8,16] [--tokens 128]
           [--gpu-layers -1]
    python scripts/bench/step_overhead.py --tiny ...   # the test suite's tiny model (sub-ms decode)
    ... --per-row         also the per-row path (step one_pass=False), interleaved case by case
    ... --device-argmax   also the engine with each row's argmax made on the device
                          (EngineConfig.device_argmax: only the tokens come back), interleaved
    ... --profile N       cProfile a k=N accept run of each step; top functions by own time
    ... --json out.json
    python scripts/bench/step_overhead.py --rows 151936 [--ks ...]   # verification alone, no model
    python scripts/bench/step_overhead.py MODEL.gguf --adaptive [--threads 2] [--reps 3]

--adaptive: what the n-gram mode itself costs per step on the CPU, where the policy mostly
drafts nothing (chat): plain decoding and the real n-gram proposer with the adaptive policy,
interleaved prompt by prompt, on three chat questions; "overhead" is then the step's Python
(proposer, policy, learning, sampling, bookkeeping) and the loop around it. "same" may read
NO there: greedy speculation can part from plain at a near-tie (README, "Exactness").
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tools/

import localspec.speculative.engine
from localspec.llama import backend as llama   # its `C`, patched below to time calls
from localspec.speculative.engine import Engine, EngineConfig
from localspec.speculative.greedy import greedy_verify
from localspec.policy.config import PolicyConfig
from localspec.policy.acceptance import Offer
from localspec.speculative.proposers import Proposal, Proposer
from localspec.speculative.sampling import PositionStream, SamplingParams, target_dist
from localspec.speculative.step import near_tie, step as step_fn
from localspec.speculative.verify import verify

STEP = localspec.speculative.engine.step        # step.step, as the engine imported it
PER_ROW = functools.partial(step_fn, one_pass=False)

PROMPTS = [
    "Rewrite this function with type hints:\ndef add(a, b):\n    return a + b\n",
    "Summarize in two sentences: speculative decoding drafts tokens cheaply and verifies them "
    "in one batch, keeping only what the model agrees with.",
]


class ScriptedProposer(Proposer):
    """Drafts exactly k tokens per step from a known continuation: the right ones ("accept") or
    a wrong first token ("reject"). Same lifecycle as the real proposers."""

    name = "scripted"

    def __init__(self, reference: list, mode: str, n_vocab: int):
        self.reference, self.mode, self.n_vocab, self.pos = reference, mode, n_vocab, 0

    def begin(self, history, document=None, sampling=None, seed: int = 0) -> None:
        self.pos = 0

    def offers(self, limit: int) -> list:
        limit = min(limit, len(self.reference) - self.pos)
        return [Offer("scripted", limit)] if limit > 0 else []

    def draft(self, offer: Offer, k: int) -> Proposal:
        drafts = self.reference[self.pos:self.pos + k]
        if self.mode == "reject":
            drafts = [(drafts[0] + 1) % self.n_vocab] + drafts[1:]
        return Proposal(list(drafts), None, "scripted")

    def accept(self, tokens) -> None:
        self.pos += len(tokens)

    def close(self) -> None:
        pass


class DeviceClock:
    """Wraps llama_decode and llama_get_logits (through localspec.llama's handle on llama_cpp)
    and sums the time spent inside them. On CUDA llama_decode may return before the GPU is done;
    llama_get_logits synchronizes, so the two together are the device's share."""

    NAMES = ("llama_decode", "llama_get_logits", "llama_get_sampled_token_ith")

    def __init__(self):
        self.seconds, self.calls, self._saved = 0.0, 0, {}

    def __enter__(self):
        for name in self.NAMES:
            real = getattr(llama.C, name)
            self._saved[name] = real
            setattr(llama.C, name, self._timed(real))
        return self

    def _timed(self, real):
        def call(*args):
            t = time.perf_counter()
            try:
                return real(*args)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1
        return call

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(llama.C, name, real)


def timed_steps(engine: Engine, clock: DeviceClock) -> list:
    """Replace engine._step (this instance only) with a wrapper that records, per step, its wall
    time, the device time inside it, the stats' propose/verify/sample deltas, and the loop time
    since the previous step returned."""
    samples, last = [], {"end": None}
    inner = engine._step

    def wrapped(req):
        st = req.stats
        before = (st.propose_ms, st.verify_ms, st.sample_ms)
        d0, t0 = clock.seconds, time.perf_counter()
        out = inner(req)
        t1 = time.perf_counter()
        device = 1000 * (clock.seconds - d0)
        wall = 1000 * (t1 - t0)
        loop = 1000 * (t0 - last["end"]) if last["end"] is not None else 0.0
        last["end"] = t1
        samples.append({"device_ms": device, "overhead_ms": wall - device + loop,
                        "propose_ms": st.propose_ms - before[0],
                        "decode_python_ms": st.verify_ms - before[1] - device,
                        "verify_sample_ms": st.sample_ms - before[2], "loop_ms": loop,
                        "emitted": len(out)})
        return out
    engine._step = wrapped
    return samples


def timed_generation(engine, prompt, sampling, prof=None, **generate):
    """One cold generation with every step timed (timed_steps): (samples, the Generation)."""
    with DeviceClock() as clock:
        samples = timed_steps(engine, clock)
        try:
            engine.reset()
            gen = engine.generate(prompt, sampling, **generate)
            if prof:
                prof.enable()
            gen.complete()
            if prof:
                prof.disable()
        finally:
            engine.__dict__.pop("_step", None)
    return samples, gen


def run_case(engine, prompt, reference, k, mode, sampling, per_row, profile, argmax=False):
    """One generation at fixed k: its per-step samples (ms), identity and tokens per step.
    argmax: the argmax on the device (EngineConfig.device_argmax, no near-tie guard)."""
    config = engine.config
    if argmax:
        engine.config = dataclasses.replace(config, device_argmax=True, tie_margin=0.0)
    if k:
        engine.proposer = ScriptedProposer(reference, mode, engine.model.n_vocab)
    # Engine._step calls the module-level name `step`: the per-row path goes in there, for this
    # generation only, so propose, bookkeeping and the loop stay the engine's own.
    localspec.speculative.engine.step = PER_ROW if per_row else STEP
    prof = cProfile.Profile() if profile else None
    try:
        samples, gen = timed_generation(engine, prompt, sampling, prof,
                                        max_tokens=len(reference), speculate=k > 0,
                                        policy=PolicyConfig(k_max=max(k, 1), fixed_k=k))
    finally:
        localspec.speculative.engine.step = STEP
        engine.config = config
    return samples, gen.tokens == reference, prof


CHATS = ["Explain how binary search works and when it fails, in one paragraph.",
         "Write three haiku about a lighthouse in winter.",
         "When should I add an index to a SQL table? Two short paragraphs."]


def measure_adaptive(model: str, n_tokens, threads, reps):
    """Rows for plain and for the n-gram proposer with the engine's adaptive policy, each chat
    prompt run both ways in turn (order flipped every rep), cold prompt each time."""
    sampling = SamplingParams(temperature=0.0)
    cfg = EngineConfig(proposer="ngram", n_ctx=2048, n_threads=threads, cache_mb=0)
    samples = {"plain": [], "ngram": []}
    drafted, same = 0, True
    with Engine(model, cfg) as engine:
        engine.prepare()                     # the cost curve, before anything is timed
        for rep in range(reps):
            for text in CHATS:
                msgs = [{"role": "user", "content": text}]
                outs = {}
                for mode in (("plain", "ngram") if rep % 2 == 0 else ("ngram", "plain")):
                    got, gen = timed_generation(engine, msgs, sampling, max_tokens=n_tokens,
                                                speculate=mode == "ngram")
                    samples[mode] += got
                    outs[mode] = gen.tokens
                    drafted += gen.stats.drafted if mode == "ngram" else 0
                same &= outs["plain"] == outs["ngram"]
    rows = [{"step": "engine", "k": "auto" if mode == "ngram" else 0, "mode": mode,
             **summarize(samples[mode], same)} for mode in ("plain", "ngram")]
    rows[1]["drafted"] = drafted
    return rows


def per_row_verify(rows, drafts, sampling, recent, margin):
    """What step.step's per-row path does after the decode (one_pass=False): verify() over
    target_dist() rows, then near_tie() over top2_gap() rows."""
    verdict = verify(drafts, None, lambda i: target_dist(rows[i], sampling, recent + drafts[:i]),
                     PositionStream(1), out_pos=0)
    if drafts:
        near_tie(rows, verdict.n_accepted, sampling, recent, drafts, margin)
    return verdict


def bench_rows(n_vocab: int, ks, penalty: float, reps: int = 200) -> list:
    """Verification alone on random rows [k + 1, n_vocab]: the engine's per-row path vs
    greedy.greedy_verify's one pass, drafts all accepted or the first rejected. Best of `reps`,
    in ms."""
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=0.0, repeat_penalty=penalty)
    recent = [int(t) for t in rng.integers(0, n_vocab, 64)] if penalty != 1.0 else []
    out = []
    for k in ks:
        rows = (rng.standard_normal((k + 1, n_vocab)) * 4).astype(np.float32)
        good = [int(np.argmax(r)) for r in rows[:k]]
        for mode, drafts in (("accept", good), ("reject", [(good[0] + 1) % n_vocab] + good[1:]
                                                  if k else [])):
            times = {"per-row": float("inf"), "one-pass": float("inf")}
            for _ in range(reps):
                for name in times:
                    work = rows.copy()           # the one pass penalises in place
                    t = time.perf_counter()
                    (per_row_verify if name == "per-row" else greedy_verify)(
                        work, drafts, sampling, recent, 0.25)
                    times[name] = min(times[name], time.perf_counter() - t)
            out.append({"k": k, "mode": mode, **{n: 1000 * v for n, v in times.items()}})
            if k == 0:
                break
    return out


def tiny_model(folder: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tinymodel import make_tiny_gguf
    return make_tiny_gguf(folder / "tiny.gguf", seed=0, logit_scale=3.0)


def summarize(samples: list, identical: bool) -> dict:
    """Median of each per-step column over every step of every run: a shared machine preempts
    the process now and then, and a median ignores those steps where a mean would not."""
    out = {key: statistics.median(x[key] for x in samples) for key in samples[0]
           if key != "emitted"}
    out.update(steps=len(samples), identical=identical,
               tokens_per_step=sum(x["emitted"] for x in samples) / len(samples),
               overhead_mean_ms=trimmed_mean([x["overhead_ms"] for x in samples]))
    return out


def trimmed_mean(xs: list, cut: float = 0.01) -> float:
    """Mean without the slowest `cut` of the values (a descheduled step), so work done every
    few steps (the cost model's re-fit every 16 timings) counts, which a median hides.

    >>> every_16th = ([1.0] * 15 + [17.0]) * 6          # its median is 1.0
    >>> trimmed_mean(every_16th), trimmed_mean([1.0] * 99 + [100.0])
    (2.0, 1.0)
    """
    xs = sorted(xs)
    keep = xs[:max(1, len(xs) - int(cut * len(xs)))]
    return sum(keep) / len(keep)


def measure(model: str, ks, n_tokens, gpu_layers, threads, penalty, steps, profile_k, reps):
    """Rows per (step, k, mode); with both steps, each case runs with one then the other, so
    the two see the same machine state (interleaved in one process)."""
    sampling = SamplingParams(temperature=0.0, repeat_penalty=penalty)
    cfg = EngineConfig(proposer="ngram", n_ctx=2048, n_threads=threads, n_gpu_layers=gpu_layers,
                       cache_mb=0, policy=PolicyConfig(k_max=max(max(ks), 1)))
    rows, profiles = [], {}
    with Engine(model, cfg) as engine:
        ngram = engine.proposer                  # put back before close, which closes it
        refs = [engine.generate(p, sampling, max_tokens=n_tokens, speculate=False)
                .complete_tokens() for p in PROMPTS]
        for k in ks:
            for mode in (("plain",) if k == 0 else ("accept", "reject")):
                samples = {step: [] for step in steps}
                same = {step: True for step in steps}
                for _ in range(reps):
                    for prompt, ref in zip(PROMPTS, refs):
                        for step in steps:
                            want = profile_k == k and mode == "accept" and step not in profiles
                            got, identical, prof = run_case(engine, prompt, ref, k, mode,
                                                            sampling, step == "per-row", want,
                                                            step == "argmax")
                            samples[step] += got
                            same[step] &= identical
                            if prof:
                                out = io.StringIO()
                                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                                profiles[step] = out.getvalue()
                rows += [{"step": step, "k": k, "mode": mode,
                          **summarize(samples[step], same[step])} for step in steps]
        engine.proposer = ngram
    return rows, profiles


def report(rows, label: str) -> None:
    print(f"# {label}")
    print(f"{'step':9} {'k':>3} {'mode':7} {'tok/step':>8} {'device':>8} {'overhead':>8} "
          f"{'propose':>8} {'decode.py':>9} {'verify':>8} {'loop':>7}  share of 3 / 5 ms  same")
    for r in rows:
        share = [r["overhead_ms"] / (g + r["overhead_ms"]) for g in (3.0, 5.0)]
        print(f"{r['step']:9} {r['k']:>3} {r['mode']:7} {r['tokens_per_step']:8.2f} "
              f"{r['device_ms']:8.3f} {r['overhead_ms']:8.3f} {r['propose_ms']:8.3f} "
              f"{r['decode_python_ms']:9.3f} {r['verify_sample_ms']:8.3f} {r['loop_ms']:7.3f}  "
              f"{100 * share[0]:5.1f}% / {100 * share[1]:4.1f}%   "
              f"{'yes' if r['identical'] else 'NO'}")
    print("(median ms per step; device = llama_decode + llama_get_logits; overhead = the rest of "
          "the step + the loop since the previous step; share = overhead / (GPU step + overhead))")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tiny", action="store_true", help="use the test suite's tiny model")
    ap.add_argument("--ks", default="0,4,8,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--gpu-layers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat-penalty", type=float, default=1.0)
    ap.add_argument("--per-row", action="store_true",
                    help="also the per-row step (one_pass=False), interleaved case by case with "
                         "the engine's")
    ap.add_argument("--device-argmax", action="store_true",
                    help="also the engine with the argmax on the device (llama.cpp's greedy "
                         "backend sampler: each row's token comes back, not its logits; no "
                         "near-tie guard), interleaved case by case with the engine's")
    ap.add_argument("--profile", type=int, default=None, metavar="K")
    ap.add_argument("--rows", type=int, metavar="N_VOCAB",
                    help="verification alone on random rows of this vocabulary size (no model)")
    ap.add_argument("--adaptive", action="store_true",
                    help="plain vs the n-gram proposer with the adaptive policy, on chats")
    ap.add_argument("--json")
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    if a.rows:
        print(f"# verification of k+1 random rows of {a.rows} logits, repeat_penalty "
              f"{a.repeat_penalty}, best of 200 (ms); load {os.getloadavg()[0]:.1f}")
        for r in bench_rows(a.rows, ks, a.repeat_penalty):
            print(f"k={r['k']:2d} {r['mode']:6}  per-row {r['per-row']:7.3f}  one-pass "
                  f"{r['one-pass']:7.3f}  ({r['per-row'] / r['one-pass']:.1f}x)")
        return
    if not a.model and not a.tiny:
        ap.error("give MODEL.gguf, --tiny or --rows N")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp))) if a.tiny else a.model
        load0 = os.getloadavg()
        if a.adaptive:
            rows, profiles = measure_adaptive(model, a.tokens, a.threads, a.reps), {}
        else:
            steps = ("engine",) + (("per-row",) if a.per_row else ()) + \
                (("argmax",) if a.device_argmax else ())
            rows, profiles = measure(model, ks, a.tokens, a.gpu_layers, a.threads,
                                     a.repeat_penalty, steps, a.profile, a.reps)
    label = (f"{'tiny model' if a.tiny else Path(a.model).name}, gpu_layers {a.gpu_layers}, "
             f"threads {a.threads or 'all'}, repeat_penalty {a.repeat_penalty}, {a.tokens} tokens"
             f" x {len(CHATS if a.adaptive else PROMPTS)} prompts x {a.reps}; load {load0[0]:.1f} -> "
             f"{os.getloadavg()[0]:.1f}")
    report(rows, label)
    if a.adaptive:
        plain, ngram = rows
        extra = ngram["overhead_ms"] - plain["overhead_ms"]
        mean = ngram["overhead_mean_ms"] - plain["overhead_mean_ms"]
        print(f"n-gram mode over plain: {extra:+.3f} ms a step outside llama.cpp (median; "
              f"{mean:+.3f} ms as a mean without the slowest 1%), "
              f"{100 * mean / (plain['device_ms'] + plain['overhead_mean_ms']):+.2f}% of a "
              f"plain step; {ngram['drafted']} tokens drafted in all")
    for step, text in profiles.items():
        print(f"# cProfile, {step} step, k={a.profile} accept\n{text}", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps({"label": label, "system": llama.system_info(),
                                            "rows": rows, "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
