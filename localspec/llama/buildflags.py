"""Chooses the backend (cuda, vulkan, metal or cpu) and the CMake flags llama-cpp-python is built
with, from what this host reports. Standard library only: install.sh runs it before anything else
is installed.

The backend, first match wins (`decide`):
  LOCALSPEC_BACKEND=cpu|cuda|vulkan|metal   forces it (LOCALSPEC_CUDA=1/0, the older switch, still
                                            works: 1 is LOCALSPEC_BACKEND=cuda, 0 rules CUDA out)
  Apple Silicon                             metal
  nvcc and an NVIDIA GPU                    cuda, for that GPU's architecture only (nvidia-smi's
                                            compute capability, else CMake's "native"): with
                                            GGML_NATIVE=OFF ggml would otherwise compile every
                                            kernel for seven architectures
  a Vulkan GPU (vulkaninfo: a discrete or   vulkan, when its headers, glslc and SPIR-V headers are
  integrated GPU) and the Vulkan SDK        installed (else cpu, naming the Debian packages)
  otherwise                                 cpu. A software Vulkan device (Mesa's lavapipe) does
                                            not count: it runs on this same CPU, slower than ggml's
                                            CPU kernels; llama.cpp itself skips it unless
                                            GGML_VK_VISIBLE_DEVICES names it. The device test lane
                                            (scripts/ci/device_lane.sh) forces vulkan to run on it.
The CPU flags are the same for every backend (the CPU still runs what is not offloaded), and a
cpu decision adds nothing to them: the wheel cache key of a CPU build never changes with this file.

Why the CPU flags: a default (-march=native) build enables Intel AMX kernels that segfault on the
first decode on Sapphire Rapids and newer (upstream llama.cpp issue 20824), and
`-DGGML_AMX_*=OFF` alone does not help because -march=native turns AMX back on. So on x86 we build
with GGML_NATIVE=OFF and name each instruction set the CPU has, AMX excluded; the repacked CPU
kernels stay on.
llamafile's tinyBLAS stays on (llama.cpp's default): without it prefill ran 0.94x on a 2-core
EPYC (docs/build.md). Upstream it serves batches of 2+ rows, so a verify batch computed different
logits from one-token decoding; install.sh builds a second ggml-cpu with these same flags plus
localspec's patches (patches/, docs/exactness.md: tinyBLAS and the tiled matmul from 32 rows, the
repacked Q4_K gemm rounding as its gemv does), which `--exact` loads.
ggml's RPC backend is built everywhere (GGML_RPC=ON): `--rpc` spreads a model's layers over
`localspec rpc-server` processes on other hosts, and that server comes from this same build.

Overrides: LOCALSPEC_CMAKE_ARGS replaces the flags entirely; CMAKE_ARGS is appended (later -D
flags win); LOCALSPEC_CUDA_ARCH (e.g. "90") names the CUDA architectures.
`python localspec/llama/buildflags.py --explain` prints the decision and why (stderr) and the
flags (stdout); `--backend` prints only the backend.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

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


def vulkan_devices_of(summary: str) -> tuple:
    """(name, type) of each device in `vulkaninfo --summary` output, type without its prefix.
    Example: "GPU0:\n\tdeviceType = PHYSICAL_DEVICE_TYPE_CPU\n\tdeviceName = llvmpipe" ->
    (("llvmpipe", "CPU"),)."""
    devices, current = [], {}
    for line in summary.splitlines():
        key, _, value = line.strip().partition("=")
        key, value = key.strip(), value.strip()
        if line.strip().startswith("GPU") and line.strip().endswith(":"):
            current = {}
            devices.append(current)
        elif key in ("deviceName", "deviceType") and devices:
            current[key] = value.replace("PHYSICAL_DEVICE_TYPE_", "")
    return tuple((d.get("deviceName", "?"), d.get("deviceType", "?")) for d in devices)


def host_vulkan_devices() -> Optional[tuple]:
    """The Vulkan devices vulkaninfo lists, () if none, None when vulkaninfo is not installed
    (Debian package vulkan-tools) or fails."""
    if not shutil.which("vulkaninfo"):
        return None
    try:
        out = subprocess.run(["vulkaninfo", "--summary"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return vulkan_devices_of(out.stdout) if out.returncode == 0 else None


NEWER_HEADERS = "newer Vulkan headers"


def cmake_define(args: list, name: str) -> str:
    """The value of -D<name>=... (or -D<name>:TYPE=...) in a list of CMake flags, "" if absent."""
    for a in args:
        key, _, value = a[2:].partition("=") if a.startswith("-D") else ("", "", "")
        if key.split(":")[0] == name:
            return value
    return ""


def vulkan_missing(env: Optional[dict] = None) -> tuple:
    """What a Vulkan build needs that this host lacks, as Debian packages: the headers and
    loader (libvulkan-dev), the shader compiler (glslc), ggml's SPIR-V headers (spirv-headers);
    and NEWER_HEADERS when the headers lack VK_EXT_layer_settings, which the vendored llama.cpp
    uses unguarded (Debian 12's 1.3.239 do; Debian 13's 1.4.309 have it). A Vulkan SDK named by
    VULKAN_SDK, or headers named by CMAKE_ARGS' -DVulkan_INCLUDE_DIR, are looked at first."""
    env = os.environ if env is None else env
    roots = [Path(env["VULKAN_SDK"])] if env.get("VULKAN_SDK") else []
    roots += [Path("/usr"), Path("/usr/local")]

    def found(*rel):
        return next((root / r for root in roots for r in rel if (root / r).exists()), None)

    given = cmake_define(env.get("CMAKE_ARGS", "").split(), "Vulkan_INCLUDE_DIR")
    header = Path(given) / "vulkan" / "vulkan_core.h" if given else \
        found("include/vulkan/vulkan_core.h")
    missing = []
    if header is None or not header.exists():
        missing.append("libvulkan-dev")
    elif "VK_EXT_layer_settings" not in header.read_text(errors="replace"):
        missing.append(NEWER_HEADERS)
    if not (shutil.which("glslc") or found("bin/glslc")):
        missing.append("glslc")
    if not found("share/cmake/SPIRV-Headers", "lib/cmake/SPIRV-Headers",
                 "lib/x86_64-linux-gnu/cmake/SPIRV-Headers",
                 "lib/aarch64-linux-gnu/cmake/SPIRV-Headers"):
        missing.append("spirv-headers")
    return tuple(missing)


