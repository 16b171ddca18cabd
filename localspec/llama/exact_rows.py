"""The batch-invariant row limit of localspec's ggml-cpu, moved at run time (patch
0001-batch-invariant-switch, docs/exactness.md): batches of fewer rows than the limit compute every row as a
one-token decode does. Bound through backend.ggml_function (looked up on the module, so one
wrapper sees every lookup)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Optional

from ..errors import LocalspecError
from . import backend as _b
from .backend import _state, batch_invariant_rows, cpu_features, library_account
from .registry import backend_features, backend_proc, backend_reg


def exact_rows_settable() -> bool:
    """Whether this process's ggml-cpu lets the batch-invariant row limit move at run time
    (patch 0001: the BATCH_INVARIANT_SET feature and ggml_cpu_set_exact_rows); False for
    llama.cpp's own libraries and for a lib-exact built before 2026-11-26 (rerun ./install.sh)."""
    return cpu_features().get("BATCH_INVARIANT_SET") == "1"


def _exact_rows_function(name: str, restype, *argtypes):
    fn = _state.get(name)
    if fn is None:
        if not exact_rows_settable():
            raise LocalspecError(
                "this process's ggml-cpu cannot raise its batch-invariant row limit ("
                + ("a lib-exact from before the run-time limit; rerun ./install.sh"
                   if batch_invariant_rows() else f"it loaded {library_account()}") + ").")
        fn = _state[name] = _b.ggml_function(name, restype, *argtypes)
    return fn


_exact_rows_lock = threading.Lock()
# set_exact_rows's CPU limit, the GPU backends' (0: off, until --exact), live exact_rows_raised
_exact_rows_state: dict = {"base": 32, "device": 0, "raised": []}


def _apply_exact_rows() -> None:
    raised = _exact_rows_state["raised"]
    if exact_rows_settable():
        _exact_rows_function("ggml_cpu_set_exact_rows", None, ctypes.c_int)(
            max([_exact_rows_state["base"]] + raised))
    if _exact_rows_state["device"]:
        for backend in device_exact_backends():
            _device_function(backend, "ggml_backend_set_exact_rows", None, ctypes.c_int)(
                max([_exact_rows_state["device"]] + raised))


def exact_rows() -> int:
    """Batches of fewer rows than this compute every row bit-identically to a one-token decode
    right now: ggml_cpu_get_exact_rows() where settable, else batch_invariant_rows() (32, or 0
    for llama.cpp's own libraries)."""
    if not exact_rows_settable():
        return batch_invariant_rows()
    return int(_exact_rows_function("ggml_cpu_get_exact_rows", ctypes.c_int)())


def set_exact_rows(n: int) -> int:
    """Process-wide: from now on batches of fewer than `n` rows (at least 32, the library's
    default) take the batch-invariant kernels, and batches of `n` rows or more the fast ones
    (tinyBLAS, the tiled K-quant matmul, the repacked 4-row gemms), as in prefill. A decode
    reads the setting once when its graph starts, so set it between decodes. Raising it makes
    batches of 32 to n-1 rows (prefill's 64-row chunks, if n > 64) slower: cost to be measured
    (tools/exact_rows_cost.py). Returns the previous setting. Raises LocalspecError where
    exact_rows_settable() is False. exact_rows_raised() raises it for one block instead."""
    _exact_rows_function("ggml_cpu_set_exact_rows", None, ctypes.c_int)   # or one error line
    with _exact_rows_lock:
        previous = _exact_rows_state["base"]
        _exact_rows_state["base"] = max(32, int(n))
        _apply_exact_rows()
    return previous


@contextlib.contextmanager
def exact_rows_raised(n: int):
    """`with exact_rows_raised(66): ctx.decode(rows)`: batches of up to n-1 rows are batch-
    invariant inside the block, and the setting goes back afterwards. Nests and overlaps across
    threads: the library runs with the largest n any live block asked for (or set_exact_rows's
    value), so one block's end never lowers another's; a GPU backend's limit, where --exact
    switched it on, moves with the CPU's. Raises LocalspecError where neither can move."""
    n = max(32, int(n))
    if not _exact_rows_state["device"]:
        _exact_rows_function("ggml_cpu_set_exact_rows", None, ctypes.c_int)   # or one error
    with _exact_rows_lock:
        _exact_rows_state["raised"].append(n)
        try:
            _apply_exact_rows()
        except BaseException:
            _exact_rows_state["raised"].remove(n)
            raise
    try:
        yield
    finally:
        with _exact_rows_lock:
            _exact_rows_state["raised"].remove(n)
            _apply_exact_rows()


