"""The backend and the build flags install.sh uses, decided from faked probes: one host per
platform (Linux + NVIDIA, Linux + Vulkan GPU, Linux with only lavapipe, Darwin arm64, a plain
CPU, an AMX CPU), the switches that force a backend, and this machine's own CPU decision, whose
flag string is the wheel cache key and must not change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from localspec.llama.buildflags import (NEWER_HEADERS, BackendError, Host, choose, cmake_define,
                                        cuda_arch_of, vulkan_devices_of,
                                        vulkan_missing)

BUILDFLAGS = Path(__file__).resolve().parents[1] / "localspec" / "llama" / "buildflags.py"
AMX_FLAGS = "flags : fpu avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_tile amx_int8\n"
AVX2_FLAGS = "flags : fpu sse4_2 avx avx2 fma f16c bmi2\n"
LAVAPIPE = (("llvmpipe (LLVM 15.0.6, 256 bits)", "CPU"),)
RADEON = (("AMD Radeon 780M (RADV GFX1103_R1)", "INTEGRATED_GPU"),) + LAVAPIPE
ALL_VULKAN = ("libvulkan-dev", "glslc", "spirv-headers")

# The CPU flags of the AMX host, which every Linux x86 backend shares.
AMX_CPU_ARGS = ("-DGGML_LLAMAFILE=ON", "-DGGML_RPC=ON", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON",
                "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
                "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=OFF",
                "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF",
                "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def linux(flags=AMX_FLAGS, **probes) -> Host:
    return Host("Linux", "x86_64", flags, **probes)


def test_amx_cpu_gets_the_portable_cpu_build_without_amx():
    plan = choose(linux(vulkan_devices=None, vulkan_missing=ALL_VULKAN))
    assert plan.backend == "cpu" and "no GPU found" in plan.reason
    assert plan.args == AMX_CPU_ARGS
    assert any("AMX kernels left out" in n for n in plan.notes)


def test_plain_cpu_with_nvcc_but_no_gpu_stays_cpu():
    plan = choose(linux(AVX2_FLAGS, nvcc=True))
    assert plan.backend == "cpu" and plan.reason.startswith("nvcc found but no NVIDIA GPU")
    assert "-DGGML_AVX512=OFF" in plan.args and not any("AMX" in n for n in plan.notes)
    assert not any("CUDA" in a or "VULKAN" in a for a in plan.args)


def test_linux_nvidia_gets_cuda_for_its_architecture_only():
    # ggml's default with GGML_NATIVE=OFF is seven architectures; one is what a laptop GPU needs.
    plan = choose(linux(nvcc=True, nvidia_gpu=True, cuda_arch="89", vulkan_devices=RADEON))
    assert plan.backend == "cuda" and plan.reason == "nvcc and an NVIDIA GPU found"
    assert plan.args == AMX_CPU_ARGS + ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=89")
    assert choose(linux(nvcc=True, nvidia_gpu=True)).args[-1] == "-DCMAKE_CUDA_ARCHITECTURES=native"
    assert cuda_arch_of("9.0\n9.0\n") == "90" and cuda_arch_of("8.9\n8.6") == "86;89"
    assert cuda_arch_of("") == "" and cuda_arch_of("[N/A]") == ""


def test_linux_vulkan_gpu_gets_vulkan_when_its_sdk_is_installed():
    plan = choose(linux(vulkan_devices=RADEON))
    assert plan.backend == "vulkan" and "AMD Radeon 780M" in plan.reason
    assert plan.args == AMX_CPU_ARGS + ("-DGGML_VULKAN=ON",)
    # An NVIDIA GPU without nvcc is reached through Vulkan.
    nv = (("NVIDIA GeForce RTX 4060 Laptop GPU", "DISCRETE_GPU"),)
    assert choose(linux(nvidia_gpu=True, vulkan_devices=nv)).backend == "vulkan"
    missing = choose(linux(vulkan_devices=RADEON, vulkan_missing=("glslc",)))
    assert missing.backend == "cpu" and "apt-get install glslc" in missing.reason
    assert missing.args == AMX_CPU_ARGS


def test_lavapipe_is_not_a_gpu():
    """Mesa's software Vulkan runs on this CPU: a CPU host with it installed stays a CPU build."""
    plan = choose(linux(nvcc=True, vulkan_devices=LAVAPIPE))
    assert plan.backend == "cpu" and "llvmpipe" in plan.reason and "not a GPU" in plan.reason
    assert plan.args == AMX_CPU_ARGS


def test_darwin_arm64_gets_metal():
    plan = choose(Host("Darwin", "arm64"))
    assert plan.backend == "metal" and "Apple Silicon" in plan.reason
    assert plan.args == ("-DGGML_LLAMAFILE=ON", "-DGGML_RPC=ON", "-DGGML_METAL=ON")
    # llama.cpp turns Metal on by default on Apple; a forced CPU build must say OFF.
    assert choose(Host("Darwin", "arm64", backend_env="cpu")).args[-1] == "-DGGML_METAL=OFF"


def test_other_platforms_keep_llamafile_and_rpc():
    """`--rpc` and `localspec rpc-server` need ggml-rpc in the one build install.sh makes."""
    for host in (linux(), Host("Darwin", "arm64"), Host("Linux", "aarch64")):
        assert choose(host).args[:2] == ("-DGGML_LLAMAFILE=ON", "-DGGML_RPC=ON")
    assert choose(Host("Linux", "aarch64")).backend == "cpu"


