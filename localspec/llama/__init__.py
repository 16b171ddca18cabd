"""llama.cpp's one door, and the only face of this package the layers above use: model and
context lifetimes, the backend and its libraries, RPC, the build flags, and the native guard
(native.py: llama.cpp's log sink, abort hook and crash handler in C; docs/crashes.md).
`backend.py` is the one module that imports `llama_cpp`; `model.py` and `context.py` reach it
through `backend.C`."""

from .backend import (Device, backend_init_failures, backend_version, batch_invariant_rows,
                      build_has_amx, cpu_features, default_threads, devices,
                      enable_exact_kernels, ggml_function, gpu_backends, library_account,
                      offload_device_names, prefer_exact_libraries, quantize, set_log_level,
                      supports_gpu_offload, system_info, tiled_matmul_off)
from .context import PREFILL_GRID, Context, ContextParams, cold_prefix
from .model import Model, ModelParams

__all__ = ["PREFILL_GRID", "Context", "ContextParams", "Device", "Model", "ModelParams",
           "backend_init_failures", "backend_version", "batch_invariant_rows", "build_has_amx",
           "cold_prefix", "cpu_features", "default_threads", "devices", "enable_exact_kernels",
           "ggml_function", "gpu_backends", "library_account", "offload_device_names",
           "prefer_exact_libraries",
           "quantize", "set_log_level", "supports_gpu_offload", "system_info",
           "tiled_matmul_off"]
