"""The one door to llama.cpp: models, contexts, batches, logits, KV rollback, chat templates, logs.

No module outside this package imports `llama_cpp`; upstream renames (kv_cache -> kv_self ->
memory) cost this package only. Native resources have explicit lifetimes (`close()` / context
managers, context before model), never `__del__`. Pinned to llama-cpp-python 0.3.36.

    backend.py   which libraries load and when (`C`, the llama_cpp module), log, build features
    model.py     Model: loading, vocabulary, tokenizing, chat templates
    context.py   Context: batched decode, the tracked tokens and prefix sync, rollback, states
"""

from __future__ import annotations

from . import backend
from .backend import (backend_version, build_has_amx, default_threads, enable_exact_kernels,
                      ggml_function, library_account, quantize, set_log_level,
                      supports_gpu_offload, system_info, tiled_matmul_off)
from .context import Context, ContextParams
from .model import Model, ModelParams

__all__ = ["Context", "ContextParams", "Model", "ModelParams", "backend_version",
           "build_has_amx", "default_threads", "enable_exact_kernels", "ggml_function",
           "library_account", "quantize", "set_log_level", "supports_gpu_offload", "system_info",
           "tiled_matmul_off"]


def __getattr__(name: str):
    """`llama.C`: the llama_cpp module itself (loaded on first use), for scripts that time it."""
    if name == "C":
        return backend._load_llama_cpp()
    raise AttributeError(name)
