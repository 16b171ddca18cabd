"""The one door to llama.cpp: models, contexts, batches, logits, KV rollback, chat templates, logs.

No other module imports `llama_cpp`; upstream renames (kv_cache -> kv_self -> memory) cost this file
only. Native resources have explicit lifetimes (`close()` / context managers, context before model),
never `__del__`. Pinned to llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from . import libs
from .errors import LocalspecError
from .files import check_gguf_magic


class _NotLoaded:
    """Stands for the llama_cpp module until the first call needs it: importing it loads the
    shared libraries, and exact mode must get the chance to pick the llamafile-free ones first."""

    def __getattr__(self, name: str):
        return getattr(_load_llama_cpp(), name)


C = _NotLoaded()
_lib_state = {"account": ""}


def _load_llama_cpp(exact: Optional[bool] = None):
    """Import llama_cpp once per process, with the libraries exact mode (LOCALSPEC_EXACT=1 or
    `exact`) asks for; later calls return the module already loaded."""
    global C
    if isinstance(C, _NotLoaded):
        if "llama_cpp" in sys.modules:     # a script or test imported it first: its choice stands
            _lib_state["account"] = "the libraries llama_cpp loaded before localspec could choose"
        else:
            _lib_state["account"] = _import_llama_cpp(
                libs.exact_requested() if exact is None else exact)
        C = sys.modules["llama_cpp"]
        _install_log_callback()
    return C


def _import_llama_cpp(exact: bool) -> str:
    given = os.environ.get("LLAMA_CPP_LIB_PATH")
    account = libs.choose(exact)
    try:
        import llama_cpp  # noqa: F401  (reads LLAMA_CPP_LIB_PATH here, and only here)
    except (OSError, RuntimeError) as e:     # a library that would not load: say which set
        raise LocalspecError(f"llama.cpp did not load from {account}: {e}; rerun ./install.sh.") \
            from None
    finally:
        if given is None:                    # child processes choose for themselves
            os.environ.pop("LLAMA_CPP_LIB_PATH", None)
    return account


def library_account() -> str:
    """Which libraries this process loaded and why ("" before the first use)."""
    return _lib_state["account"]


# ---------------------------------------------------------------------------------------------
# Logging and backend

_LOG_LEVEL_NAMES = {"debug": 1, "info": 2, "warn": 3, "error": 4}  # ggml_log_level values
_log_state = {"min_level": 4, "callback": None}  # keep the ctypes callback alive for the process


def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # level 5 is GGML_LOG_LEVEL_CONT: a continuation of the previous message; follow its filter.
    if level != 5:
        _log_state["last_shown"] = level >= _log_state["min_level"]
    placement = _log_state.get("placement")
    if placement is not None and text and (b"using device " in text or b"offloaded " in text):
        placement.append(text.decode("utf-8", "replace"))   # a load says where layers go
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
    if not isinstance(C, _NotLoaded):   # else _load_llama_cpp() installs it: a level loads nothing
        _install_log_callback()


def _install_log_callback() -> None:
    if _log_state["callback"] is None:
        _log_state["callback"] = C.llama_log_callback(_on_log)
        C.llama_log_set(_log_state["callback"], ctypes.c_void_p(0))


_backend_ready = False


def _ensure_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        set_log_level(os.environ.get("LOCALSPEC_LOG", "error"))
        C.llama_backend_init()
        _backend_ready = True


def ggml_function(name: str, restype, *argtypes):
    """A function of ggml's exported C API, for what llama_cpp does not bind (RPC), with its
    ctypes signature set. Looked up through libllama's handle, which also searches the ggml
    libraries it was linked with: the very copies (and backend registry) llama.cpp uses. (The
    wheel ships libggml.so and libggml.so.0 as two files; opening the first would load a second,
    separate registry.)"""
    _ensure_backend()
    try:
        fn = C.llama_cpp._lib[name]          # a fresh function object: llama_cpp's stay untouched
    except AttributeError:
        raise LocalspecError(f"this llama.cpp build does not export {name}; reinstall with "
                             "./install.sh.") from None
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def system_info() -> str:
    """llama.cpp's compile-time CPU/GPU feature line (what this build can use)."""
    return C.llama_print_system_info().decode("utf-8", "replace").strip()


def backend_version() -> str:
    """llama-cpp-python's version: saved KV states are only read back by the same one."""
    return C.__version__


def supports_gpu_offload() -> bool:
    return bool(C.llama_supports_gpu_offload())


_state = {"decoded": False}


