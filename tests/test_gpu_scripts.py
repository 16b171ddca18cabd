"""The GPU run's measurement scripts (scripts/step_overhead.py, scripts/gpu_measure.py) still drive
the engine correctly, on the tiny model and the CPU: a device session gets few tries, so a script
broken by an engine change must fail here first. Also the CPU kernel probe beside them
(scripts/tiled_crossover.py), whose child processes must keep loading a model. Only what the
scripts decide is checked (identity, step counts, the prototype swapped in and out); their
timings are not."""

from __future__ import annotations

import doctest
import importlib.util
import sys
from pathlib import Path

import localspec.speculative.engine
from localspec.speculative.step import step

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load(name):
    if str(SCRIPTS) not in sys.path:              # gpu_measure imports step_overhead by name
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_overhead_runs_engine_and_prototype_to_the_same_output(tiny_path):
    so = load("step_overhead")
    rows, profiles = so.measure(str(tiny_path), ks=[0, 3], n_tokens=12, gpu_layers=0, threads=1,
                                penalty=1.1, steps=("engine", "prototype"), profile_k=3, reps=1)
    assert [(r["step"], r["k"], r["mode"]) for r in rows] == [
        ("engine", 0, "plain"), ("prototype", 0, "plain"), ("engine", 3, "accept"),
        ("prototype", 3, "accept"), ("engine", 3, "reject"), ("prototype", 3, "reject")]
    assert all(r["identical"] for r in rows)      # scripted drafts never change greedy output
    by = {(r["step"], r["k"], r["mode"]): r for r in rows}
    for k, mode in ((0, "plain"), (3, "accept"), (3, "reject")):
        engine, proto = by[("engine", k, mode)], by[("prototype", k, mode)]
        # The same steps with the same tokens each: near-tie rechecks (frequent on the tiny
        # model) included, so the two are timed on identical work.
        assert (engine["steps"], engine["tokens_per_step"]) == \
            (proto["steps"], proto["tokens_per_step"])
        assert engine["device_ms"] > 0                                # the clock saw llama_decode
    assert by[("engine", 0, "plain")]["tokens_per_step"] == 1.0
    assert by[("engine", 3, "accept")]["tokens_per_step"] > 1.0      # drafts were kept
    assert by[("engine", 3, "reject")]["tokens_per_step"] <= 1.0     # never a draft kept
    assert set(profiles) == {"engine", "prototype"} and all(profiles.values())
    assert localspec.speculative.engine.step is step                             # put back after each run


def test_step_overhead_rows_mode_compares_equal_verdicts():
    so = load("step_overhead")
    out = so.bench_rows(300, [0, 4], penalty=1.2, reps=2)
    assert [(r["k"], r["mode"]) for r in out] == [(0, "accept"), (4, "accept"), (4, "reject")]


def test_step_overhead_adaptive_mode_times_plain_and_ngram(tiny_path):
    so = load("step_overhead")
    rows = so.measure_adaptive(str(tiny_path), n_tokens=10, threads=1, reps=2)
    assert [(r["k"], r["mode"]) for r in rows] == [(0, "plain"), ("auto", "ngram")]
    for r in rows:      # 3 chats x 2 reps, each up to 10 tokens, every step seen by the clock
        assert 6 <= r["steps"] <= 60 and r["device_ms"] > 0
    assert rows[0]["tokens_per_step"] == 1.0 and "drafted" in rows[1]
    assert all(r["overhead_mean_ms"] > 0 for r in rows)


def test_step_overhead_docstring_examples():
    assert doctest.testmod(load("step_overhead")).failed == 0


def test_gpu_measure_curve_and_identity_on_the_tiny_model(tiny_path):
    gm = load("gpu_measure")
    c = gm.curve(str(tiny_path), layers=0, k_max=4, threads=1)
    assert len(c["ratios"]) == 5 and c["ratios"][0] == 1.0 and c["ms_per_step"] > 0
    assert set(c["policy_k"]) == {4, 16} and set(c["policy_k"][4]) == set(gm.ACCEPTANCE)
    ident = gm.identity(str(tiny_path), layers=0, n_tokens=8, threads=1)
    assert ident["prompts"] == 20
    for mode in ("ngram", "scripted-k8"):
        m = ident[mode]
        assert m["identical"] + len(m["diverged"]) == 20
        assert all(d["top2_gap"] < 0.5 for d in m["diverged"])      # only near-ties may flip
    assert ident["scripted-k8"]["drafted"] > 0


def test_tiled_crossover_times_both_settings_in_their_own_processes(tiny_path, capsys):
    tc = load("tiled_crossover")
    tc.main(["--model", str(tiny_path), "--threads", "1", "--pairs", "1", "--reps", "1",
             "--sizes", "1,8,9"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["1", "8", "9"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    assert rows[0][3] == "1.000"                  # the one size under 8: its own reference
    # the table's arithmetic: off/on of a size over the median off/on of the sizes under 8
    pair = ({1: 2.0, 2: 4.0, 4: 8.0, 8: 10.0}, {1: 1.0, 2: 2.2, 4: 4.0, 8: 4.0})
    assert tc.table([pair], [1, 2, 4, 8])[3] == (8, 10.0, 4.0, [0.8])
