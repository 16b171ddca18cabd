"""Slots in one context (llama/slots.py, speculative/parallel.py): every request's text is the
text it gets alone, token for token, greedy or seeded, whatever runs beside it; every row of a
batch that carries several sequences equals that token decoded alone, bit for bit; a stalled,
cancelled or failing request never holds up or changes the others."""

from __future__ import annotations

import os
import queue
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from localspec.errors import LocalspecError
from localspec.llama import Context, ContextParams, batch_invariant_rows
from localspec.llama.exact_rows import exact_rows_settable
from localspec.llama.batch_shape import Step, groups, plan, split_cost, tick_cost, trim
from localspec.llama.slots import SharedContext, _Work
from localspec.speculative.engine import Engine, EngineConfig
from localspec.speculative.parallel import MAX_SLOTS, Slots, check_parallel
from localspec.speculative.sampling import SamplingParams

needs_invariant = pytest.mark.skipif(
    batch_invariant_rows() == 0,
    reason="this process loaded llama.cpp's own libraries: rows are not batch-invariant")

SLOT_CTX = 512
PROMPTS = [
    [{"role": "user", "content": "Add type hints:\ndef area(w, h):\n    return w * h\n\n"
                                 "def perimeter(w, h):\n    return 2 * (w + h)\n"}],
    [{"role": "user", "content": "Write a haiku about rain."}],
    [{"role": "user", "content": "Explain what a hash map is in two sentences."}],
    [{"role": "user", "content": "Repeat this list exactly: apple, pear, plum, fig, kiwi."}],
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    [{"role": "user", "content": "Name three prime numbers."}],
]


def config(n_slots: int = 1, **kw) -> EngineConfig:
    return EngineConfig(n_ctx=SLOT_CTX * n_slots, proposer="ngram", cache_mb=0,
                        n_threads=2, **kw)


def run_alone(model, requests, **kw) -> list:
    """Each request's (text, tokens) from a lone engine with a slot's context size (kw: more
    EngineConfig fields, e.g. the device lane's exact=True, n_gpu_layers=-1)."""
    out = []
    with Engine(model, config(**kw)) as engine:
        for r in requests:
            gen = engine.generate(r["prompt"], r["sampling"], max_tokens=r["max_tokens"],
                                  speculate=r["speculate"])
            out.append(("".join(gen), list(gen.tokens)))
    return out


def run_together(slots: Slots, requests) -> list:
    """The requests through the slots: one thread per slot takes the next request in order
    (more requests than slots queue), each after its own start delay."""
    jobs: queue.Queue = queue.Queue()
    for i, r in enumerate(requests):
        jobs.put((i, r))
    out: list = [None] * len(requests)

    def worker(engine):
        while True:
            try:
                i, r = jobs.get_nowait()
            except queue.Empty:
                return
            time.sleep(r["delay"])
            gen = engine.generate(r["prompt"], r["sampling"], max_tokens=r["max_tokens"],
                                  speculate=r["speculate"])
            out[i] = ("".join(gen), list(gen.tokens))

    threads = [threading.Thread(target=worker, args=(e,)) for e in slots.engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads)
    return out


def random_requests(rng: random.Random, n: int) -> list:
    reqs = []
    for _ in range(n):
        seeded = rng.random() < 0.4
        reqs.append({
            "prompt": rng.choice(PROMPTS),
            "sampling": SamplingParams(temperature=0.8, seed=rng.randrange(1000)) if seeded
            else SamplingParams(),
            "max_tokens": rng.randrange(4, 48),
            "speculate": rng.random() < 0.8,
            "delay": rng.choice([0.0, 0.0, 0.05, 0.3]),
        })
    return reqs


@needs_invariant
@pytest.mark.parametrize("case", range(4))
def test_random_concurrent_requests_give_their_lone_text(smollm, case):
    rng = random.Random(case)
    n_slots = 2 + case % 3                     # 2, 3, 4, 2 slots
    requests = random_requests(rng, n_slots + rng.randrange(0, 3))
    alone = run_alone(smollm, requests)
    with Slots(smollm, config(n_slots), n_slots) as slots:
        slots.prepare()           # as serve and summarize do: the curve before requests arrive
        together = run_together(slots, requests)
        assert slots.shared.ticks > 0
    for i, (a, t) in enumerate(zip(alone, together)):
        assert t == a, f"request {i} ({requests[i]['sampling']}) differs beside others"