def vulkan_fix(missing: tuple) -> str:
    """What to do about vulkan_missing()'s answer, in one clause."""
    packages = [m for m in missing if m != NEWER_HEADERS]
    fixes = [f"apt-get install {' '.join(packages)}"] if packages else []
    if NEWER_HEADERS in missing:
        fixes.append("Vulkan headers with VK_EXT_layer_settings (CMAKE_ARGS=-DVulkan_INCLUDE_DIR="
                     "DIR; scripts/ci/device_lane.sh unpacks Debian 13's libvulkan-dev for this)")
    return "; ".join(fixes) + ", or set VULKAN_SDK to a Vulkan SDK"


BACKENDS = ("cpu", "cuda", "vulkan", "metal")
VULKAN_GPU_TYPES = ("DISCRETE_GPU", "INTEGRATED_GPU")   # what llama.cpp uses without being told


class BackendError(ValueError):
    """A backend forced by the environment that this host cannot build: the message says why."""


@dataclass(frozen=True)
class Host:
    """What the probes found; choose() decides from this alone (tests fake it)."""

    system: str                       # platform.system(): "Linux", "Darwin"
    machine: str                      # platform.machine(): "x86_64", "arm64"
    cpuinfo: str = ""
    nvcc: bool = False
    nvidia_gpu: bool = False
    cuda_arch: str = ""               # CMAKE_CUDA_ARCHITECTURES ("90"); "" lets CMake detect it
    vulkan_devices: Optional[tuple] = ()   # ((name, type), ...); None: vulkaninfo not installed
    vulkan_missing: tuple = ()        # Debian packages a Vulkan build still needs
    backend_env: str = ""             # LOCALSPEC_BACKEND
    cuda_env: str = ""                # LOCALSPEC_CUDA, the older switch


