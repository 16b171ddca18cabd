"""A loaded GGUF model: loading (with the placement llama.cpp logs), vocabulary, tokenizing,
token pieces, chat templates."""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..errors import LocalspecError
from ..files import check_gguf_magic
from . import backend as _b
from . import native, rpc


@dataclass(frozen=True)
class ModelParams:
    """How to load a GGUF. n_gpu_layers: 0 = CPU only, -1 = offload every layer."""

    n_gpu_layers: int = 0
    use_mmap: bool = True
    # None = auto: keep llama.cpp's repacked CPU kernels unless this build has AMX kernels.
    use_extra_bufts: Optional[bool] = None


def _placement(lines: list) -> str:
    """Where llama.cpp put the layers, from its load log: e.g. "31/31 layers on RPC0
    (10.0.0.2:50052)", "3/29 layers on Vulkan0 (llvmpipe) (CPU 26, Vulkan0 3)" (per device
    when llama.cpp said so, at its debug level); "" when every layer stayed on the CPU."""
    devices = [line.split("using device ", 1)[1].split(" (unknown id)")[0].split(" - ")[0].strip()
               for line in lines if "using device " in line]
    counts = [line.split("offloaded ", 1)[1].split()[0] for line in lines if "offloaded " in line]
    if not devices or not counts or counts[0].startswith("0/"):
        return ""
    per_device: dict = {}
    for line in lines:           # "load_tensors: layer   3 assigned to device Vulkan0, is_swa = 0"
        if " assigned to device " in line and "load_tensors" in line:
            dev = line.split(" assigned to device ", 1)[1].split(",")[0].strip()
            per_device[dev] = per_device.get(dev, 0) + 1
    split = f" ({', '.join(f'{d} {n}' for d, n in per_device.items())})" if per_device else ""
    return f"{counts[0]} layers on {', '.join(devices)}{split}"


def _load_error(path: Path, reason: str, log: str, n_gpu_layers: int) -> str:
    """One line for a load llama.cpp refused, from what it logged: a device without memory for
    the layers, a GPU backend that failed, or a file it cannot read."""
    low = log.lower()
    if n_gpu_layers and ("out of memory" in low or "failed to allocate" in low):
        return (f"llama.cpp could not load {path.name} onto the GPU: not enough device memory "
                f"({reason or 'allocation failed'}); lower --gpu-layers (0 keeps every layer on "
                "the CPU) or use a smaller model.")
    if n_gpu_layers and ("cuda error" in low or "vulkan" in low and "error" in low):
        detail = reason or log.strip().splitlines()[-1]
        return (f"llama.cpp could not load {path.name} onto the GPU ({detail}); try --gpu-layers "
                "0, or reinstall for the CPU with LOCALSPEC_BACKEND=cpu ./install.sh.")
    return (f"llama.cpp could not load {path}: {reason or 'truncated, corrupt or unsupported'}; "
            "re-pull the model or check the file.")


def _check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise LocalspecError(f"model file not found: {path}")
    if not path.is_file():
        raise LocalspecError(f"model path is not a file: {path}")
    check_gguf_magic(path)


