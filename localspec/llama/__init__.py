"""llama.cpp's one door, and the only face of this package the layers above use: model and
context lifetimes, the backend and its libraries, RPC, the build flags. `backend.py` is the one
module that imports `llama_cpp`; `model.py` and `context.py` reach it through `backend.C`."""

from .backend import (backend_version, build_has_amx, default_threads, enable_exact_kernels,
                      ggml_function, library_account, quantize, set_log_level,
                      supports_gpu_offload, system_info, tiled_matmul_off)
from .context import PREFILL_GRID, Context, ContextParams, cold_prefix
from .model import Model, ModelParams

__all__ = ["PREFILL_GRID", "Context", "ContextParams", "Model", "ModelParams", "cold_prefix", "backend_version", "build_has_amx",
           "default_threads", "enable_exact_kernels", "ggml_function", "library_account",
           "quantize", "set_log_level", "supports_gpu_offload", "system_info", "tiled_matmul_off"]
