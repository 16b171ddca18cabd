"""The one door to llama.cpp: the only module that imports `llama_cpp` (upstream renames, kv_cache
-> kv_self -> memory, cost this door only). Pinned to llama-cpp-python 0.3.36. Native resources
have explicit lifetimes (`close()` / context managers, context before model), never `__del__`.

    backend.py   which libraries load and when (`C`, the llama_cpp module, imported on first use),
                 the log, the backend, build features, exact-mode kernels, quantizing
    model.py     Model: loading, vocabulary, tokenizing, chat templates
    context.py   Context: batched decode, the tracked tokens and prefix sync, rollback, states

The two halves reach llama.cpp only through `backend.C`; everything above this package imports
the names it needs from `localspec.llama` (its `__init__`).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import libs, native
from ..errors import LocalspecError


class _NotLoaded:
    """Stands for the llama_cpp module until the first call needs it: importing it loads the
    shared libraries, and exact mode must get the chance to pick the llamafile-free ones first."""

    def __getattr__(self, name: str):
        return getattr(_load_llama_cpp(), name)


C = _NotLoaded()
_lib_state = {"account": ""}
_state: dict = {"decoded": False}      # per process: read-once facts of the build


def _load_llama_cpp(exact: Optional[bool] = None):
    """Import llama_cpp once per process, with the libraries exact mode (LOCALSPEC_EXACT=1 or
    `exact`) asks for; later calls return the module already loaded. The crash guard is on
    before the libraries load, and llama.cpp's log goes to the C sink right after."""
    global C
    if isinstance(C, _NotLoaded):
        native.install_guard()
        if "llama_cpp" in sys.modules:     # a script or test imported it first: its choice stands
            _lib_state["account"] = "the libraries llama_cpp loaded before localspec could choose"
        else:
            with native.phase("in llama.cpp while loading its libraries "
                              "(try LOCALSPEC_EXACT=0, or rerun ./install.sh)"):
                _lib_state["account"] = _import_llama_cpp(
                    libs.exact_requested() if exact is None else exact)
        C = sys.modules["llama_cpp"]
        _install_native_hooks()
    return C