def enable_exact_kernels() -> None:
    """Make CPU decoding batch-invariant: a verify batch then computes bit-identical logits to
    one-token decoding. Needs llama.cpp without llamafile's tinyBLAS (the lib-exact copy that
    install.sh builds, loaded here if this is the process's first use of llama.cpp) and models
    loaded with use_extra_bufts=False (no repacking) and flash attention off; this turns off
    ggml's tiled K-quant matmul, which ggml reads once per process, so it must run before any
    decode.
    Measured: max |diff| 0 on every row of batches of 2..17 tokens (SmolLM2 Q4_1, Qwen Q4_K_M).
    """
    first_use = isinstance(C, _NotLoaded)
    _load_llama_cpp(exact=True)
    if "LLAMAFILE" in system_info():
        if not first_use:
            raise LocalspecError("--exact must be chosen before this process first uses llama.cpp "
                                 "(it has loaded the default libraries); set LOCALSPEC_EXACT=1.")
        raise LocalspecError("--exact needs llama.cpp's libraries without llamafile's tinyBLAS, "
                             f"but this process loaded {library_account()}; rerun ./install.sh "
                             "(without LOCALSPEC_EXACT_LIBS=0).")
    if _state["decoded"] and not tiled_matmul_off():
        raise LocalspecError("exact mode must be chosen before the first decode in this process.")
    os.environ["GGML_CPU_TILED_MM"] = "0"


def tiled_matmul_off() -> bool:
    """Whether enable_exact_kernels() turned ggml's tiled K-quant matmul off in this process."""
    return os.environ.get("GGML_CPU_TILED_MM") == "0"


def build_has_amx() -> bool:
    """True when this llama.cpp build contains the AMX kernels that crash on first decode
    (upstream llama.cpp issue 20824); install.sh builds without them."""
    return "AMX" in system_info()


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
    rc = C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise LocalspecError(f"llama.cpp could not quantize {src} (code {rc}).")


# ---------------------------------------------------------------------------------------------
# Model


@dataclass(frozen=True)
class ModelParams:
    """How to load a GGUF. n_gpu_layers: 0 = CPU only, -1 = offload every layer."""

    n_gpu_layers: int = 0
    use_mmap: bool = True
    # None = auto: keep llama.cpp's repacked CPU kernels unless this build has AMX kernels.
    use_extra_bufts: Optional[bool] = None


def _placement(lines: list) -> str:
    """Where llama.cpp put the layers, from its load log: e.g. "31/31 layers on RPC0
    (10.0.0.2:50052)"; "" when every layer stayed on the CPU."""
    devices = [line.split("using device ", 1)[1].split(" (unknown id)")[0].split(" - ")[0].strip()
               for line in lines if "using device " in line]
    counts = [line.split("offloaded ", 1)[1].split()[0] for line in lines if "offloaded " in line]
    if not devices or not counts or counts[0].startswith("0/"):
        return ""
    return f"{counts[0]} layers on {', '.join(devices)}"


def _check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise LocalspecError(f"model file not found: {path}")
    if not path.is_file():
        raise LocalspecError(f"model path is not a file: {path}")
    check_gguf_magic(path)