@dataclass(frozen=True)
class Plan:
    """The decision: a backend, why, and the CMake flags (each flag's reason in `notes`)."""

    backend: str
    reason: str
    args: tuple
    notes: tuple


def _forced(host: Host) -> tuple:
    """(backend, reason) asked for by the environment, ("", "") when nothing is forced."""
    name = host.backend_env.strip().lower()
    if name:
        if name not in BACKENDS:
            raise BackendError(f"LOCALSPEC_BACKEND={host.backend_env!r} is not a backend; use one "
                               f"of {', '.join(BACKENDS)}.")
        also = f" (LOCALSPEC_CUDA={host.cuda_env} ignored)" if host.cuda_env else ""
        return name, f"forced by LOCALSPEC_BACKEND={name}{also}"
    if host.cuda_env == "1":
        return "cuda", "forced by LOCALSPEC_CUDA=1 (the older name of LOCALSPEC_BACKEND=cuda)"
    return "", ""


def _check_forced(host: Host, backend: str) -> None:
    if backend == "vulkan" and host.vulkan_missing:
        raise BackendError(f"LOCALSPEC_BACKEND=vulkan needs {', '.join(host.vulkan_missing)}: "
                           f"{vulkan_fix(host.vulkan_missing)}.")
    if backend == "cuda" and not host.nvcc:
        raise BackendError("LOCALSPEC_BACKEND=cuda needs nvcc (the CUDA toolkit) on PATH or in "
                           "/usr/local/cuda/bin.")
    if backend == "cuda" and not host.nvidia_gpu and not host.cuda_arch:
        raise BackendError("LOCALSPEC_BACKEND=cuda without an NVIDIA GPU here: name the GPU's "
                           "architecture, e.g. LOCALSPEC_CUDA_ARCH=89 (CMake has none to detect).")
    if backend == "metal" and host.system != "Darwin":
        raise BackendError(f"LOCALSPEC_BACKEND=metal needs macOS; this is {host.system}.")


def decide(host: Host) -> tuple:
    """(backend, reason): the first that fits, in the order of this module's docstring.

    Example: Linux with nvcc but no NVIDIA GPU, only lavapipe -> ("cpu", "... CPU build").
    """
    backend, reason = _forced(host)
    if backend:
        _check_forced(host, backend)
        return backend, reason
    if host.system == "Darwin" and host.machine == "arm64":
        return "metal", "Apple Silicon: Metal"
    if host.nvcc and host.nvidia_gpu and host.cuda_env != "0":
        return "cuda", "nvcc and an NVIDIA GPU found"
    gpus = [name for name, kind in host.vulkan_devices or () if kind in VULKAN_GPU_TYPES]
    if gpus and not host.vulkan_missing:
        return "vulkan", f"Vulkan GPU {gpus[0]} found, with the Vulkan headers and glslc"
    if gpus:
        return "cpu", (f"Vulkan GPU {gpus[0]} found but {', '.join(host.vulkan_missing)} "
                       f"missing: CPU build ({vulkan_fix(host.vulkan_missing)}; then rerun "
                       "./install.sh)")
    why = ["no GPU found"]
    if host.nvcc and not host.nvidia_gpu:
        why = ["nvcc found but no NVIDIA GPU"]
    elif host.nvcc and host.cuda_env == "0":
        why = ["CUDA ruled out by LOCALSPEC_CUDA=0"]
    soft = [name for name, kind in host.vulkan_devices or () if kind not in VULKAN_GPU_TYPES]
    if soft:
        why.append(f"the only Vulkan device, {soft[0]}, is not a GPU (it runs on this CPU, "
                   "slower than the CPU build)")
    elif host.vulkan_devices is None and host.system == "Linux":
        why.append("Vulkan not probed (no vulkaninfo: Debian package vulkan-tools)")
    return "cpu", "; ".join(why) + ": CPU build (LOCALSPEC_BACKEND=cuda|vulkan to force one)"


