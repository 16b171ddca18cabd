"""`localspec doctor`: device report and the draft/target compatibility verdict, through the CLI."""

from __future__ import annotations

import subprocess
import sys


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "localspec", "doctor", *args],
                          capture_output=True, text=True, timeout=300)


def test_doctor_reports_device_and_a_compatible_pair(tiny_path):
    r = doctor(str(tiny_path), str(tiny_path))
    assert r.returncode == 0, r.stderr
    assert "llama.cpp features:" in r.stdout and "AMX:" in r.stdout
    assert "checked 259 shared token ids" in r.stdout and "compatible" in r.stdout


def test_doctor_names_the_first_difference_of_an_incompatible_pair(smollm_path, tiny_path):
    r = doctor(str(smollm_path), str(tiny_path))
    assert r.returncode == 1
    assert "INCOMPATIBLE" in r.stdout and "tokenizer types differ" in r.stdout
    assert "token 0 differs" in r.stdout and "Traceback" not in r.stderr


def test_gpu_line_says_rpc_only_when_no_gpu_backend_is_built():
    from localspec.apps.doctor import gpu_offload_line
    from localspec.llama import supports_gpu_offload
    line = gpu_offload_line("CPU : AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 |")
    assert line == ("no (CPU build)" if not supports_gpu_offload() else
                    "no GPU backend in this build; layers can go to RPC servers (--rpc)")
    if supports_gpu_offload():
        assert gpu_offload_line("CUDA : ARCHS = 900 | CPU : AVX2 = 1 |") == "yes"