class Model:
    """A loaded GGUF model and its vocabulary."""

    def __init__(self, path: str | os.PathLike, params: ModelParams = ModelParams()):
        _ensure_backend()
        self.path = Path(path)
        _check_gguf_file(self.path)
        mp = C.llama_model_default_params()
        mp.n_gpu_layers = params.n_gpu_layers
        mp.load_mode = C.LLAMA_LOAD_MODE_MMAP if params.use_mmap else C.LLAMA_LOAD_MODE_NONE
        extra = params.use_extra_bufts
        if extra is None:
            extra = not build_has_amx()
            if not extra:
                print("localspec: this llama.cpp build has AMX kernels that crash on this CPU; "
                      "loading without repacked weights (slower). Reinstall with ./install.sh to fix.",
                      file=sys.stderr)
        mp.use_extra_bufts = extra
        self.repacked = bool(extra)       # CPU weight repacking on: part of the speed identity
        self.n_gpu_layers = params.n_gpu_layers
        _log_state["captured"], _log_state["placement"] = [], []
        try:
            self._model = C.llama_model_load_from_file(str(self.path).encode(), mp)
        finally:
            captured = _log_state.pop("captured")
            placement = _log_state.pop("placement")
        if not self._model:
            reason = next((line.split("error loading model:")[-1].strip()
                           for line in "".join(captured).splitlines()
                           if "error loading model" in line), "truncated, corrupt or unsupported")
            raise LocalspecError(f"llama.cpp could not load {self.path}: {reason}; re-pull the "
                                 "model or check the file.")
        self.placement = _placement(placement)
        self._vocab = C.llama_model_get_vocab(self._model)
        self.n_vocab: int = C.llama_vocab_n_tokens(self._vocab)
        self.bos: int = C.llama_vocab_bos(self._vocab)
        self.eos: int = C.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(C.llama_vocab_get_add_bos(self._vocab))
        self.n_ctx_train: int = C.llama_model_n_ctx_train(self._model)
        self._pieces: dict[int, bytes] = {}
        self._eog = np.zeros(self.n_vocab, dtype=bool)
        for tok in range(self.n_vocab):
            self._eog[tok] = C.llama_vocab_is_eog(self._vocab, tok)

    # -- identity ---------------------------------------------------------------------------
    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        C.llama_model_desc(self._model, buf, 256)
        return buf.value.decode("utf-8", "replace")

    def meta(self, key: str) -> Optional[str]:
        buf = ctypes.create_string_buffer(4096)
        n = C.llama_model_meta_val_str(self._model, key.encode(), buf, 4096)
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V rows take in an f16 KV cache over all layers (an estimate
        from the hyperparameters; Qwen2.5-1.5B: 28 layers x 2 x 2 KV heads x 128 x 2 B = 28 KiB)."""
        n_layer = C.llama_model_n_layer(self._model)
        n_head = max(1, C.llama_model_n_head(self._model))
        n_head_kv = C.llama_model_n_head_kv(self._model)
        arch = self.meta("general.architecture") or ""
        head_k = int(self.meta(f"{arch}.attention.key_length") or
                     C.llama_model_n_embd(self._model) // n_head)
        head_v = int(self.meta(f"{arch}.attention.value_length") or head_k)
        return n_layer * n_head_kv * (head_k + head_v) * 2

    def vocab_type(self) -> int:
        return int(C.llama_vocab_type(self._vocab))

    def token_text(self, token: int) -> bytes:
        """The raw vocabulary entry of `token` (as stored in the GGUF), for compatibility checks."""
        return C.llama_vocab_get_text(self._vocab, token) or b""

    def is_eog(self, token: int) -> bool:
        """End of generation: EOS, EOT or any token the GGUF marks as ending a turn."""
        return bool(self._eog[token])

    # -- text <-> tokens ----------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (C.llama_token * n_max)()
        n = C.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            n_max = -n
            buf = (C.llama_token * n_max)()
            n = C.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise LocalspecError("llama.cpp failed to tokenize the input text.")
        return list(buf[:n])

    def token_piece(self, token: int) -> bytes:
        """Bytes that `token` contributes to the output text (control tokens render empty)."""
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = C.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = C.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
            piece = buf.raw[:n]
            self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode("utf-8", "replace")

    # -- chat --------------------------------------------------------------------------------
    def chat_template(self) -> Optional[str]:
        tmpl = C.llama_model_chat_template(self._model, None)
        return tmpl.decode("utf-8", "replace") if tmpl else None

    def apply_chat_template(self, messages: Sequence[dict], add_assistant: bool = True) -> str:
        """Render messages [{"role", "content"}] with the GGUF's own template (llama.cpp's
        built-in template engine, which recognises the common families: ChatML, Llama, ...)."""
        tmpl = C.llama_model_chat_template(self._model, None)
        if not tmpl:
            raise LocalspecError(f"{self.path.name} has no chat template; use a raw prompt instead.")
        keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
        arr = (C.llama_chat_message * len(keep))()
        for i, (role, content) in enumerate(keep):
            arr[i].role, arr[i].content = role, content
        size = 2 * sum(len(r) + len(c) for r, c in keep) + 256
        buf = ctypes.create_string_buffer(size)
        n = C.llama_chat_apply_template(tmpl, arr, len(keep), add_assistant, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = C.llama_chat_apply_template(tmpl, arr, len(keep), add_assistant, buf, n)
        if n < 0:
            raise LocalspecError(
                f"llama.cpp does not support the chat template of {self.path.name}; use a raw prompt.")
        return buf.raw[:n].decode("utf-8", "replace")

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._model:
            C.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Context


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ContextParams:
    """Context settings. n_threads None = every core this process may use."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: Optional[int] = None
    flash_attn: bool = False