def exact_for(n_rows: int):
    """The block in which a batch of `n_rows` rows that must equal one-token decodes runs:
    exact_rows_raised(n_rows + 1) past the default limit where a limit moves (the CPU's, and a
    GPU backend's that --exact switched on), else nothing (under 32 rows the kernels are exact
    already; llama.cpp's own libraries promise no exact rows, so there is nothing to raise)."""
    if n_rows >= 32 and (exact_rows_settable() or _exact_rows_state["device"]):
        return exact_rows_raised(n_rows + 1)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# GPU backends: localspec's patched Vulkan and CUDA libraries (patches 0009-vulkan- and
# 0010-cuda-batch-invariant-rows) have a row limit of their own, 0 (off) until set: batches of
# fewer rows compute every row as a one-row batch does. Found through the backend's registry
# entry (its feature list says BATCH_INVARIANT_SET = 1; the setter and getter are looked up by
# name), so a build without the patch simply has none.

DEVICE_BACKENDS = ("Vulkan", "CUDA")    # the GPU backends the series patches, and their patch
DEVICE_PATCHES = {"Vulkan": "0009-vulkan-batch-invariant-rows",
                  "CUDA": "0010-cuda-batch-invariant-rows"}
# Where each patched backend's rows were checked bit for bit (tests/test_device_exact.py); a
# backend missing here compiles (scripts/ci/cuda_compile.sh) but has not been run on its hardware
DEVICE_PROVEN = {"Vulkan": "Mesa's lavapipe, in CI's device lane",
                 "CUDA": "an NVIDIA H200, every weight type tried but F16"}
# Weights whose rows a proven backend has not yet been checked with: the backend, the GGUF
# general.file_type values that carry them (1 MOSTLY_F16, 4 MOSTLY_Q4_1_SOME_F16) and their name.
# CUDA's F16 rows differed on the H200 before patch 0010 moved F16 onto BF16's float sums.
DEVICE_UNPROVEN_TYPES = {"CUDA": ({1, 4}, "F16")}


def device_unproven_note(backends: list, file_type: Optional[str], model_name: str) -> str:
    """The stderr note for an --exact run whose model has weights the device's rows were not
    yet checked with ('' when none): a model of F16 weights on CUDA."""
    for name in backends:
        types, label = DEVICE_UNPROVEN_TYPES.get(name, (set(), ""))
        if file_type is not None and file_type.isdigit() and int(file_type) in types:
            return (f"localspec: --exact on {name}: {model_name} has {label} weights, whose "
                    f"batch-invariant rows compile but have not yet been checked on such a GPU "
                    f"(the other weight types' have); `pytest -m device` checks them on yours "
                    f"(docs/gpu.md)")
    return ""
DEVICE_EXACT_ROWS = 32               # as the CPU library's default; exact_for raises it past


def device_exact_backends() -> list:
    """The GPU backends of this process whose library carries localspec's batch-invariant row
    limit (registered and saying BATCH_INVARIANT_SET = 1)."""
    return [name for name in DEVICE_BACKENDS
            if backend_features(name).get("BATCH_INVARIANT_SET") == "1"]


def _device_function(backend: str, name: str, restype, *argtypes):
    addr = backend_proc(backend_reg(backend), name)
    if not addr:
        raise LocalspecError(f"this process's {backend} library has no {name}: it is not "
                             "localspec's patched build (rerun ./install.sh)")
    return ctypes.CFUNCTYPE(restype, *argtypes)(addr)


def set_device_exact_rows(n: int = DEVICE_EXACT_ROWS) -> None:
    """Process-wide: every patched GPU backend computes batches of fewer than `n` rows (0: off)
    as one-row batches, bit for bit; exact_for raises it around wider verify decodes, as on the
    CPU. Decodes read it as they record their graph, so set it between decodes. Raises
    LocalspecError where no GPU backend is patched."""
    if not device_exact_backends():
        raise LocalspecError("no GPU backend of this process has localspec's batch-invariant "
                             "rows (patches 0009 and 0010 of the series; rerun ./install.sh)")
    with _exact_rows_lock:
        _exact_rows_state["device"] = max(0, int(n))
        if not _exact_rows_state["device"]:
            for backend in device_exact_backends():
                _device_function(backend, "ggml_backend_set_exact_rows", None, ctypes.c_int)(0)
        _apply_exact_rows()


def device_exact_rows() -> int:
    """The smallest row limit among the patched GPU backends right now (0 where none is patched
    or the limit is off): batches of fewer rows are one-row batches' rows bit for bit."""
    limits = [int(_device_function(b, "ggml_backend_get_exact_rows", ctypes.c_int)())
              for b in device_exact_backends()]
    return min(limits) if limits else 0


@contextlib.contextmanager
def device_exact_rows_on(n: int = DEVICE_EXACT_ROWS):
    """set_device_exact_rows(n) for the block, off (0) after it: a measurement or a test of the
    patched GPU library's rows that leaves llama.cpp's own choices to what runs next."""
    set_device_exact_rows(n)
    try:
        yield
    finally:
        set_device_exact_rows(0)
