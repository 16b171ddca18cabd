"""`localspec doctor`: device report and the draft/target compatibility verdict, through the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


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


def test_doctor_names_the_backend_the_devices_and_what_install_would_build():
    r = doctor("--build-only")
    assert r.returncode == 0, r.stderr
    assert "backend: " in r.stdout and "(this build)" in r.stdout
    assert "  device CPU: " in r.stdout                  # the CPU is always a device
    assert "install.sh here would build: " in r.stdout or "install.sh here would stop: " in r.stdout


def test_gpu_layers_with_nowhere_to_put_them_is_one_line_and_exit_1(tiny_path):
    """On a CPU build (CI) --gpu-layers names --rpc; a GPU build without its device names the
    driver and LOCALSPEC_BACKEND=cpu. Never a silent CPU run, a traceback or a crash."""
    from localspec.llama import devices, gpu_backends

    if any(d.type in ("GPU", "IGPU") for d in devices()):
        return                                   # a device is present: nothing to refuse here
    r = subprocess.run([sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path),
                        "-n", "4", "--gpu-layers", "-1", "hello"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "GGML_VK_VISIBLE_DEVICES": ""})
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()              # one line, ggml's own reason inside it
    if gpu_backends():
        assert "found no device" in line and "LOCALSPEC_BACKEND=cpu" in line
    else:
        assert "no GPU backend" in line and "--rpc" in line


def test_layers_beyond_the_model_are_clamped_in_the_placement_line():
    """What `placement_line` says for an over-asked offload, whatever device took the layers."""
    from pathlib import Path
    from types import SimpleNamespace

    from localspec.speculative.factory import placement_line

    model = SimpleNamespace(path=Path("m.gguf"), placement="31/31 layers on Vulkan0 (x)",
                            n_gpu_layers=99, n_layer=30)
    assert placement_line(model) == ("localspec: m.gguf: 31/31 layers on Vulkan0 (x), KV cache "
                                     "with them (asked for 99: clamped to the model's 31)")
    cpu = SimpleNamespace(path=Path("m.gguf"), placement="", n_gpu_layers=0, n_layer=30)
    assert placement_line(cpu) == "localspec: m.gguf: every layer on this machine"


def test_a_gpu_backend_that_fails_to_start_is_quoted_not_printed(capsys, monkeypatch):
    """ggml_cuda_init's error on a machine without the NVIDIA driver goes into localspec's own
    line (check_offload, doctor), not onto stderr beside it: a CPU run of that build is quiet."""
    from localspec.llama import backend

    monkeypatch.setitem(backend._log_state, "backend_failures", [])
    backend._on_log(4, b"ggml_cuda_init: failed to initialize CUDA: CUDA driver version is "
                       b"insufficient for CUDA runtime version\n", None)
    assert capsys.readouterr().err == ""
    assert backend.backend_init_failures() == [
        "ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for CUDA "
        "runtime version"]
    monkeypatch.setattr(backend, "devices", lambda: [])
    monkeypatch.setattr(backend, "gpu_backends", lambda: ["CUDA"])
    with pytest.raises(backend.LocalspecError) as e:
        backend.check_offload(-1)
    assert "found no device (ggml_cuda_init: failed to initialize CUDA: CUDA driver version" \
        in str(e.value) and "LOCALSPEC_BACKEND=cpu" in str(e.value)