def choose(host: Host) -> Plan:
    """The backend and the CMake flags for `host`. Pure function of its input, for tests.

    Example: Linux x86_64 with flags "avx avx2 fma f16c amx_tile", no GPU -> backend cpu,
    GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C=ON, the other listed sets OFF, AMX_*=OFF.
    """
    backend, reason = decide(host)
    args = ["-DGGML_LLAMAFILE=ON", "-DGGML_RPC=ON"]
    why = ["llamafile tinyBLAS on: full prefill speed (from 32 rows in the batch-invariant copy)",
           "RPC backend on: --rpc and `localspec rpc-server` (a small library, no new dependency)"]
    if host.machine.lower() in ("x86_64", "amd64") and host.system != "Darwin":
        flags = cpu_flags(host.cpuinfo)
        args.append("-DGGML_NATIVE=OFF")
        for flag, opt in X86_FEATURES:
            args.append(f"-D{opt}={'ON' if flag in flags else 'OFF'}")
        args += [f"-D{opt}=OFF" for opt in AMX_OPTIONS]
        on = [flag for flag, _ in X86_FEATURES if flag in flags]
        why.append(f"x86: portable build with this CPU's instruction sets ({' '.join(on) or 'none'})")
        if any(f.startswith("amx") for f in flags):
            why.append("CPU has AMX: AMX kernels left out (they crash on first decode, llama.cpp #20824)")
    elif host.system == "Darwin" and host.machine == "arm64":
        args.append("-DGGML_METAL=ON" if backend == "metal" else "-DGGML_METAL=OFF")
    else:
        why.append(f"{host.system}/{host.machine}: llama.cpp's default native build")
    if backend == "cuda":
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={host.cuda_arch or 'native'}"]
        why.append(f"CUDA kernels for architecture {host.cuda_arch} only" if host.cuda_arch else
                   "CUDA kernels for the GPUs CMake finds at build time (native)")
    elif backend == "vulkan":
        args.append("-DGGML_VULKAN=ON")
        why.append("Vulkan: shaders compiled at build time (the slow part of this build)")
    return Plan(backend, reason, tuple(args), tuple(why))


def host() -> Host:
    """Probe this machine and read the LOCALSPEC_BACKEND / LOCALSPEC_CUDA switches."""
    system, machine = platform.system(), platform.machine()
    nvcc = bool(shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists())
    gpu = has_nvidia_gpu()
    arch = os.environ.get("LOCALSPEC_CUDA_ARCH") or (host_cuda_arch() if nvcc and gpu else "")
    linux = system == "Linux"
    return Host(system, machine, read_cpuinfo(), nvcc, gpu, arch,
                host_vulkan_devices() if linux else (), vulkan_missing() if linux else (),
                os.environ.get("LOCALSPEC_BACKEND", ""), os.environ.get("LOCALSPEC_CUDA", ""))


def host_plan() -> Plan:
    """This host's plan, with LOCALSPEC_CMAKE_ARGS (replaces the flags; the backend is then read
    from them) and CMAKE_ARGS (appended) applied."""
    override = os.environ.get("LOCALSPEC_CMAKE_ARGS")
    if override is not None:
        args = tuple(override.split())
        named = [b for b in ("cuda", "vulkan", "metal") if f"-DGGML_{b.upper()}=ON" in args]
        return Plan(named[0] if named else "cpu", "LOCALSPEC_CMAKE_ARGS given: used as is", args,
                    ())
    plan = choose(host())
    extra = tuple(os.environ.get("CMAKE_ARGS", "").split())
    if not extra:
        return plan
    return Plan(plan.backend, plan.reason, plan.args + extra,
                plan.notes + (f"CMAKE_ARGS appended: {' '.join(extra)}",))


def host_cmake_args() -> tuple:
    """(flags, reasons) for this host: what install.sh builds with."""
    plan = host_plan()
    return list(plan.args), [f"backend {plan.backend}: {plan.reason}", *plan.notes]


def main(argv: list) -> int:
    try:
        plan = host_plan()
    except BackendError as e:
        print(f"buildflags: {e}", file=sys.stderr)
        return 2
    if "--backend" in argv:
        print(plan.backend)
        return 0
    if "--explain" in argv:
        print(f"backend: {plan.backend} ({plan.reason})", file=sys.stderr)
        for note in plan.notes:
            print(f"- {note}", file=sys.stderr)
    print(" ".join(plan.args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