def _global_libstdcxx() -> None:
    """Put the C++ runtime in the process's global symbol scope before llama.cpp loads, so that
    libllama's C++ calls bind to it and never to a copy another library carries. A CUDA build's
    libggml-cuda was seen carrying its own copy of libstdc++'s stream and locale code (H200,
    CUDA 13.0: llama_model::print_info's `stream << int` ran in libggml-cuda's copy and crashed
    in codecvt, docs/gpu.md). libllama is loaded RTLD_LOCAL, so which definition it gets follows
    its dependency order; a copy's locale facet ids, numbered at first use, then need not match
    the real runtime's, and whether they do depends on what ran first (importing numpy first
    changed it). Loading libstdc++.so.6 RTLD_GLOBAL first (or promoting it, when numpy's C++
    code loaded it already) makes the real runtime win whatever was imported before."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_GLOBAL | os.RTLD_NOW)
        except OSError:
            pass          # a static or musl build: no separate runtime to promote


def _import_llama_cpp(exact: bool) -> str:
    given = os.environ.get("LLAMA_CPP_LIB_PATH")
    account = libs.choose(exact)
    _global_libstdcxx()
    try:
        import llama_cpp  # noqa: F401  (reads LLAMA_CPP_LIB_PATH here, and only here)
    except (OSError, RuntimeError) as e:     # a library that would not load: say which set
        raise LocalspecError(f"llama.cpp did not load from {account}: {e}; "
                             f"{_load_fix(str(e))}") from None
    finally:
        if given is None:                    # child processes choose for themselves
            os.environ.pop("LLAMA_CPP_LIB_PATH", None)
    return account


def _load_fix(error: str) -> str:
    """What to do when the libraries would not load: a GPU build on a machine without that GPU's
    driver fails here (CUDA: libcuda.so.1 is the driver's), not with a crash later."""
    for lib, what in (("libcuda", "NVIDIA's driver"), ("libcublas", "NVIDIA's CUDA libraries"),
                      ("libcudart", "NVIDIA's CUDA libraries"), ("libvulkan", "the Vulkan loader")):
        if lib in error:
            return (f"this is a GPU build and {what} is missing: install it, or reinstall for "
                    "the CPU with LOCALSPEC_BACKEND=cpu ./install.sh.")
    return "rerun ./install.sh."


def library_account() -> str:
    """Which libraries this process loaded and why ("" before the first use)."""
    return _lib_state["account"]


# ---------------------------------------------------------------------------------------------
# Logging and backend
#
# llama.cpp logs from any thread and at exit: its log goes to native_guard's C sink (no Python
# callback, ever), and Python drains it with drain_log() after each call that can log.

_LOG_LEVEL_NAMES = {"debug": 1, "info": 2, "warn": 3, "error": 4}  # ggml_log_level values
# What the sink keeps below the level shown: a load's placement lines, a GPU backend's failure
_LOG_KEEP = ("using device ", "offloaded ", " assigned to device ", "failed to initialize")
_log_state = {"min_level": 4, "hooks": None}


def drain_log() -> None:
    """Hand what llama.cpp logged since the last drain to _on_log, oldest first."""
    if _log_state["hooks"] == "c":
        for level, text in native.drain():
            _on_log(level, text.encode("utf-8"), None)


def _on_log(level: int, text: bytes, _user=None) -> None:
    """One drained message: placement lines to a load in progress, a backend's start failure
    kept for check_offload and doctor, the rest to stderr at the level shown (or into the
    message of a load in progress). Called by drain_log, in Python's own time."""
    # level 5 is GGML_LOG_LEVEL_CONT: a continuation of the previous message; follow its filter.
    if level != 5:
        _log_state["last_shown"] = level >= _log_state["min_level"]
    placement = _log_state.get("placement")
    if placement is not None and text and (b"using device " in text or b"offloaded " in text
                                           or b" assigned to device " in text):
        placement.append(text.decode("utf-8", "replace"))   # a load says where layers go
    if text and b"failed to initialize" in text and level >= 4:
        # a GPU backend without its driver or device (ggml_cuda_init on a machine with no
        # NVIDIA driver): said once, in check_offload's error, where it matters; a CPU run of
        # the same build has nothing to report
        _log_state.setdefault("backend_failures", []).append(
            text.decode("utf-8", "replace").strip())
        return
    if _log_state.get("last_shown") and text:
        captured = _log_state.get("captured")
        if captured is not None:  # a load in progress: its errors become part of our message
            captured.append(text.decode("utf-8", "replace"))
            return
        sys.stderr.write(text.decode("utf-8", "replace"))
        sys.stderr.flush()


def set_log_level(level: str = "error") -> None:
    """Route llama.cpp's log output to stderr at `level` or above ("none" silences it).

    Never stdout: the editor protocol owns stdout. Default from LOCALSPEC_LOG, else "error".
    """
    level = os.environ.get("LOCALSPEC_LOG", level).strip().lower()
    if level not in _LOG_LEVEL_NAMES and level != "none":
        if not _log_state.get("warned"):
            print(f"localspec: warning: unknown LOCALSPEC_LOG level {level!r} (use debug, info, "
                  "warn, error or none); showing errors.", file=sys.stderr)
            _log_state["warned"] = True
        level = "error"
    _log_state["min_level"] = _LOG_LEVEL_NAMES.get(level, 99)
    native.configure_log(_log_state["min_level"], _LOG_KEEP)


def _install_native_hooks() -> None:
    """llama.cpp's log to the C sink (LOCALSPEC_LOG_SINK=stderr: llama.cpp's own default, which
    prints everything to stderr), and ggml's abort hook to the C guard (unless
    LOCALSPEC_CRASH_GUARD=0). Both are C function pointers: nothing calls back into Python."""
    if _log_state["hooks"] is not None:
        return
    if native.sink_wanted():
        set_log_level(os.environ.get("LOCALSPEC_LOG", "error"))
        C.llama_log_set(C.llama_log_callback(native.address("lsn_log_sink")), None)
        _log_state["hooks"] = "c"
    else:
        C.llama_log_set(C.llama_log_callback(0), None)   # NULL: llama.cpp prints to stderr
        _log_state["hooks"] = "stderr"
    if native.guard_wanted():
        _raw_function("ggml_set_abort_callback", ctypes.c_void_p, ctypes.c_void_p)(
            native.address("lsn_abort_hook"))


_backend_ready = False


def _ensure_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        _load_llama_cpp()
        with native.phase("in llama.cpp while starting its backends "
                          "(try LOCALSPEC_BACKEND=cpu ./install.sh)"):
            C.llama_backend_init()
        drain_log()
        _backend_ready = True


def _raw_function(name: str, restype, *argtypes):
    """`name` from libllama's handle (which also searches the ggml libraries it links), with
    its ctypes signature set; nothing initialised first."""
    try:
        fn = C.llama_cpp._lib[name]          # a fresh function object: llama_cpp's stay untouched
    except AttributeError:
        raise LocalspecError(f"this llama.cpp build does not export {name}; reinstall with "
                             "./install.sh.") from None
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def ggml_function(name: str, restype, *argtypes):
    """A function of ggml's exported C API, for what llama_cpp does not bind (RPC), with its
    ctypes signature set. Looked up through libllama's handle, which also searches the ggml
    libraries it was linked with: the very copies (and backend registry) llama.cpp uses. (The
    wheel ships libggml.so and libggml.so.0 as two files; opening the first would load a second,
    separate registry.)"""
    _ensure_backend()
    return _raw_function(name, restype, *argtypes)


def system_info() -> str:
    """llama.cpp's compile-time CPU/GPU feature line (what this build can use), read once per
    process (llama_print_system_info asks every backend; a load needs none of it:
    cpu_features() is what the load path reads)."""
    if "system_info" not in _state:
        _ensure_backend()
        _state["system_info"] = C.llama_print_system_info().decode("utf-8", "replace").strip()
    return _state["system_info"]


def cpu_features() -> dict:
    """The CPU backend's own feature list, e.g. {"AVX2": "1", "BATCH_INVARIANT": "32"}: asked of
    ggml's CPU registry entry only, so no GPU backend is touched. Read once per process."""
    from .registry import backend_features        # registry.py builds on this module
    return backend_features("CPU")


def backend_version() -> str:
    """llama-cpp-python's version: saved KV states are only read back by the same one."""
    return C.__version__


def supports_gpu_offload() -> bool:
    return bool(C.llama_supports_gpu_offload())


# ggml_backend_dev_type: 0 CPU, 1 GPU (dedicated memory), 2 IGPU (host memory), 3 ACCEL, 4 META
_DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}
OFFLOAD_TYPES = ("GPU", "IGPU")      # where --gpu-layers puts layers (RPC servers count as GPU)
NOT_GPU_BACKENDS = ("CPU", "RPC", "BLAS")


