"""The two library sets: llama-cpp-python's own build for speed, and the copy whose ggml-cpu
carries localspec's batch-invariant patches (llama_cpp/lib-exact), which processes asking for
--exact load instead. The choice is per process, so the checks that need the patched copy run in
child processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from localspec.llama import libs

ROOT = Path(__file__).resolve().parents[1]


def test_exact_request_words_follow_the_cli_flag_env_var():
    assert libs.exact_requested({"LOCALSPEC_EXACT": "1"})
    assert libs.exact_requested({"LOCALSPEC_EXACT": " Yes "})
    assert libs.exact_requested({"LOCALSPEC_EXACT": "0"}) is False      # opts out
    assert libs.exact_requested({}) is None                              # the default


def test_choose_points_invariant_processes_at_the_invariant_folder(tmp_path):
    (tmp_path / "libllama.so.0.5.0").write_bytes(b"")
    env = {"LOCALSPEC_EXACT_LIB": str(tmp_path)}
    assert libs.choose(False, env) == "llama.cpp's own libraries" and "LLAMA_CPP_LIB_PATH" not in env
    assert libs.choose(True, env) == f"the batch-invariant libraries in {tmp_path}"
    assert env["LLAMA_CPP_LIB_PATH"] == str(tmp_path)
    default = {"LOCALSPEC_EXACT_LIB": str(tmp_path)}
    assert libs.choose(None, default) == libs.choose(libs.INVARIANT_BY_DEFAULT,
                                                     {"LOCALSPEC_EXACT_LIB": str(tmp_path)})
    assert libs.INVARIANT_BY_DEFAULT                             # since its F16 attention tiles
    mine = {"LOCALSPEC_EXACT_LIB": str(tmp_path), "LLAMA_CPP_LIB_PATH": "/opt/mine"}
    assert "/opt/mine" in libs.choose(True, mine)
    assert mine["LLAMA_CPP_LIB_PATH"] == "/opt/mine"           # the user's choice wins
    # Nothing usable: llama.cpp's own, and the account says why (the error quotes it).
    empty = {"LOCALSPEC_EXACT_LIB": str(tmp_path / "nothing-here")}
    account = libs.choose(True, empty)
    assert account.startswith("llama.cpp's own libraries (") and "nothing-here" in account
    assert "LLAMA_CPP_LIB_PATH" not in empty


def fake_wheel_libs(folder: Path) -> None:
    """The shape of the wheel's llama_cpp/lib: real files plus their soname links."""
    folder.mkdir(parents=True)
    for base, version in [("libllama", "0.5.0"), ("libggml", "0.25.3"), ("libggml-cpu", "0.25.3")]:
        (folder / f"{base}.so.{version}").write_bytes(f"{base} with llamafile".encode())
        (folder / f"{base}.so.0").symlink_to(f"{base}.so.{version}")
        (folder / f"{base}.so").symlink_to(f"{base}.so.0")


def test_install_exact_swaps_only_ggml_cpu_and_notices_a_reinstalled_wheel(tmp_path, monkeypatch):
    lib, cpu = tmp_path / "llama_cpp" / "lib", tmp_path / "exact-cpu"
    fake_wheel_libs(lib)
    cpu.mkdir()
    (cpu / "libggml-cpu.so.0.25.3").write_bytes(b"libggml-cpu patched")
    (cpu / "libggml-cpu.so.0").symlink_to("libggml-cpu.so.0.25.3")
    monkeypatch.setattr(libs, "package_lib_dir", lambda: lib)
    monkeypatch.delenv("LOCALSPEC_EXACT_LIB", raising=False)

    folder, problem = libs.exact_lib_status()
    assert problem == f"{folder} is missing"
    made = libs.install_exact(lib, cpu, "key123")
    assert made == folder == lib.parent / "lib-exact" and libs.installed_key() == "key123"
    assert (made / "libggml-cpu.so.0").read_bytes() == b"libggml-cpu patched"
    assert (made / "libllama.so").read_bytes() == b"libllama with llamafile"   # links resolve here
    assert (made / "libggml.so.0.25.3").samefile(lib / "libggml.so.0.25.3")   # hard link: no copy
    assert (lib / "libggml-cpu.so").read_bytes() == b"libggml-cpu with llamafile"  # wheel untouched
    assert libs.exact_lib_status() == (folder, "")

    # llama-cpp-python reinstalled by other means: the copy no longer matches its bindings.
    (lib / "libllama.so.0.5.0").unlink()
    (lib / "libllama.so.0.5.0").write_bytes(b"a newer libllama")
    assert "left from another llama-cpp-python install" in libs.exact_lib_status()[1]
    libs.remove_exact()
    assert not folder.exists() and libs.installed_key() == ""


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCALSPEC_EXACT", "LLAMA_CPP_LIB_PATH", "GGML_CPU_TILED_MM")}
    env.update(extra)
    return env


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env(**env), cwd=ROOT, timeout=600)


