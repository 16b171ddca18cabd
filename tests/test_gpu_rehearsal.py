"""The offline GPU recipe, rehearsed on this machine's CPU as the GPU machine would run it
(scripts/gpu/gpu_rehearse.sh, docs/gpu-offline-recipe.md): a copy of what a call sends, the
bundle made for it, a Python 3.12 venv holding only the image's packages (this Python where there
is no 3.12), pip with no index, LOCALSPEC_BACKEND=cpu and the CPU wheel ./install.sh cached here,
then scripts/gpu/gpu_run.sh twice as the two calls. A missing wheel in the bundle, a step that
broke with an engine change, a result file not written: each fails here, not in a GPU machine's
minutes.

Skipped (with the reason) when no llama-cpp-python wheel is cached under the user's localspec
cache (./install.sh makes it), when git or xz is missing, when the bundle cannot reach PyPI for
its first download (exit 75), or with LOCALSPEC_REHEARSAL=0. About 2-4 minutes on 2 shared
cores (the first run also downloads the 3.12 wheels, ~65 MB, and the sdist, 77 MB, into the
cache, and trims the sdist)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FILES_1 = {"run.log", "setup.log", "exact.json", "diagnose.json", "identity.json", "parallel.json",
           "curve.json", "overhead.json"}


def real_home() -> Path:
    """The user's localspec cache: the suite's LOCALSPEC_HOME is a fresh folder whose models
    folder links to it (conftest.py)."""
    return (Path(os.environ["LOCALSPEC_HOME"]) / "models").resolve().parent


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    if os.environ.get("LOCALSPEC_REHEARSAL", "1") == "0":
        pytest.skip("LOCALSPEC_REHEARSAL=0")
    for tool in ("git", "xz", "tar"):
        if shutil.which(tool) is None:
            pytest.skip(f"the rehearsal needs {tool}")
    home = real_home()
    if not list(home.glob("wheels/llama-cpp-python-*/llama_cpp_python-*.whl")):
        pytest.skip(f"no llama-cpp-python wheel cached in {home}/wheels (./install.sh makes it)")
    out = tmp_path_factory.mktemp("rehearsal")
    env = dict(os.environ, LOCALSPEC_HOME=str(home), PYTHON=sys.executable)
    script = REPO / "scripts" / "gpu" / "gpu_rehearse.sh"
    p = subprocess.run(["bash", str(script), str(out)], env=env,
                       capture_output=True, text=True, timeout=1500)
    if p.returncode == 75:
        pytest.skip("the rehearsal could not be set up here: " + p.stderr.strip()[-300:])
    yield out, p
    for big in ("tree", "image"):     # venvs, models, bundle: ~0.6 GB; the results stay
        shutil.rmtree(out / big, ignore_errors=True)


def load(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def test_the_recipe_runs_every_step_offline_in_two_calls(rehearsal):
    out, p = rehearsal
    assert p.returncode == 0, p.stderr[-4000:]
    one, two = out / "out1", out / "out2"
    # Call 1 returns the result files of the steps up to the bench, which waits for SmolLM2's
    # second part and holds back the steps after it (run.log says so).
    assert {f.name for f in one.iterdir()} == FILES_1
    log1 = (one / "run.log").read_text()
    # the bench waits: for SmolLM2's second part, or (first, since the exact step's file made it
    # 8) for the next call's room in OUT; either way call 2 runs it
    assert ("bench: skipped: no SmolLM2-135M yet" in log1
            or "bench: skipped: 8 files in OUT already" in log1), log1
    assert "tests: waits for bench" in log1 and "qwen: waits for bench" in log1
    assert (one / "setup.log").read_text().rstrip().splitlines()[-1].startswith("setup: ok")
    setup = (one / "setup.log").read_text()
    assert "GPU devices: 0" in setup and "localspec C module: ok" in setup
    # Call 2 runs what is left, and only that; the steps that cannot run here say why, in their
    # result files.
    assert {f.name for f in two.iterdir()} == {"run.log", "bench.json", "tests.log",
                                               "llamacpp.json", "qwen.json"}
    assert "skipped: no GPU" in (two / "tests.log").read_text()
    assert load(two, "qwen.json")["status"].startswith("skipped: the bundle holds no Qwen specs")
    assert load(one, "exact.json")["status"].startswith(      # a CPU build: nothing to switch on
        "skipped: this build's GPU library has no batch-invariant rows")
    assert "all steps done" in (two / "run.log").read_text()


def test_the_diagnostic_matrix_ran_every_case_in_its_own_process(rehearsal):
    out, _ = rehearsal
    d = load(out / "out1", "diagnose.json")
    assert d["status"].startswith("ok")
    # On the CPU every load runs, the door's included; the use-after-free case may crash.
    assert set(d["cases"]) == {"control", "door", "door-cpu", "doctor", "raw", "raw-intmax",
                               "raw-quiet", "raw-logcb", "raw-probes", "raw-imports",
                               "raw-numpy", "raw-stdcxx", "raw-freed", "raw-all"}
    assert "libllama.so" in d["cxx_copies"] or not d["cxx_copies"]     # nm missing: {}
    for case, r in d["cases"].items():
        if case != "raw-freed":
            assert r["status"] == "ok", (case, r)
    assert "localspec's door runs here" in d["verdict"]


def test_identity_curve_overhead_and_bench_say_what_ran(rehearsal):
    out, _ = rehearsal
    ident = load(out / "out1", "identity.json")
    assert ident["status"].startswith("ok") and ident["finished"]
    assert [i["model"] for i in ident["identity"]][-1] == "tiny.gguf"
    for i in ident["identity"]:
        for mode in ("ngram", "scripted-k8"):
            m = i[mode]
            assert m["identical"] + len(m["diverged"]) == i["prompts"] == 2
            assert all(d["top2_gap"] < 0.5 for d in m["diverged"])
    curve = load(out / "out1", "curve.json")
    assert curve["status"].startswith("ok") and curve["gpu_layers"] == 0
    assert all(len(c["ratios"]) == 5 and c["ratios"][0] == 1.0 for c in curve["curves"])
    # patch 0011's price: the first model's curve again from a process with CUDA graphs off
    assert [c["graphs"] for c in curve["curves"]][-1] is False
    assert curve["curves"][-1]["model"] == curve["curves"][0]["model"]
    assert all(c["graphs"] for c in curve["curves"][:-1])
    over = load(out / "out1", "overhead.json")
    assert over["status"].startswith("ok")
    assert {(r["step"], r["k"]) for r in over["rows"]} >= {("engine", 0), ("per-row", 2)}
    # the argmax on the device, timed in a process of its own beside the engine's step
    assert over["argmax"]["status"] == "ok", over["argmax"]
    assert {(r["step"], r["k"]) for r in over["argmax"]["rows"]} >= {("argmax", 0), ("argmax", 2)}
    bench = load(out / "out2", "bench.json")
    assert bench["status"].startswith("ok"), bench.get("log_tail")
    assert {r["mode"] for r in bench["rows"]} == {"plain", "ngram", "peer"}
    # llama.cpp's own speculation beside localspec's, the bundle's linked tool running on the
    # installed wheel's libraries (carried where it was built: llamacpp_build --linked)
    cpp = load(out / "out2", "llamacpp.json")
    if cpp["status"].startswith("skipped"):
        assert cpp["status"].startswith("skipped: the bundle holds no llama.cpp tool"), cpp
    else:
        assert cpp["status"].startswith("ok"), cpp.get("log_tail")
        assert {r["mode"] for r in cpp["rows"]} == {"plain", "ngram", "llamacpp-plain",
                                                    "llamacpp-mod", "llamacpp-simple"}
    log = (out / "out2" / "run.log").read_text()
    par = load(out / "out1", "parallel.json")
    assert par["status"].startswith("ok"), par.get("log_tail")
    p = par["parallel"]
    assert p["identical"] == p["prompts"] == 2 and not p["errors"]    # the CPU: exact
    for step in ("setup", "exact", "diagnose", "identity", "parallel", "curve", "overhead",
                 "bench", "tests", "llamacpp", "qwen"):
        assert f" {step}: " in log         # one status line per step, across both calls