@dataclass(frozen=True)
class Device:
    """One device ggml's registry holds: "Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "GPU"."""

    name: str
    description: str
    type: str
    free_mib: int
    total_mib: int


def device_handles() -> list:
    """(ggml_backend_dev_t, type name) of every device in ggml's registry, in order. Asks
    nothing of a device (no memory probe, no context)."""
    count = ggml_function("ggml_backend_dev_count", ctypes.c_size_t)
    get = ggml_function("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
    kind = ggml_function("ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
    return [(dev, _DEVICE_TYPES.get(kind(dev), "?")) for dev in (get(i) for i in range(count()))]


def offload_device_names() -> list:
    """Names of the devices --gpu-layers can put layers on ("CUDA0", "Vulkan0", "RPC0[...]"),
    from the registry alone: no device is initialised (check_offload and the crash line)."""
    name = ggml_function("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)
    return [(name(dev) or b"?").decode() for dev, kind in device_handles()
            if kind in OFFLOAD_TYPES]


def devices() -> list:
    """Every device llama.cpp can place layers on, the CPU included, in registry order, with its
    free and total memory. The memory probe creates a GPU's context (CUDA: a few hundred MiB):
    `localspec doctor` asks, a load never does (it uses offload_device_names)."""
    name = ggml_function("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)
    desc = ggml_function("ggml_backend_dev_description", ctypes.c_char_p, ctypes.c_void_p)
    memory = ggml_function("ggml_backend_dev_memory", None, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
    out = []
    for dev, kind in device_handles():
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        with native.phase(f"in llama.cpp while asking {(name(dev) or b'?').decode()} for its "
                          "free memory (try LOCALSPEC_BACKEND=cpu ./install.sh)"):
            memory(dev, ctypes.byref(free), ctypes.byref(total))
        drain_log()
        out.append(Device((name(dev) or b"?").decode(), (desc(dev) or b"").decode(), kind,
                          free.value >> 20, total.value >> 20))
    return out


_GPU_LIBRARIES = {"libggml-cuda": "CUDA", "libggml-vulkan": "Vulkan", "libggml-metal": "Metal",
                  "libggml-hip": "HIP", "libggml-sycl": "SYCL"}


def gpu_backends() -> list:
    """The GPU backends compiled into this build ("Vulkan", "CUDA", "Metal"); [] for a CPU build
    (RPC, which sends layers to other hosts, is not one). From ggml's registry, and from the
    libraries beside libllama: a backend whose driver is missing (no Vulkan ICD) is left out of
    the registry, but its library says the build has it."""
    count = ggml_function("ggml_backend_reg_count", ctypes.c_size_t)
    get = ggml_function("ggml_backend_reg_get", ctypes.c_void_p, ctypes.c_size_t)
    name = ggml_function("ggml_backend_reg_name", ctypes.c_char_p, ctypes.c_void_p)
    names = [(name(get(i)) or b"?").decode() for i in range(count())]
    names = [n for n in names if n.upper() not in NOT_GPU_BACKENDS]
    folder = Path(C.llama_cpp._lib._name).parent
    for prefix, backend in _GPU_LIBRARIES.items():
        if backend not in names and any(folder.glob(f"{prefix}.*")):
            names.append(backend)
    return names


def backend_init_failures() -> list:
    """What GPU backends said when they failed to start (no driver, no device), kept off stderr
    by drain_log: check_offload's error and `localspec doctor` quote it."""
    return list(_log_state.get("backend_failures", []))


def check_offload(n_gpu_layers: int) -> None:
    """Before a load that asks for `n_gpu_layers` on a device: fail in one line, with the fix,
    when there is nowhere to put them (llama.cpp would silently keep every layer on the CPU)."""
    if n_gpu_layers == 0 or offload_device_names():
        return
    backends = gpu_backends()
    if not backends:
        raise LocalspecError(
            "--gpu-layers: this llama.cpp build has no GPU backend (a CPU build); leave "
            "--gpu-layers at 0, put layers on another machine with --rpc HOST:PORT (`localspec "
            "rpc-server` there), or rerun ./install.sh on a machine with a GPU.")
    hidden = " (a CPU-type Vulkan device such as lavapipe is used only when " \
        "GGML_VK_VISIBLE_DEVICES=0 names it)" if "Vulkan" in backends else ""
    failures = backend_init_failures()
    if failures:
        hidden += f" ({'; '.join(failures)})"
    raise LocalspecError(
        f"--gpu-layers: this llama.cpp build has the {'/'.join(backends)} backend but found no "
        f"device{hidden}; install or fix the GPU driver, or reinstall for the CPU with "
        "LOCALSPEC_BACKEND=cpu ./install.sh.")


def batch_invariant_rows() -> int:
    """How many rows a batch may have and still compute every row bit-identically to a one-token
    decode on the CPU (the BATCH_INVARIANT feature of localspec's patched ggml-cpu, install.sh's
    llama_cpp/lib-exact; docs/exactness.md); 0 for llama.cpp's own libraries. The library's
    default limit: exact_rows() is the limit now, which a decode path may raise (patch 0001)."""
    value = cpu_features().get("BATCH_INVARIANT", "0")
    return int(value) if value.isdigit() else 0


def enable_exact_kernels() -> None:
    """Make sure this process decodes on batch-invariant CPU kernels: a verify batch then computes
    bit-identical logits to one-token decoding. They are localspec's patched ggml-cpu
    (llama_cpp/lib-exact, which install.sh builds; loaded here if this is the process's first use
    of llama.cpp); weight repacking stays on. Flash attention must stay off (localspec's
    default): its one-row split-KV path depends on the thread count.
    Measured: max |diff| 0 on every row of batches of 2..17 tokens (SmolLM2 Q4_1, Qwen Q4_K_M
    repacked; tests/test_batch_invariant.py)."""
    first_use = isinstance(C, _NotLoaded)
    _load_llama_cpp(exact=True)
    if batch_invariant_rows() == 0:
        if not first_use:
            raise LocalspecError("--exact must be chosen before this process first uses "
                                 "llama.cpp (it has loaded llama.cpp's own libraries); set "
                                 "LOCALSPEC_EXACT=1.")
        raise LocalspecError("--exact needs localspec's batch-invariant build of ggml-cpu, but "
                             f"this process loaded {library_account()}; rerun ./install.sh "
                             "(without LOCALSPEC_EXACT_LIBS=0).")


def prefer_exact_libraries() -> None:
    """Load llama.cpp, if this is the process's first use of it, with the batch-invariant
    libraries where install.sh laid them out, without insisting on them (a GPU build's --exact:
    the GPU backend's own switch is what it needs; the CPU copy serves layers left on the CPU)."""
    _load_llama_cpp(exact=True)


def tiled_matmul_off() -> bool:
    """Whether enable_exact_kernels() turned ggml's tiled K-quant matmul off in this process."""
    return os.environ.get("GGML_CPU_TILED_MM") == "0"


def build_has_amx() -> bool:
    """True when this llama.cpp build contains the AMX kernels that crash on first decode
    (upstream llama.cpp issue 20824); install.sh builds without them."""
    return any(name.startswith("AMX") for name in cpu_features())


def quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: int,
             tensor_types: Optional[dict] = None, threads: int = 0) -> None:
    """Write `dst`: the GGUF `src` quantized to llama_ftype `ftype` (15 = Q4_K_M) by llama.cpp's
    own quantizer, the one `llama-quantize` runs. tensor_types {tensor name: ggml type id} pins
    tensors to exact types; the rest follow llama.cpp's mixture rules for `ftype`.
    threads 0 = every core. Used to make random-weight models of a real model's shape."""
    _ensure_backend()
    params = C.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    patterns = [(f"^{re.escape(name)}$".encode(), int(t)) for name, t in (tensor_types or {}).items()]
    if patterns:                       # a list ended by a NULL pattern; keep the bytes alive
        overrides = (C.llama_model_tensor_override * (len(patterns) + 1))()
        for slot, (pattern, ggml_type) in zip(overrides, patterns):
            slot.pattern, slot.type = pattern, ggml_type
        params.tt_overrides = overrides
    with native.phase(f"in llama.cpp while quantizing {Path(src).name}"):
        rc = C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    drain_log()
    if rc != 0:
        raise LocalspecError(f"llama.cpp could not quantize {src} (code {rc}).")


# ---------------------------------------------------------------------------------------------
# Model


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)