FEATURES = "from localspec import llama; print(llama.system_info())"
exact_installed = not libs.exact_lib_status()[1]
needs_exact_libs = pytest.mark.skipif(
    not exact_installed and not os.environ.get("CI"),
    reason="no llama_cpp/lib-exact: ./install.sh was run with LOCALSPEC_EXACT_LIBS=0")


@needs_exact_libs
def test_an_exact_process_loads_the_same_build_with_the_batch_invariant_patches():
    exact = run_python(FEATURES + "; print(llama.library_account())", LOCALSPEC_EXACT="1")
    upstream = run_python(FEATURES, LOCALSPEC_EXACT="0")
    assert exact.returncode == 0 and upstream.returncode == 0, exact.stderr + upstream.stderr
    features, account = exact.stdout.strip().splitlines()
    assert "BATCH_INVARIANT = 32" in features and "LLAMAFILE = 1" in features, features
    assert account.startswith("the batch-invariant libraries in")
    # Same instruction sets, tinyBLAS, repacking and threading: only the patches differ
    # (BATCH_INVARIANT_SET: the run-time row limit, patch 0001).
    assert re.sub(r" BATCH_INVARIANT(_SET)? = \d+ \|", "", features) == upstream.stdout.strip()


ONE_TOKEN_LOGITS = """
import hashlib, numpy as np
from localspec.llama import Model, ModelParams, Context, ContextParams
with Model({path!r}, ModelParams()) as model, \\
        Context(model, ContextParams(n_ctx=1024, n_threads=2)) as ctx:
    text = "Speculative decoding verifies drafted tokens in one batch. " * 40
    ctx.decode(model.tokenize(text)[:300], logits="none")
    digest = hashlib.sha256()
    for t in range(8):
        row = ctx.decode([(37 * t + 11) % model.n_vocab], logits="last")[0]
        digest.update(np.ascontiguousarray(row, dtype=np.float32).tobytes())
    print(digest.hexdigest())
"""


@pytest.fixture(scope="session")
def random_models(smollm_path, tmp_path_factory):
    """SmolLM2-135M's shape with every matrix in one weight type (tests/kernel_models.py): the
    path for a type, each made on first use."""
    from kernel_models import random_smollm

    return lambda wtype: random_smollm(smollm_path, tmp_path_factory.getbasetemp() /
                                       "kernel-models", wtype)


def test_exact_on_cuda_names_f16_weights_as_the_unproven_type(random_models):
    """--exact on CUDA says on stderr, after the load, that F16 weights' rows are unproven there
    (the H200 proved every other type's); it reads the type from the GGUF llama.cpp loaded.
    Nothing for other types, nor for F16 on Vulkan."""
    from localspec.llama import Model
    from localspec.llama.exact_rows import device_unproven_note

    notes = {}
    for wtype in ("f16", "q8_0", "bf16"):
        with Model(random_models(wtype)) as m:
            notes[wtype] = device_unproven_note(["CUDA"], m.meta("general.file_type"),
                                                m.path.name)
    assert "has F16 weights" in notes["f16"] and "pytest -m device" in notes["f16"]
    assert len(notes["f16"].splitlines()) == 1
    assert notes["q8_0"] == notes["bf16"] == ""
    assert device_unproven_note(["Vulkan"], "1", "m.gguf") == ""
    assert device_unproven_note(["CUDA"], None, "m.gguf") == ""


@needs_exact_libs
@pytest.mark.parametrize("model", ["tiny_path", "smollm_path", "q8_0", "q4_0", "f16", "q5_0",
                                   "bf16", "f32", "iq4_nl", "mxfp4", "q6_k", "q3_k_s", "q2_k"])
