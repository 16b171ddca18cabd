"""Chooses the CMake flags llama-cpp-python is built with, from what this host reports.

Standard library only: install.sh runs it before anything else is installed.
Why: a default (-march=native) build enables Intel AMX kernels that segfault on the first decode
on Sapphire Rapids and newer (upstream llama.cpp issue 20824), and `-DGGML_AMX_*=OFF` alone does
not help because -march=native turns AMX back on. So on x86 we build with GGML_NATIVE=OFF and
name each instruction set the CPU has, AMX excluded; the repacked CPU kernels stay on.
CUDA is enabled when nvcc and an NVIDIA GPU are both present, for that GPU's architecture only
(nvidia-smi's compute capability, else CMake's "native"): with GGML_NATIVE=OFF, ggml would
otherwise compile every kernel for seven architectures, several times the build time.
Metal on Apple Silicon.
llamafile's tinyBLAS stays on (llama.cpp's default): without it prefill ran 0.94x on a 2-core
EPYC (docs/build.md). It serves only batches of 2+ rows, so with it a verify batch computes
different logits from one-token decoding; `--exact` therefore loads a second copy of the one
library it lives in (ggml-cpu), built with exact_cmake_args(): GGML_LLAMAFILE=OFF.
ggml's RPC backend is built everywhere (GGML_RPC=ON): `--rpc` spreads a model's layers over
`localspec rpc-server` processes on other hosts, and that server comes from this same build.

Overrides: LOCALSPEC_CMAKE_ARGS replaces the choice entirely; CMAKE_ARGS is appended (later -D
flags win); LOCALSPEC_CUDA=1/0 forces CUDA on/off; LOCALSPEC_CUDA_ARCH (e.g. "90") names the
CUDA architectures.
Run `python localspec/llama/buildflags.py --explain` to see the decision, `--exact` for the exact copy's.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

# /proc/cpuinfo flag -> ggml CMake option
X86_FEATURES = [
    ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"), ("avx_vnni", "GGML_AVX_VNNI"), ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
]
AMX_OPTIONS = ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]


def read_cpuinfo() -> str:
    """/proc/cpuinfo, or "" where there is none (macOS) or it cannot be read: the one reader."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str) -> set:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model(cpuinfo: str) -> str:
    """The CPU's name ("AMD EPYC 7B13"), else what platform knows."""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def has_nvidia_gpu() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def cuda_arch_of(compute_caps: str) -> str:
    """CMAKE_CUDA_ARCHITECTURES for nvidia-smi's compute_cap lines, "" if none parse.
    Example: "9.0\n9.0\n" -> "90"; "8.6\n8.9" -> "86;89"."""
    archs = set()
    for line in compute_caps.split():
        major, _, minor = line.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            archs.add(int(major) * 10 + int(minor))
    return ";".join(str(a) for a in sorted(archs))


def host_cuda_arch() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return cuda_arch_of(out.stdout) if out.returncode == 0 else ""


def choose(system: str, machine: str, cpuinfo: str, nvcc: bool, gpu: bool,
           cuda_env: str = "", cuda_arch: str = "") -> tuple:
    """Return (cmake_args list, reasons list). Pure function of its inputs, for tests.

    Example: Linux x86_64 with flags "avx avx2 fma f16c amx_tile", no GPU ->
    GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C=ON, the other listed sets OFF, AMX_*=OFF.
    cuda_arch: the GPU's CMAKE_CUDA_ARCHITECTURES ("90" on an H100); "" lets CMake detect it.
    """
    args = ["-DGGML_LLAMAFILE=ON", "-DGGML_RPC=ON"]
    why = ["llamafile tinyBLAS on: full prefill speed (--exact loads a ggml-cpu built without it)",
           "RPC backend on: --rpc and `localspec rpc-server` (a small library, no new dependency)"]
    if machine.lower() in ("x86_64", "amd64") and system != "Darwin":
        flags = cpu_flags(cpuinfo)
        args.append("-DGGML_NATIVE=OFF")
        for flag, opt in X86_FEATURES:
            args.append(f"-D{opt}={'ON' if flag in flags else 'OFF'}")
        args += [f"-D{opt}=OFF" for opt in AMX_OPTIONS]
        on = [flag for flag, _ in X86_FEATURES if flag in flags]
        why.append(f"x86: portable build with this CPU's instruction sets ({' '.join(on) or 'none'})")
        if any(f.startswith("amx") for f in flags):
            why.append("CPU has AMX: AMX kernels left out (they crash on first decode, llama.cpp #20824)")
    elif system == "Darwin" and machine == "arm64":
        args.append("-DGGML_METAL=ON")
        why.append("Apple Silicon: Metal offload")
    else:
        why.append(f"{system}/{machine}: llama.cpp's default native build")
    want_cuda = {"1": True, "0": False}.get(cuda_env, nvcc and gpu)
    if want_cuda:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch or 'native'}"]
        why.append("CUDA: nvcc and an NVIDIA GPU found" if not cuda_env else "CUDA forced by LOCALSPEC_CUDA")
        why.append(f"CUDA kernels for architecture {cuda_arch} only" if cuda_arch else
                   "CUDA kernels for the GPUs CMake finds at build time (native)")
    elif nvcc and not gpu:
        why.append("nvcc found but no NVIDIA GPU: CPU-only build (LOCALSPEC_CUDA=1 to force)")
    return args, why


def exact_cmake_args(args: list) -> list:
    """Flags of the --exact copy of ggml-cpu: the same build without llamafile's tinyBLAS (its
    only switch, GGML_USE_LLAMAFILE, is private to ggml-cpu, so the copy links with the rest)."""
    return [a for a in args if not a.startswith("-DGGML_LLAMAFILE=")] + ["-DGGML_LLAMAFILE=OFF"]


def host_cmake_args() -> tuple:
    override = os.environ.get("LOCALSPEC_CMAKE_ARGS")
    if override is not None:
        return override.split(), ["LOCALSPEC_CMAKE_ARGS given: used as is"]
    cpuinfo = read_cpuinfo()
    nvcc = bool(shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists())
    gpu = has_nvidia_gpu()
    arch = os.environ.get("LOCALSPEC_CUDA_ARCH") or (host_cuda_arch() if nvcc and gpu else "")
    args, why = choose(platform.system(), platform.machine(), cpuinfo, nvcc, gpu,
                       os.environ.get("LOCALSPEC_CUDA", ""), arch)
    extra = os.environ.get("CMAKE_ARGS", "").split()
    if extra:
        why.append(f"CMAKE_ARGS appended: {' '.join(extra)}")
    return args + extra, why


if __name__ == "__main__":
    cmake_args, reasons = host_cmake_args()
    if "--explain" in sys.argv:
        for r in reasons:
            print(f"- {r}", file=sys.stderr)
    print(" ".join(exact_cmake_args(cmake_args) if "--exact" in sys.argv else cmake_args))