class Model:
    """A loaded GGUF model and its vocabulary. close() frees it, and first every Context made
    over it (a context must not outlive its model); a closed model raises instead of calling
    into freed memory."""

    def __init__(self, path: str | os.PathLike, params: ModelParams = ModelParams()):
        _b._ensure_backend()
        self.path = Path(path)
        self._model = None
        self._contexts: list = []                 # open Contexts over this model
        _check_gguf_file(self.path)
        mp = _b.C.llama_model_default_params()
        mp.n_gpu_layers = params.n_gpu_layers
        mp.load_mode = _b.C.LLAMA_LOAD_MODE_MMAP if params.use_mmap else _b.C.LLAMA_LOAD_MODE_NONE
        extra = params.use_extra_bufts
        if extra is None:
            extra = not _b.build_has_amx()
            if not extra:
                print("localspec: this llama.cpp build has AMX kernels that crash on this CPU; "
                      "loading without repacked weights (slower). Reinstall with ./install.sh to fix.",
                      file=sys.stderr)
        mp.use_extra_bufts = extra
        self.repacked = bool(extra)       # CPU weight repacking on: part of the speed identity
        self.n_gpu_layers = params.n_gpu_layers
        _b.check_offload(params.n_gpu_layers)     # nowhere to put the layers: say so, not CPU
        # --gpu-layers 0: an empty device list (NULL-terminated, holding only the NULL), so
        # llama.cpp opens no GPU (no CUDA/Vulkan context, no pinned host buffers, no VRAM).
        # NULL would mean "every device"; llama.cpp copies the list during the load.
        self._no_devices = (ctypes.c_void_p * 1)(None) if params.n_gpu_layers == 0 else None
        if self._no_devices is not None:
            mp.devices = ctypes.addressof(self._no_devices)
        self.device = "CPU" if params.n_gpu_layers == 0 else \
            ("+".join(_b.offload_device_names()) or "GPU")
        self.crash_hint = native.crash_hint(params.n_gpu_layers != 0,
                                               bool(_b.gpu_backends()))
        _b._log_state["captured"], _b._log_state["placement"] = [], []
        try:
            with native.phase(f"in llama.cpp while loading {self.path.name} onto "
                              f"{self.device} {self.crash_hint}"):
                self._model = _b.C.llama_model_load_from_file(str(self.path).encode(), mp)
        finally:
            _b.drain_log()
            captured = _b._log_state.pop("captured")
            placement = _b._log_state.pop("placement")
            rpc.secure()                          # a connection it opened: bounded from now
        if not self._model:
            self._model = None
            reason = next((line.split("error loading model:")[-1].strip()
                           for line in "".join(captured).splitlines()
                           if "error loading model" in line), "")
            raise LocalspecError(_load_error(self.path, reason, "".join(captured),
                                             params.n_gpu_layers))
        self.placement = _placement(placement)
        self.n_layer: int = _b.C.llama_model_n_layer(self._model)
        self._vocab = _b.C.llama_model_get_vocab(self._model)
        self.n_vocab: int = _b.C.llama_vocab_n_tokens(self._vocab)
        self.bos: int = _b.C.llama_vocab_bos(self._vocab)
        self.eos: int = _b.C.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(_b.C.llama_vocab_get_add_bos(self._vocab))
        self.n_ctx_train: int = _b.C.llama_model_n_ctx_train(self._model)
        self._pieces: dict[int, bytes] = {}
        self._eog = np.zeros(self.n_vocab, dtype=bool)
        for tok in range(self.n_vocab):
            self._eog[tok] = _b.C.llama_vocab_is_eog(self._vocab, tok)

    @property
    def closed(self) -> bool:
        return self._model is None

    @property
    def output_on_device(self) -> bool:
        """Whether the output layer was offloaded (llama.cpp offloads it past n_layer layers):
        a decode's logits are then made on a GPU (or an RPC server)."""
        return self.n_gpu_layers < 0 or self.n_gpu_layers > self.n_layer

    def handle(self):
        """The llama_model pointer, for a Context being made over it; raises once closed."""
        if self._model is None:
            raise LocalspecError(f"{self.path.name} was closed; load it again to use it.")
        return self._model

    def _voc(self):
        self.handle()
        return self._vocab

    # -- identity ---------------------------------------------------------------------------
    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        _b.C.llama_model_desc(self.handle(), buf, 256)
        return buf.value.decode("utf-8", "replace")

    def meta(self, key: str) -> Optional[str]:
        buf = ctypes.create_string_buffer(4096)
        n = _b.C.llama_model_meta_val_str(self.handle(), key.encode(), buf, 4096)
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V rows take in an f16 KV cache over all layers (an estimate
        from the hyperparameters; Qwen2.5-1.5B: 28 layers x 2 x 2 KV heads x 128 x 2 B = 28 KiB)."""
        model = self.handle()
        n_layer = _b.C.llama_model_n_layer(model)
        n_head = max(1, _b.C.llama_model_n_head(model))
        n_head_kv = _b.C.llama_model_n_head_kv(model)
        arch = self.meta("general.architecture") or ""
        head_k = int(self.meta(f"{arch}.attention.key_length") or
                     _b.C.llama_model_n_embd(model) // n_head)
        head_v = int(self.meta(f"{arch}.attention.value_length") or head_k)
        return n_layer * n_head_kv * (head_k + head_v) * 2

    def vocab_type(self) -> int:
        return int(_b.C.llama_vocab_type(self._voc()))

    def token_text(self, token: int) -> bytes:
        """The raw vocabulary entry of `token` (as stored in the GGUF), for compatibility checks."""
        return _b.C.llama_vocab_get_text(self._voc(), token) or b""

    def fim_tokens(self) -> Optional[dict]:
        """The model's fill-in-the-middle tokens as llama.cpp's vocabulary reports them:
        {"pre", "suf", "mid"} always, "pad", "rep", "sep" where the model has them; None when
        it lacks any of pre/suf/mid (no FIM training that llama.cpp knows of)."""
        found = {}
        for name in ("pre", "suf", "mid", "pad", "rep", "sep"):
            tok = int(getattr(_b.C, f"llama_vocab_fim_{name}")(self._voc()))
            if 0 <= tok < self.n_vocab:
                found[name] = tok
        return found if all(k in found for k in ("pre", "suf", "mid")) else None

    def is_eog(self, token: int) -> bool:
        """End of generation: EOS, EOT or any token the GGUF marks as ending a turn."""
        return bool(self._eog[token])

    # -- text <-> tokens ----------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data, vocab = text.encode("utf-8"), self._voc()
        n_max = len(data) + 8
        buf = (_b.C.llama_token * n_max)()
        n = _b.C.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            n_max = -n
            buf = (_b.C.llama_token * n_max)()
            n = _b.C.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise LocalspecError("llama.cpp failed to tokenize the input text.")
        return list(buf[:n])

    def token_piece(self, token: int) -> bytes:
        """Bytes that `token` contributes to the output text (control tokens render empty)."""
        piece = self._pieces.get(token)
        if piece is None:
            buf, vocab = ctypes.create_string_buffer(64), self._voc()
            n = _b.C.llama_token_to_piece(vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = _b.C.llama_token_to_piece(vocab, token, buf, -n, 0, False)
            piece = buf.raw[:n]
            self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode("utf-8", "replace")

    # -- chat --------------------------------------------------------------------------------
    def chat_template(self) -> Optional[str]:
        tmpl = _b.C.llama_model_chat_template(self.handle(), None)
        return tmpl.decode("utf-8", "replace") if tmpl else None

    def apply_chat_template(self, messages: Sequence[dict], add_assistant: bool = True) -> str:
        """Render messages [{"role", "content"}] with the GGUF's own template (llama.cpp's
        built-in template engine, which recognises the common families: ChatML, Llama, ...)."""
        tmpl = _b.C.llama_model_chat_template(self.handle(), None)
        if not tmpl:
            raise LocalspecError(f"{self.path.name} has no chat template; use a raw prompt instead.")
        keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
        arr = (_b.C.llama_chat_message * len(keep))()
        for i, (role, content) in enumerate(keep):
            arr[i].role, arr[i].content = role, content
        size = 2 * sum(len(r) + len(c) for r, c in keep) + 256
        buf = ctypes.create_string_buffer(size)
        n = _b.C.llama_chat_apply_template(tmpl, arr, len(keep), add_assistant, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = _b.C.llama_chat_apply_template(tmpl, arr, len(keep), add_assistant, buf, n)
        if n < 0:
            raise LocalspecError(
                f"llama.cpp does not support the chat template of {self.path.name}; use a raw prompt.")
        return buf.raw[:n].decode("utf-8", "replace")

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the contexts over this model, then the model. Idempotent."""
        for ctx in list(self._contexts):
            ctx.close()
        if self._model is not None:
            model, self._model, self._vocab = self._model, None, None
            with native.phase(f"in llama.cpp while freeing {self.path.name} "
                              f"{self.crash_hint}"):
                _b.C.llama_model_free(model)
            _b.drain_log()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
