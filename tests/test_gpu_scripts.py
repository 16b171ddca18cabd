"""The GPU run's measurement scripts (scripts/bench/step_overhead.py, scripts/gpu/gpu_measure.py)
still drive the engine correctly, on the tiny model and the CPU: a device session gets few tries,
so a script broken by an engine change must fail here first. Also the CPU kernel probe beside them
(scripts/bench/tiled_crossover.py), whose child processes must keep loading a model. Only what the
scripts decide is checked (identity, step counts, the per-row step swapped in and out); their
timings are not. And the offline recipe's own scripts: the bundle's arithmetic (gpu_plan.py),
the diagnostic matrix and its verdict (gpu_diagnose.py), the step results (gpu_result.py); the
whole recipe is rehearsed in tests/test_gpu_rehearsal.py."""

from __future__ import annotations

import doctest
import importlib.util
import json
from pathlib import Path

import pytest

import localspec.speculative.engine
from localspec.speculative.step import step

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load(name):
    """A script as a module: the GPU recipe's gpu_* from scripts/gpu/, the rest from
    scripts/bench/ (gpu_measure puts scripts/bench/ on sys.path itself, for step_overhead)."""
    folder = SCRIPTS / ("gpu" if name.startswith("gpu_") else "bench")
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_overhead_runs_the_one_pass_and_the_per_row_step_to_the_same_output(tiny_path):
    so = load("step_overhead")
    rows, profiles = so.measure(str(tiny_path), ks=[0, 3], n_tokens=12, gpu_layers=0, threads=1,
                                penalty=1.1, steps=("engine", "per-row"), profile_k=3, reps=1)
    assert [(r["step"], r["k"], r["mode"]) for r in rows] == [
        ("engine", 0, "plain"), ("per-row", 0, "plain"), ("engine", 3, "accept"),
        ("per-row", 3, "accept"), ("engine", 3, "reject"), ("per-row", 3, "reject")]
    assert all(r["identical"] for r in rows)      # scripted drafts never change greedy output
    by = {(r["step"], r["k"], r["mode"]): r for r in rows}
    for k, mode in ((0, "plain"), (3, "accept"), (3, "reject")):
        engine, per_row = by[("engine", k, mode)], by[("per-row", k, mode)]
        # The same steps with the same tokens each: near-tie rechecks (frequent on the tiny
        # model) included, so the two are timed on identical work.
        assert (engine["steps"], engine["tokens_per_step"]) == \
            (per_row["steps"], per_row["tokens_per_step"])
        assert engine["device_ms"] > 0                                # the clock saw llama_decode
    assert by[("engine", 0, "plain")]["tokens_per_step"] == 1.0
    assert by[("engine", 3, "accept")]["tokens_per_step"] > 1.0      # drafts were kept
    assert by[("engine", 3, "reject")]["tokens_per_step"] <= 1.0     # never a draft kept
    assert set(profiles) == {"engine", "per-row"} and all(profiles.values())
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


def test_gpu_measure_rows_and_scripted_lengths_on_the_tiny_model(tiny_path):
    """The row check finds every row of 2-16-token batches equal to one-token decodes on the
    CPU's default (batch-invariant) kernels, which is what it asks of a device; identity runs
    the scripted draft lengths it is given."""
    gm = load("gpu_measure")
    r = gm.rows(str(tiny_path), layers=0, threads=1)
    assert sorted(r["by_n"]) == list(range(2, 17))
    from localspec.llama import batch_invariant_rows
    if batch_invariant_rows():                # the patched ggml-cpu (install.sh's default)
        assert all(v["identical_rows"] == n and v["max_abs_diff"] == 0.0
                   for n, v in r["by_n"].items())
    ident = gm.identity(str(tiny_path), layers=0, n_tokens=6, threads=1, scripted_ks=(1, 3))
    assert {"ngram", "scripted-k1", "scripted-k3"} <= set(ident) and "scripted-k8" not in ident
    assert ident["scripted-k3"]["drafted"] > ident["scripted-k1"]["drafted"] > 0