@needs_invariant
def test_slots_that_start_before_the_curve_is_measured_measure_it_once_safely(
        smollm, tmp_path, monkeypatch):
    """No prepare() and no cached curve: the first speculative request measures it on its slot
    (held busy, so other slots' ticks never pad rows into it) while the others wait or decode
    plainly, and every text is its lone one. The race this guards against (padding rows into a
    slot that was measuring: "inconsistent sequence positions") showed in 1 of 3 runs of a
    4-slot script and once in a loaded full-suite run; this test did not catch it reliably."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(os.environ["LOCALSPEC_HOME"] + "/models",
                                 target_is_directory=True)
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))           # no cached calibration
    monkeypatch.setenv("LOCALSPEC_CALIBRATION_S", "1.5")
    requests = [{"prompt": PROMPTS[i % len(PROMPTS)], "sampling": SamplingParams(),
                 "max_tokens": 24, "speculate": i % 3 != 0, "delay": 0.0} for i in range(12)]
    with Slots(smollm, config(4), 4) as slots:         # first: it measures the curve
        together = run_together(slots, requests)
        assert slots.engines[0].drafting.cost is not None
    assert together == run_alone(smollm, requests)


@needs_invariant
def test_every_row_of_a_batch_of_several_sequences_equals_a_lone_decode(smollm):
    """One llama_decode carrying 1, 6 and 12 rows of three sequences (llama.cpp splits it by
    sequence): each row against the same token decoded alone, in a lone context."""
    assert several_sequences_mismatch(smollm) == []


def several_sequences_mismatch(model) -> list:
    """(sequence, rows) whose rows of one shared decode of three sequences (1, 6 and 12 rows)
    differ from the same tokens decoded alone in a lone context (the device lane's test too)."""
    prompts = [model.tokenize(p * 6) for p in ("alpha beta gamma ", "one two three ",
                                                 "def f(x): return x ")]
    conts = [[(31 * i + 7 * s + 3) % model.n_vocab for i in range(n)]
             for s, n in enumerate((1, 6, 12))]
    shared = SharedContext(model, ContextParams(n_ctx=SLOT_CTX * 3, n_threads=2), 3, 31)
    try:
        for slot, prompt in zip(shared.slots, prompts):
            slot.decode(prompt, logits="none")
        works = [_Work(s, cont, len(prompts[s]), np.ones(len(cont), dtype=np.int8), False)
                 for s, cont in enumerate(conts)]
        shared._run(works)
        assert all(w.rc == 0 for w in works)
    finally:
        shared.close()
    found = []
    for s, (prompt, cont) in enumerate(zip(prompts, conts)):
        with Context(model, ContextParams(n_ctx=SLOT_CTX, n_threads=2)) as lone:
            lone.decode(prompt, logits="none")
            single = np.stack([lone.decode([t], logits="last")[0].copy() for t in cont])
        differing = [i for i in range(len(cont))
                     if not np.array_equal(works[s].rows[i], single[i])]
        if differing:
            found.append((s, differing))
    return found


def test_a_stalled_reader_does_not_stall_the_other_slots(smollm):
    """A client that stops reading its stream holds its slot, not the others: a tick waits at
    most MAX_WAIT_S for it."""
    requests = [{"prompt": PROMPTS[1], "sampling": SamplingParams(), "max_tokens": 24,
                 "speculate": True, "delay": 0.0}]
    alone = run_alone(smollm, requests)
    with Slots(smollm, config(2), 2) as slots:
        stalled = slots.engines[0].generate(PROMPTS[2], max_tokens=40)
        next(iter(stalled))                    # started, then never read again
        done = run_together(type("One", (), {"engines": slots.engines[1:]})(), requests)
        stalls, ticks = slots.shared.stalls, slots.shared.ticks
        stalled.close()
    assert done == alone
    assert stalls == 1 and ticks > 10          # waited for once, not at every tick


@needs_invariant
def test_a_cancelled_and_a_failing_request_leave_the_others_intact(smollm):
    good = [{"prompt": PROMPTS[0], "sampling": SamplingParams(), "max_tokens": 40,
             "speculate": True, "delay": 0.0}]
    alone = run_alone(smollm, good)
    cancel = threading.Event()
    results: dict = {}
    with Slots(smollm, config(3), 3) as slots:
        def cancelled():
            gen = slots.engines[1].generate("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,",
                                            max_tokens=2000, cancel=cancel)
            pieces = []
            for piece in gen:
                pieces.append(piece)
                if len(pieces) == 5:
                    cancel.set()               # while the others run
            results["cancelled"] = ("".join(pieces), gen.stats.stop_reason)

        def failing():
            try:
                slots.engines[2].generate("x " * (2 * SLOT_CTX), max_tokens=8)
            except LocalspecError as e:
                results["failed"] = str(e)

        def running():
            results["good"] = run_together(type("One", (), {"engines": slots.engines[:1]})(),
                                           good)

        threads = [threading.Thread(target=f) for f in (running, cancelled, failing)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        # the cancelled slot is free again: it serves the next request as if alone
        again = run_together(type("One", (), {"engines": slots.engines[1:2]})(), good)
    assert results["good"] == alone and again == alone
    assert results["cancelled"][1] == "cancelled"
    assert "context holds" in results["failed"]


def test_parallel_values_that_cannot_work_are_one_line_errors():
    for n, ctx, words in ((0, 4096, "1..16"), (-2, 4096, "1..16"), (MAX_SLOTS + 1, 65536, "1..16"),
                          (4, 768, "at least 1024 tokens")):
        with pytest.raises(LocalspecError, match=words) as info:
            check_parallel(n, ctx)
        assert "\n" not in str(info.value)
    check_parallel(1, 256)
    check_parallel(4, 1024)


def test_a_draft_model_is_refused_with_parallel(tiny_model):
    with pytest.raises(LocalspecError, match="n-gram lookup or plain"):
        Slots(tiny_model, EngineConfig(n_ctx=1024, proposer="draft", draft="x"), 2)


def test_slots_on_the_tiny_model_give_their_lone_text(tiny_model):
    """Without the invariant-kernel assumption (any library): the tiny model's plain text per
    slot, three at once."""
    reqs = [{"prompt": p, "sampling": SamplingParams(), "max_tokens": 20, "speculate": False,
             "delay": 0.0} for p in ("abc abc abc", "hello world", "zzz")]
    alone = run_alone(tiny_model, reqs)
    with Slots(tiny_model, config(3), 3) as slots:
        assert slots.n_ctx == SLOT_CTX
        assert run_together(slots, reqs) == alone


def test_steps_are_padded_to_one_pass_only_where_that_is_cheaper():
    flat = lambda n: 1.0 + 0.05 * (n - 1)             # noqa: E731  rows nearly free
    steep = lambda n: float(n)                         # noqa: E731  every row a decode
    free = {s: 100 for s in range(4)}
    # llama.cpp's split: {0: 1, 1: 1, 2: 9} is 3 rows, then 8 rows
    assert split_cost({0: 1, 1: 1, 2: 9}, steep) == 11
    assert split_cost({0: 2, 2: 2}, flat) == 2 * flat(2)          # a gap: two passes
    assert plan({0: 1, 1: 1, 2: 9}, free, flat, 31) == 9
    assert plan({0: 1, 1: 1, 2: 9}, free, steep, 31) is None
    assert plan({0: 2, 2: 2}, free, flat, 31) == 2                 # the idle slot 1 padded
    assert plan({0: 3, 1: 3}, free, flat, 31) is None              # one pass already
    assert plan({0: 1, 1: 16, 2: 16}, free, flat, 31) is None      # 48 rows: over the cap
    assert plan({0: 2, 2: 2}, {0: 100, 1: 1, 2: 100}, flat, 31) is None   # slot 1 is full


def test_a_tick_cuts_drafts_that_would_cost_more_than_they_bring():
    linear = lambda n: 1.0 + 0.6 * (n - 1)            # noqa: E731  an AMD part's verify cost
    flat = lambda n: 1.0 + 0.05 * (n - 1)             # noqa: E731
    halves = tuple(0.5 ** (j + 1) for j in range(5))
    plain = {s: Step(0) for s in range(3)}
    # beside three single rows, five drafts of falling worth cost a pass of their own: cut
    assert trim({**plain, 3: Step(5, halves)}, linear, 68) == {0: 0, 1: 0, 2: 0, 3: 0}
    # fifteen sure drafts bring more than their pass costs: kept
    sure = (1.0,) * 15
    assert trim({**plain, 3: Step(15, sure)}, linear, 68)[3] == 15
    # two slots drafting four likely tokens each on a flat curve: one padded pass, kept
    likely = (0.9, 0.8, 0.7, 0.6)
    assert trim({0: Step(4, likely), 1: Step(4, likely), 2: Step(0)}, flat, 68) == \
        {0: 4, 1: 4, 2: 0}
    # over the row cap the steps run in groups of at most row_cap rows, in slot order
    assert groups({0: 40, 1: 1, 2: 40}, 68) == [{0: 40, 1: 1}, {2: 40}]
    assert tick_cost({0: 40, 1: 1, 2: 40}, linear, 68) == \
        split_cost({0: 40, 1: 1}, linear) + linear(40)


@needs_invariant
def test_a_tick_that_cuts_a_step_keeps_its_rows_and_cache_exact(smollm):
    """Three slots hand in steps of 1, 1 and 6 rows; on a curve where a second pass is dear the
    tick cuts the third to its first row: that row equals a lone decode, and the slot's cache
    and token list hold exactly what was decoded."""
    model = smollm
    prompts = [model.tokenize(p * 6) for p in ("alpha beta gamma ", "one two three ",
                                                 "def f(x): return x ")]
    conts = [[101], [202], [303, 304, 305, 306, 307, 308]]
    shared = SharedContext(model, ContextParams(n_ctx=SLOT_CTX * 3, n_threads=2), 3, 31)
    try:
        for slot, prompt in zip(shared.slots, prompts):
            slot.decode(prompt, logits="none")
        shared.row_cost = lambda n: 1.0 if n <= 3 else 100.0
        works = [_Work(s, cont, len(prompts[s]), np.ones(len(cont), dtype=np.int8), False,
                       (0.5,) * (len(cont) - 1)) for s, cont in enumerate(conts)]
        with shared.lock:
            shared._pending = {w.seq: w for w in works}
            shared._tick()
        assert [len(w.rows) for w in works] == [1, 1, 1] and shared.cut == 5
        assert shared.slots[2].rows_held() == len(prompts[2]) + 1
        row = works[2].rows[0].copy()
    finally:
        shared.close()
    with Context(model, ContextParams(n_ctx=SLOT_CTX, n_threads=2)) as lone:
        lone.decode(prompts[2], logits="none")
        assert np.array_equal(lone.decode([303], logits="last")[0], row)


@needs_invariant
def test_slots_whose_drafts_are_cut_give_their_lone_text(smollm):
    """Every tick with two busy slots cuts every draft (a curve where a second pass is dear):
    the steps verify fewer drafts than they proposed, and each text is still the lone one."""
    requests = [{"prompt": PROMPTS[i % 2 * 3], "sampling": SamplingParams(), "max_tokens": 40,
                 "speculate": True, "delay": 0.0} for i in range(4)]
    alone = run_alone(smollm, requests)
    with Slots(smollm, config(2), 2) as slots:
        slots.prepare()
        slots.shared.row_cost = lambda n: 1.0 if n <= 2 else 100.0
        assert run_together(slots, requests) == alone
        assert slots.shared.cut > 0


@needs_invariant
def test_slots_share_the_draft_store_and_keep_their_lone_text(smollm, tmp_path, monkeypatch):
    """A reply one slot wrote joins the shared store when it ends; the same question on the
    other slot then drafts it from the store, and gives the text it gives alone."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    question = [{"role": "user", "content": "Write a short poem about the sea and the moon."}]
    alone = run_alone(smollm, [{"prompt": question, "sampling": SamplingParams(),
                                "max_tokens": 40, "speculate": True}])[0]
    with Slots(smollm, config(2, store=True, store_disk=False), 2) as slots:
        slots.prepare()
        first = slots.engines[0].generate(question, max_tokens=40)
        assert ("".join(first), list(first.tokens)) == alone
        second = slots.engines[1].generate(question, max_tokens=40)
        assert ("".join(second), list(second.tokens)) == alone
        assert second.stats.accepted_by_source.get("store", 0) > 0
    assert not list(tmp_path.glob("store/*"))                 # memory only, as configured


@needs_invariant
def test_a_prompt_another_slot_holds_starts_from_a_copy_of_its_rows(smollm):
    """Two questions about one document: the second slot copies the first one's whole prompt
    chunks (llama_memory_seq_cp between KV buffers) and still gets its lone text."""
    doc = "Notes on the slot scheduler. " + " ".join(f"Item {i} is {i * i}." for i in range(30))
    requests = [{"prompt": [{"role": "user", "content": doc + "\n\nWhat is item 7?"}],
                 "sampling": SamplingParams(), "max_tokens": 24, "speculate": True,
                 "delay": 0.0},
                {"prompt": [{"role": "user", "content": doc + "\n\nWhat is item 9?"}],
                 "sampling": SamplingParams(), "max_tokens": 24, "speculate": True,
                 "delay": 0.0}]
    alone = run_alone(smollm, requests)
    with Slots(smollm, config(2), 2) as slots:
        first = run_together(type("One", (), {"engines": slots.engines[:1]})(), requests[:1])
        gen = slots.engines[1].generate(requests[1]["prompt"], max_tokens=24)
        second = ("".join(gen), list(gen.tokens))
        assert slots.shared.copies == 1
        assert gen.stats.prefill_tokens < 64 + 16         # only the tail past the copied chunks
    assert [*first, second] == alone


@pytest.mark.skipif(not exact_rows_settable(),
                    reason="this ggml-cpu cannot raise its batch-invariant limit at run time")
def test_steps_past_32_rows_together_still_give_their_lone_text(smollm):
    """row_cap 64: four slots drafting up to 15 tokens each, ticks of 32-64 rows on the raised
    batch-invariant limit."""
    rng = random.Random(42)
    requests = random_requests(rng, 5)
    for r in requests:
        r["prompt"], r["speculate"] = PROMPTS[0], True       # code: long lookup drafts
    alone = run_alone(smollm, requests)
    with Slots(smollm, config(4), 4, row_cap=64) as slots:
        assert run_together(slots, requests) == alone


def test_steps_past_32_rows_need_the_run_time_limit(smollm):
    if exact_rows_settable():
        pytest.skip("this ggml-cpu raises its limit at run time")
    with pytest.raises(LocalspecError, match="at run time"):
        Slots(smollm, config(2), 2, row_cap=64)


def test_slots_run_on_llama_cpps_own_libraries(tiny_path):
    """Where rows promise no exactness (llama.cpp's own ggml-cpu, LOCALSPEC_EXACT=0, as on a
    GPU build), slots still serve: the wide-tick row limit is not a run-time-limit requirement there
    (the offline GPU recipe's rehearsal found `--parallel` refused on such a build)."""
    code = f"""
import threading
from localspec.llama import batch_invariant_rows
from localspec.speculative.engine import EngineConfig
from localspec.speculative.parallel import Slots
assert batch_invariant_rows() == 0
cfg = EngineConfig(n_ctx=1024, proposer="ngram", cache_mb=0, n_threads=1)
with Slots({str(tiny_path)!r}, cfg, 2) as slots:
    out = [None, None]
    def run(i):
        out[i] = "".join(slots.engines[i].generate("abc abc abc", max_tokens=12))
    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in ts]; [t.join() for t in ts]
    assert out[0] and out[0] == out[1], out
    print("ok", slots.shared.row_cap, slots.shared.ticks)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, LOCALSPEC_EXACT="0"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("ok 66 ")          # K_LIMIT + 2: one draft at most beside
                                                   # the other slot's row
