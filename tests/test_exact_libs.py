"""The two library sets: the default build (llamafile on) for speed, and the llamafile-free copy
that processes asking for --exact load instead. The choice is per process, so the checks that
need the exact copy run in child processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from localspec import libs

ROOT = Path(__file__).resolve().parents[1]


def test_exact_request_words_follow_the_cli_flag_env_var():
    assert libs.exact_requested({"LOCALSPEC_EXACT": "1"})
    assert libs.exact_requested({"LOCALSPEC_EXACT": " Yes "})
    assert not libs.exact_requested({"LOCALSPEC_EXACT": "0"})
    assert not libs.exact_requested({})


def test_choose_points_only_exact_processes_at_the_exact_folder(tmp_path):
    (tmp_path / "libllama.so").write_bytes(b"")
    env = {"LOCALSPEC_EXACT_LIB": str(tmp_path)}
    assert libs.choose(False, env) == "default libraries" and "LLAMA_CPP_LIB_PATH" not in env
    assert "exact mode" in libs.choose(True, env) and env["LLAMA_CPP_LIB_PATH"] == str(tmp_path)
    mine = {"LOCALSPEC_EXACT_LIB": str(tmp_path), "LLAMA_CPP_LIB_PATH": "/opt/mine"}
    libs.choose(True, mine)
    assert mine["LLAMA_CPP_LIB_PATH"] == "/opt/mine"           # the user's choice wins
    empty = {"LOCALSPEC_EXACT_LIB": str(tmp_path / "nothing-here")}
    assert "default" in libs.choose(True, empty) and "LLAMA_CPP_LIB_PATH" not in empty


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCALSPEC_EXACT", "LLAMA_CPP_LIB_PATH", "GGML_CPU_TILED_MM")}
    env.update(extra)
    return env


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env(**env), cwd=ROOT, timeout=600)


FEATURES = "from localspec import llama; print(llama.system_info())"
exact_installed = libs.exact_lib_dir() is not None
needs_exact_libs = pytest.mark.skipif(
    not exact_installed and not os.environ.get("CI"),
    reason="no llama_cpp/lib-exact: ./install.sh was run with LOCALSPEC_EXACT_LIBS=0")


@needs_exact_libs
def test_exact_process_loads_the_same_build_without_llamafile():
    default = run_python(FEATURES)
    exact = run_python("from localspec import llama\nllama.enable_exact_kernels()\n"
                       "print(llama.system_info()); print(llama.library_account())")
    assert default.returncode == 0 and exact.returncode == 0, default.stderr + exact.stderr
    features, account = exact.stdout.strip().splitlines()
    assert "LLAMAFILE" not in features and "exact mode" in account
    # Same instruction sets, repacking and threading: only tinyBLAS is gone.
    assert features == re.sub(r" LLAMAFILE = 1 \|", "", default.stdout.strip())


@needs_exact_libs
def test_exact_after_the_default_libraries_loaded_is_one_clear_error():
    if "LLAMAFILE" not in run_python(FEATURES).stdout:
        pytest.skip("this build has no llamafile: exact mode never needs the other libraries")
    late = run_python("from localspec import llama\nfrom localspec.errors import LocalspecError\n"
                      "llama.system_info()\ntry:\n    llama.enable_exact_kernels()\n"
                      "except LocalspecError as e:\n    print(e)")
    assert "before this process first uses llama.cpp" in late.stdout, late.stderr


@needs_exact_libs
def test_cli_exact_flag_loads_the_exact_libraries(tiny_path):
    """--exact on the command line (not only the env var) is seen before llama.cpp is loaded."""
    out = subprocess.run([sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path),
                          "--exact", "--proposer", "ngram", "-n", "8", "abcabcabc"],
                         capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout


@needs_exact_libs
def test_exact_mode_tests_pass_in_an_exact_process():
    """tests/test_speculative.py's bit-for-bit checks of --exact, in a process that loaded the
    llamafile-free libraries (this one loaded the default ones)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/test_speculative.py", "-k", "exact_mode"],
                         capture_output=True, text=True, env=child_env(LOCALSPEC_EXACT="1"),
                         cwd=ROOT, timeout=1800)
    tail = out.stdout[-2000:]
    assert out.returncode == 0, tail
    passed = re.search(r"(\d+) passed", tail)
    assert passed and int(passed.group(1)) >= 1, tail
    assert "llamafile" not in tail                              # none skipped for the build