def test_gpu_measure_rows_to_17_after_a_given_context_and_its_exact_switch_on_a_cpu_build(
        tiny_path):
    """The recipe's exact step asks for 2..17-row batches after 40 and 1500 tokens; on a build
    without a patched GPU library its switch is one error line (the step skips before it)."""
    gm = load("gpu_measure")
    r = gm.rows(str(tiny_path), layers=0, threads=1, n_max=17, context=40)
    assert sorted(r["by_n"]) == list(range(2, 18)) and r["context"] == 40 and not r["exact"]
    from localspec.errors import LocalspecError
    from localspec.llama.exact_rows import device_exact_backends
    if not device_exact_backends():
        with pytest.raises(LocalspecError, match="patches 0009 and 0010"):
            with gm.exact_switch(True):
                pass


def test_gpu_result_headline_of_the_exact_step():
    gr = load("gpu_result")
    data = {"rows": [{"model": "m.gguf", "by_n": {"2": {"identical_rows": 2, "max_abs_diff": 0.0},
                                                  "3": {"identical_rows": 1, "max_abs_diff": 0.5}}}],
            "identity": [], "curves": [{"model": "m.gguf", "exact": False,
                                        "ratios": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]},
                                       {"model": "m.gguf", "exact": True,
                                        "ratios": [1.0, 1.2, 1.3, 1.4, 1.5, 1.6]}]}
    line = gr.headline("exact", data)
    assert "n = [2] of 2-3 (largest difference 0.5)" in line
    assert "r(1, 2, 4, 8, 16) limit off: 1.10 1.20 1.40" in line and "limit on: 1.20" in line


def test_gpu_result_headline_of_the_llamacpp_step_from_a_real_bench_file():
    """The llamacpp step's line: each mode's speed and identity, and localspec over llama.cpp's
    best, from a bench JSON the CPU run of issue 63 wrote."""
    import gzip
    path = SCRIPTS.parent / "data/results/bench-llamacpp-zen4-72-calibrated.json.gz"
    line = load("gpu_result").headline("llamacpp", json.load(gzip.open(path)))
    assert "ngram" in line and "2.223x plain, 8/8 identical" in line
    assert "llamacpp-simple" in line and "ngram over llama.cpp's best 1.084" in line


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


# ---- the offline GPU recipe's own scripts (scripts/gpu/: gpu_plan, gpu_diagnose, gpu_result)


def test_gpu_plan_requirements_cover_the_offline_install():
    plan = load("gpu_plan")
    names = {plan.req_name(r) for r in plan.requirements()}
    # localspec's dependencies, both extras (llm is the one issue 41 found missing) and the build
    assert {"numpy", "cffi", "click", "starlette", "uvicorn", "pytest", "gguf", "scipy",
            "hypothesis", "openai", "httpx", "llm", "setuptools", "wheel"} <= names
    assert "llama-cpp-python" not in names           # built on the machine from the sdist
    sdists = sorted(Path.home().glob(".cache/localspec/sdist/llama_cpp_python-0.3.36.tar.gz"))
    if sdists:                                       # its dependencies and build requirement too
        names = {plan.req_name(r) for r in plan.requirements(sdist=str(sdists[0]))}
        assert {"diskcache", "jinja2", "typing-extensions", "scikit-build-core"} <= names


def test_gpu_plan_split_carries_what_the_image_lacks():
    plan = load("gpu_plan")

    def item(name, version, fname):
        return {"metadata": {"name": name, "version": version},
                "download_info": {"url": f"file:///cache/{fname}"}}
    report = {"install": [item("llm", "0.36", "llm-0.36-py3-none-any.whl"),
                          item("NumPy", "2.5.5", "numpy-2.5.5-cp312.whl"),
                          item("typing_extensions", "4.16.0", "typing_extensions-4.16.0.whl"),
                          item("python-ulid", "4.1.0", "python_ulid-4.1.0.whl")]}
    carry, provided = plan.split(report, {"numpy", "typing-extensions", "click"})
    # typing-extensions is in the image but carried anyway (its version matters)
    assert carry == ["llm-0.36-py3-none-any.whl", "python_ulid-4.1.0.whl",
                     "typing_extensions-4.16.0.whl"]
    assert provided == ["numpy==2.5.5 numpy-2.5.5-cp312.whl"]
    image = plan.image_names(SCRIPTS / "gpu" / "gpu_image_packages.txt")
    assert {"numpy", "scipy", "pytest", "click", "jinja2", "cmake", "scikit-build-core"} <= image
    assert not {"llm", "cffi", "gguf", "openai", "sqlite-utils"} & image