def test_one_token_decoding_is_llama_cpps_own_bit_for_bit(model, request):
    """The patches change how batches of 2-31 rows are computed, not what one row computes: a
    one-token decode on the batch-invariant library gives llama.cpp's own logits bit for bit,
    every kernel of the series included (0006's F16 attention and F16/BF16/F32 tiles, 0007's
    Q8_0 tiles, 0004's and 0005's many-row gemvs, 0008's Q6_K and Q3_K tiles: they serve
    one-token decodes too, or leave them alone). These models' prefill is also the same
    computation in both; the default model's is not quite (0003 rounds the repacked Q4_K gemm
    once per block), docs/exactness.md."""
    path = (request.getfixturevalue(model) if model.endswith("_path")
            else request.getfixturevalue("random_models")(model))
    code = ONE_TOKEN_LOGITS.format(path=str(path))
    mine, theirs = run_python(code, LOCALSPEC_EXACT="1"), run_python(code, LOCALSPEC_EXACT="0")
    assert mine.returncode == 0 and theirs.returncode == 0, mine.stderr + theirs.stderr
    assert mine.stdout.split()[-1] == theirs.stdout.split()[-1]


@needs_exact_libs
def test_exact_after_llama_cpps_own_libraries_loaded_is_one_clear_error():
    late = run_python("from localspec import llama\nfrom localspec.errors import LocalspecError\n"
                      "llama.system_info()\ntry:\n    llama.enable_exact_kernels()\n"
                      "except LocalspecError as e:\n    print(e)", LOCALSPEC_EXACT="0")
    assert "before this process first uses llama.cpp" in late.stdout, late.stderr


@needs_exact_libs
def test_batch_invariance_tests_pass_in_an_exact_process():
    """tests/test_batch_invariant.py in a process that asked for the patched libraries
    (LOCALSPEC_EXACT=1): every row, greedy and seeded identity. Where this process loaded them
    already (the default), the file ran here and is not run twice."""
    from localspec.llama import batch_invariant_rows
    if batch_invariant_rows() > 0:
        pytest.skip("this process runs on the batch-invariant libraries (the default): "
                    "tests/test_batch_invariant.py runs in it directly")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/test_batch_invariant.py"],
                         capture_output=True, text=True, env=child_env(LOCALSPEC_EXACT="1"),
                         cwd=ROOT, timeout=1800)
    tail = out.stdout[-2000:]
    assert out.returncode == 0, tail
    passed = re.search(r"(\d+) passed", tail)
    assert passed and int(passed.group(1)) >= 9, tail
    skipped = re.findall(r"SKIPPED \[\d+\] [^\n]*", tail)
    assert all("LOCALSPEC_TEST_QWEN" in s for s in skipped), tail  # only the 1 GB model's


@needs_exact_libs
def test_cli_exact_flag_loads_the_batch_invariant_libraries(tiny_path):
    """--exact on the command line (not only the env var) is seen before llama.cpp is loaded."""
    out = subprocess.run([sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path),
                          "--exact", "--proposer", "ngram", "-n", "8", "abcabcabc"],
                         capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout


def test_exact_without_its_libraries_is_one_error_line(tiny_path, tmp_path):
    """No silent fallback: a process asking for --exact that cannot load the batch-invariant
    libraries stops with one line naming why, before generating anything."""
    out = subprocess.run([sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path),
                          "--exact", "-n", "4", "abc"], capture_output=True, text=True,
                         env=child_env(LOCALSPEC_EXACT_LIB=str(tmp_path)), cwd=ROOT, timeout=600)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --exact needs localspec's batch-"), \
        out.stderr
    assert f"{tmp_path} holds no libllama" in lines[0]


@pytest.mark.parametrize("where", [["--gpu-layers", "1"], ["--rpc", "127.0.0.1:9"]])
def test_exact_with_layers_off_the_cpu_is_one_error_line(tiny_path, where):
    """--exact cannot be kept on RPC servers, nor on a GPU without localspec's patched backend
    (a CPU build here; tests/test_device_exact.py has the patched Vulkan one): one line saying
    so and what to do, before anything loads or connects."""
    out = subprocess.run([sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path),
                          "--exact", *where, "-n", "4", "abc"], capture_output=True, text=True,
                         env=child_env(), cwd=ROOT, timeout=600)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --exact promises"), out.stderr
    assert "Drop --exact" in lines[0]
    assert ("--gpu-layers 0" if where[0] == "--gpu-layers" else "drop --rpc") in lines[0]
