"""ggml's backend registry, read through backend.py's ggml_function: a backend's entry by name,
the functions it gives by name (its proc address), and its feature list (llama.cpp's feature
line, one backend at a time). localspec's patched libraries announce themselves there (the CPU's
BATCH_INVARIANT, Vulkan's BATCH_INVARIANT_SET) and give their row-limit setters
(exact_rows.py)."""

from __future__ import annotations

import ctypes

from . import backend as _b
from .backend import _state


class _Feature(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]   # ggml_backend_feature


def backend_features(name: str) -> dict:
    """One ggml backend's feature list ({} where the backend is not registered or lists none),
    e.g. localspec's patched Vulkan library: {"BATCH_INVARIANT_SET": "1"}. Read once per process
    and backend."""
    key = f"features:{name}"
    if key not in _state:
        reg = backend_reg(name)
        addr = backend_proc(reg, "ggml_backend_get_features")
        found = {}
        if addr:
            get = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)(addr)
            features = get(reg)
            for i in range(256):
                if not features[i].name:
                    break
                found[features[i].name.decode()] = (features[i].value or b"").decode()
        _state[key] = found
    return _state[key]


def backend_reg(name: str):
    """ggml's registry entry for a backend by name ("CPU", "Vulkan", "CUDA"), or None."""
    return _b.ggml_function("ggml_backend_reg_by_name", ctypes.c_void_p, ctypes.c_char_p)(
        name.encode())


def backend_proc(reg, name: str):
    """The address a backend's registry entry gives for a function name, or None."""
    if not reg:
        return None
    return _b.ggml_function("ggml_backend_reg_get_proc_address", ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_char_p)(reg, name.encode())