def test_gpu_plan_halves_fill_call_one_first():
    plan = load("gpu_plan")
    mib = 2 ** 20
    p1, p2 = plan.halves(98 * mib, 14 * mib, 4 * mib, 64 * mib, 2 * mib)
    assert p1 == 48 * mib and p2 == 50 * mib            # call 1 full to the margin
    assert plan.halves(10 * mib, 14 * mib, 4 * mib, 64 * mib, 2 * mib) == (10 * mib, 0)
    for fixed1, fixed2 in ((62 * mib, 4 * mib), (14 * mib, 30 * mib)):
        with pytest.raises(ValueError):
            plan.halves(98 * mib, fixed1, fixed2, 64 * mib, 2 * mib)
    assert plan.tree_bytes() > 100_000                   # this checkout, as a call sends it


def test_gpu_diagnose_names_the_case_that_crashes():
    dg = load("gpu_diagnose")
    assert dg.classify(0, "", False) == "ok" and dg.classify(None, "", True) == "hung"
    assert dg.classify(-11, "", False) == "crashed (SIGSEGV)"
    assert dg.classify(139, "", False) == "crashed (SIGSEGV)" and dg.classify(1, "", False) == \
        "failed (exit 1)"
    assert dg.classify(86, "", False).startswith("crashed (caught by localspec's crash guard")
    ok = {"status": "ok", "stage": "exit"}
    seg = {"status": "crashed (SIGSEGV)", "stage": "llama_model_load_from_file (n_gpu_layers -1)"}
    base = {c: ok for c in dg.CASES}
    assert dg.verdict(base).startswith("no case crashed")
    v = dg.verdict(dict(base, door=seg, **{"raw-logcb": seg, "raw-all": seg}))
    assert "raw-logcb (a Python log callback" in v and "door crashed (SIGSEGV)" in v
    v = dg.verdict(dict(base, door=seg))
    assert "no raw case crashes: the cause is elsewhere in the door" in v
    assert dg.verdict(dict(base, control=seg)).startswith("llama_cpp.Llama itself fails")
    v = dg.verdict(dict(base, raw=seg, door=seg, **{"raw-intmax": ok}))
    assert "the bare low-level load fails" in v and "0x7FFFFFFF" in v
    assert "raw-freed" in dg.verdict(dict(base, **{"raw-freed": seg}))


def test_gpu_diagnose_matrix_runs_each_case_in_a_child(tiny_path, tmp_path):
    dg = load("gpu_diagnose")
    out = dg.matrix(str(tiny_path), 0, 4, ["control", "raw", "raw-logcb", "raw-freed"], 60, 120,
                    0, tmp_path / "d.json")
    assert json.loads((tmp_path / "d.json").read_text())["cases"].keys() == out["cases"].keys()
    for case in ("control", "raw", "raw-logcb"):
        assert out["cases"][case]["status"] == "ok", out["cases"][case]
        assert out["cases"][case]["stdout"][-1].startswith(f"OK {case}: ")
    # the raw cases decode the same greedy tokens, with or without the Python log callback
    assert out["cases"]["raw"]["stdout"][-1][8:] == out["cases"]["raw-logcb"]["stdout"][-1][14:]
    assert out["cases"]["raw-freed"]["stage"].startswith(("exit", "generator finally"))


def test_gpu_result_writes_a_stub_for_a_step_that_left_none(tmp_path, capsys):
    gr = load("gpu_result")
    log = tmp_path / "identity.log"
    log.write_text("loading\nSegmentation fault\n")
    gr.main(["identity", str(tmp_path / "identity.json"), "crashed (signal 11, exit 139)",
             str(log)])
    data = json.loads((tmp_path / "identity.json").read_text())
    assert data["status"].startswith("crashed") and data["log_tail"][-1] == "Segmentation fault"
    (tmp_path / "curve.json").write_text(json.dumps({"curves": [
        {"model": "m.gguf", "ms_per_step": 2.5, "ratios": [1.0, 1.01]}]}))
    gr.main(["curve", str(tmp_path / "curve.json"), "ok, 9 s"])
    (tmp_path / "tests.log").write_text("..\n19 passed, 600 deselected in 80.0s\n")
    gr.main(["tests", str(tmp_path / "tests.log"), "ok, 81 s"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "curve: ok, 9 s; m.gguf: 2.5 ms/step, r(k) 1.00 1.01"
    assert lines[2] == "tests: ok, 81 s; 19 passed, 600 deselected in 80.0s"
    assert (tmp_path / "tests.log").read_text().endswith("status: ok, 81 s\n")