def test_localspec_backend_forces_and_checks_what_it_needs():
    assert choose(linux(backend_env="vulkan", vulkan_devices=LAVAPIPE)).args[-1] == \
        "-DGGML_VULKAN=ON"
    assert choose(linux(nvcc=True, nvidia_gpu=True, backend_env="CPU")).backend == "cpu"
    assert choose(linux(nvcc=True, backend_env="cuda", cuda_arch="86")).args[-1] == \
        "-DCMAKE_CUDA_ARCHITECTURES=86"
    with pytest.raises(BackendError, match="LOCALSPEC_CUDA_ARCH=89"):
        choose(linux(nvcc=True, backend_env="cuda"))
    with pytest.raises(BackendError, match="apt-get install libvulkan-dev glslc spirv-headers,"):
        choose(linux(backend_env="vulkan", vulkan_missing=ALL_VULKAN))
    with pytest.raises(BackendError, match="needs nvcc"):
        choose(linux(backend_env="cuda"))
    with pytest.raises(BackendError, match="needs macOS"):
        choose(linux(backend_env="metal"))
    with pytest.raises(BackendError, match="use one of cpu, cuda, vulkan, metal"):
        choose(linux(backend_env="gpu"))


def test_the_older_localspec_cuda_switch_still_works():
    on = choose(linux(nvcc=True, cuda_env="1", cuda_arch="89"))
    assert on.backend == "cuda" and "LOCALSPEC_CUDA=1" in on.reason
    off = choose(linux(nvcc=True, nvidia_gpu=True, cuda_env="0"))
    assert off.backend == "cpu" and "LOCALSPEC_CUDA=0" in off.reason
    both = choose(linux(nvcc=True, backend_env="cpu", cuda_env="1"))
    assert both.backend == "cpu" and "LOCALSPEC_CUDA=1 ignored" in both.reason


def test_default_build_keeps_llamafile():
    """Full prefill speed: the batch-invariant copy keeps tinyBLAS too, for 32+ rows."""
    assert "-DGGML_LLAMAFILE=ON" in choose(linux()).args


def test_vulkaninfo_summary_is_read_per_device():
    summary = ("Devices:\n========\nGPU0:\n\tapiVersion = 1.3.230\n"
               "\tdeviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU\n"
               "\tdeviceName         = AMD Radeon RX 7600 (RADV NAVI33)\n"
               "GPU1:\n\tdeviceType = PHYSICAL_DEVICE_TYPE_CPU\n\tdeviceName = llvmpipe\n")
    assert vulkan_devices_of(summary) == (("AMD Radeon RX 7600 (RADV NAVI33)", "DISCRETE_GPU"),
                                          ("llvmpipe", "CPU"))
    assert vulkan_devices_of("no devices\n") == ()


def test_vulkan_sdk_named_by_vulkan_sdk_counts_and_old_headers_are_found_out(tmp_path):
    for rel in ("include/vulkan/vulkan_core.h", "bin/glslc", "share/cmake/SPIRV-Headers/x.cmake"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("#define VK_EXT_layer_settings 1\n")
    assert vulkan_missing({"VULKAN_SDK": str(tmp_path)}) == ()
    old = tmp_path / "old"
    (old / "vulkan").mkdir(parents=True)
    (old / "vulkan" / "vulkan_core.h").write_text("#define VK_HEADER_VERSION 239\n")
    env = {"VULKAN_SDK": str(tmp_path), "CMAKE_ARGS": f"-DVulkan_INCLUDE_DIR={old}"}
    assert vulkan_missing(env) == (NEWER_HEADERS,)
    with pytest.raises(BackendError, match="VK_EXT_layer_settings"):
        choose(linux(backend_env="vulkan", vulkan_missing=(NEWER_HEADERS,)))
    assert cmake_define(["-DA=1", "-DVulkan_INCLUDE_DIR:PATH=/x"], "Vulkan_INCLUDE_DIR") == "/x"


def run_buildflags(*args, **env):
    import os
    full = {k: v for k, v in os.environ.items()
            if k not in ("LOCALSPEC_BACKEND", "LOCALSPEC_CUDA", "LOCALSPEC_CMAKE_ARGS", "CMAKE_ARGS")}
    return subprocess.run([sys.executable, str(BUILDFLAGS), *args], capture_output=True,
                          text=True, env={**full, **env})


def test_this_hosts_cpu_decision_is_the_flag_string_of_before():
    """What install.sh hashes into the wheel cache key: the CPU flags alone, in the order they
    had before backends were chosen, so a CPU machine (CI) reuses its cached wheel."""
    out = run_buildflags("--explain", LOCALSPEC_BACKEND="cpu")
    assert out.returncode == 0 and out.stderr.startswith("backend: cpu (forced by")
    args = out.stdout.split()
    assert args[:2] == ["-DGGML_LLAMAFILE=ON", "-DGGML_RPC=ON"]
    assert not any(b in a for a in args for b in ("CUDA", "VULKAN", "METAL=ON"))


def test_explain_and_backend_name_the_decision_and_a_bad_switch_is_one_line():
    out = run_buildflags("--backend", LOCALSPEC_BACKEND="cpu")
    assert (out.returncode, out.stdout) == (0, "cpu\n")
    bad = run_buildflags("--explain", LOCALSPEC_BACKEND="tpu")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "not a backend" in bad.stderr
    given = run_buildflags("--backend", LOCALSPEC_CMAKE_ARGS="-DGGML_VULKAN=ON")
    assert given.stdout == "vulkan\n"