class Context:
    """One sequence (seq 0) of KV cache over a Model, with the batch buffer reused for every decode.

    Invariant: `tokens` are the ids whose KV rows fill positions 0..n_past-1 of seq 0, in order;
    decode() appends at n_past. Every change of the KV cache goes through this class, so `tokens`
    is always what the cache holds, whatever raised in between.
    """

    def __init__(self, model: Model, params: ContextParams = ContextParams()):
        self.model = model
        self.params = params
        cp = C.llama_context_default_params()
        cp.n_ctx = params.n_ctx
        cp.n_batch = cp.n_ubatch = min(params.n_batch, params.n_ctx)
        threads = params.n_threads or default_threads()
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = (C.LLAMA_FLASH_ATTN_TYPE_ENABLED if params.flash_attn
                              else C.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cp.no_perf = True
        self._ctx = C.llama_init_from_model(model._model, cp)
        if not self._ctx:
            raise LocalspecError(f"llama.cpp could not create a context of {params.n_ctx} tokens "
                                 "(out of memory?); try a smaller --ctx.")
        self.n_ctx: int = C.llama_n_ctx(self._ctx)
        self.n_batch: int = cp.n_batch
        self.n_threads = threads
        self._mem = C.llama_get_memory(self._ctx)
        self._batch = C.llama_batch_init(self.n_batch, 0, 1)
        # Zero-copy numpy views over the batch arrays; seq ids are fixed to 0 once here.
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))[:] = 1
        for i in range(self.n_batch):
            b.seq_id[i][0] = 0
        self.tokens: list = []

    @property
    def n_past(self) -> int:
        """Positions filled in the KV cache."""
        return len(self.tokens)

    def decode(self, tokens: Sequence[int], logits: str | Sequence[int] = "last") -> np.ndarray:
        """Append `tokens` at n_past and return logits for the chosen rows.

        logits: "last" (one row: prompt prefill), "all", "none", or row indices into `tokens`.
        Returns a float32 view [n_rows, n_vocab] into llama.cpp's buffer, valid until the next
        decode (copy it if you keep it). Long inputs are split into n_batch chunks.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("decode() needs at least one token")
        if self.n_past + n > self.n_ctx:
            raise LocalspecError(
                f"the text needs {self.n_past + n} tokens but the context holds {self.n_ctx}; "
                "raise --ctx or shorten the input.")
        if isinstance(logits, str):
            rows = {"last": [n - 1], "all": range(n), "none": []}[logits]
        else:
            rows = logits
        want = np.zeros(n, dtype=np.int8)
        want[list(rows)] = 1
        n_rows = int(want.sum())
        if n_rows and want[:((n - 1) // self.n_batch) * self.n_batch].any():
            raise ValueError("logit rows must all fall in the last n_batch-sized chunk")
        for start in range(0, n, self.n_batch):
            chunk = slice(start, min(n, start + self.n_batch))
            m = chunk.stop - chunk.start
            self._tok[:m] = tokens[chunk]
            self._pos[:m] = np.arange(self.n_past, self.n_past + m)  # n_past grows per chunk
            self._out[:m] = want[chunk]
            self._batch.n_tokens = m
            rc = C.llama_decode(self._ctx, self._batch)
            _state["decoded"] = True
            if rc != 0:
                self._drop_failed_chunk()
                raise LocalspecError(f"llama.cpp decode failed (code {rc}); the context may be full.")
            self.tokens.extend(int(t) for t in tokens[chunk])
        if n_rows == 0:
            return np.empty((0, self.model.n_vocab), dtype=np.float32)
        ptr = C.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.model.n_vocab))

    def sync(self, tokens: Sequence[int], stop=None, chunk: int = 0) -> tuple:
        """Make the KV cache hold exactly `tokens`: keep the longest prefix it already holds,
        drop the rest, evaluate what is missing. The last token is always evaluated, since its
        logits row is returned. The one place KV prefix reuse is decided.
        Returns (logits row [n_vocab] float32 view, number of rows reused); the row is None when
        `stop` (a threading.Event) was set between two chunks of `chunk` tokens (0: n_batch).

        Example: KV holds [5, 6, 7, 8]; sync([5, 6, 9]) drops the rows of 7 and 8, decodes 9
        and returns (row of 9, 2).
        """
        if len(tokens) == 0:
            raise ValueError("sync() needs at least one token")
        common = 0
        for held, wanted in zip(self.tokens, tokens):
            if held != wanted:
                break
            common += 1
        if not self.truncate(min(common, len(tokens) - 1)):
            self.clear()              # the memory refuses partial removal: start over
        reused = self.n_past
        step = min(chunk or self.n_batch, self.n_batch)
        while len(tokens) - self.n_past > step:   # whole chunks before the last: no logits
            if stop is not None and stop.is_set():
                return None, reused
            self.decode(tokens[self.n_past:self.n_past + step], logits="none")
        if stop is not None and stop.is_set():
            return None, reused
        return self.decode(tokens[self.n_past:], logits="last")[0], reused

    def truncate(self, n_keep: int) -> bool:
        """Drop KV rows at positions >= n_keep. Returns False when the model's memory refuses a
        partial removal (recurrent/hybrid models); the cache is left unchanged then."""
        if n_keep < 0:
            raise ValueError(f"truncate() needs n_keep >= 0, got {n_keep}")
        if n_keep >= self.n_past:
            return True
        ok = bool(C.llama_memory_seq_rm(self._mem, 0, n_keep, -1))
        if ok:
            del self.tokens[n_keep:]
        return ok

    def clear(self) -> None:
        C.llama_memory_clear(self._mem, True)
        self.tokens = []

    def rows_held(self) -> int:
        """KV rows llama.cpp holds for seq 0 (n_past, unless an interrupt broke bookkeeping)."""
        return int(C.llama_memory_seq_pos_max(self._mem, 0)) + 1     # 0 when empty

    def reconcile(self) -> None:
        """Make the cache agree with `tokens` after an interruption: a Ctrl-C that lands between
        llama_decode returning and its rows being recorded leaves rows nobody knows about."""
        held = self.rows_held()
        if held > self.n_past:
            self._drop_failed_chunk()
        elif held < self.n_past:
            self.clear()

    def _drop_failed_chunk(self) -> None:
        """A failed llama_decode may leave part of its batch in the cache: keep the chunks that
        succeeded (`tokens` already lists exactly those), or nothing if that is refused."""
        if not bool(C.llama_memory_seq_rm(self._mem, 0, self.n_past, -1)):
            self.clear()

    # -- saved states (what the prompt cache keeps) ------------------------------------------
    def state_size(self) -> int:
        """Bytes save_state() writes now: seq 0's KV rows, their positions, a small header."""
        return int(C.llama_state_seq_get_size(self._ctx, 0))

    def save_state(self, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Copy seq 0's KV state (positions 0..n_past-1) out of llama.cpp.

        out: a reusable uint8 buffer of at least state_size() bytes. Returns the filled bytes,
        [state_size()] uint8. Logits are not saved: after restore_state(), decode at least one
        token before sampling.
        """
        size = self.state_size()
        if out is None:
            out = np.empty(size, dtype=np.uint8)
        elif out.dtype != np.uint8 or out.size < size or not out.flags.c_contiguous:
            raise ValueError(f"save_state needs a contiguous uint8 buffer of {size} bytes")
        dst = out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = C.llama_state_seq_get_data(self._ctx, dst, size, 0)
        if n != size:
            raise LocalspecError(f"llama.cpp wrote {n} of {size} bytes of KV state.")
        return out[:size]

    def restore_state(self, data, tokens: Sequence[int]) -> None:
        """Replace seq 0 with a state save_state() took from a context of the same model and
        settings that held `tokens`; they become `self.tokens`.

        data: bytes or a uint8 array. Raises LocalspecError, leaving the context empty, when
        llama.cpp refuses the state (other layer count, KV types, too few cells) or the state
        does not hold exactly positions 0..n_tokens-1.
        """
        n_tokens = len(tokens)
        if n_tokens > self.n_ctx:
            self.clear()
            raise LocalspecError(f"a saved state of {n_tokens} tokens does not fit a context of "
                                 f"{self.n_ctx}; raise --ctx.")
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        # Seq 0 is all this context holds: start from an empty cache so the rows land in cells
        # 0..n-1 as a fresh evaluation's would (the same cell layout, the same sums).
        C.llama_memory_clear(self._mem, True)
        _log_state["captured"] = []   # llama.cpp says why it refuses; that goes in our message
        try:
            n = C.llama_state_seq_set_data(
                self._ctx, src.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), src.size, 0)
        finally:
            captured = _log_state.pop("captured")
        lo = C.llama_memory_seq_pos_min(self._mem, 0)
        hi = C.llama_memory_seq_pos_max(self._mem, 0)
        if n == 0 or (n_tokens and (lo, hi) != (0, n_tokens - 1)) or (not n_tokens and hi >= 0):
            self.clear()
            why = " ".join(line.split(":", 1)[-1].strip() for line in "".join(captured)
                           .splitlines() if line.strip()) or \
                f"it holds positions {lo}..{hi}, not 0..{n_tokens - 1}"
            raise LocalspecError(f"llama.cpp refused a saved KV state: {why}.")
        self.tokens = [int(t) for t in tokens]

    def close(self) -> None:
        if self._ctx:
            C.llama_batch_free(self._batch)
            C.llama_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
