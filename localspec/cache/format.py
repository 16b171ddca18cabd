"""What a saved KV state may be loaded into, and how it is stored: the context key (model file
identity + the settings that change KV bytes) and the prompt cache's entry files, which are the
checksummed container of files/container.py with llama.cpp's sequence state as the payload.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..catalog.models import known_models, model_path
from ..files import container
from ..files.container import FORMAT_VERSION, Rejected, write_container
from ..llama import (Context, Model, backend_version, cold_prefix, system_info,
                     tiled_matmul_off)
from ..llama.context import common_prefix  # noqa: F401  (the cache's users import it here)

SUFFIX = ".lskv"


@dataclass
class Entry:
    """A saved KV state: in RAM (data), on disk (path), or both."""

    key: str                       # context_key() of the context it was saved from
    tokens: np.ndarray             # [n] int32: the tokens whose KV rows the state holds
    data: Optional[np.ndarray]     # [nbytes] uint8 state; None while it lives on disk only
    path: Optional[Path] = None    # its disk copy, if any
    nbytes: int = 0
    clean: tuple = (0, 0)          # Context.clean when saved: the rows a grid prefill may keep

    def usable(self, prompt: Sequence[int], grid: int) -> int:
        """Rows of this state a prefill of `prompt` on `grid` may keep (Context.sync)."""
        return cold_prefix(common_prefix(self.tokens, prompt), self.clean, grid)


# ---------------------------------------------------------------------------------------------
# Keys: which saved states a context may load


_model_ids: dict = {}


def model_identity(path: Path) -> str:
    """A content key of a GGUF file, cheap to compute. Catalog models: their pinned sha256 (the
    catalog's final name only ever holds a verified file). Other files: sha256 over size, mtime
    and 32 blocks of 64 KiB spread from the first to the last byte (2 MiB read, ~ms), so a
    fine-tune that shares the header (Qwen's first MiBs are vocabulary) still differs."""
    path = Path(path).resolve()
    st = path.stat()
    memo = (str(path), st.st_size, st.st_mtime_ns)
    if memo in _model_ids:
        return _model_ids[memo]
    ident = None
    for entry in known_models():
        if model_path(entry).resolve() == path and entry.size == st.st_size:
            ident = "sha256:" + entry.sha256
    if ident is None:
        digest = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
        block = 1 << 16
        with open(path, "rb") as f:
            for i in range(32):
                f.seek(max(0, st.st_size - block) * i // 31)
                digest.update(f.read(block))
        ident = "sampled:" + digest.hexdigest()
    _model_ids[memo] = ident
    return ident


def context_key(ctx: Context) -> str:
    """32 hex digits naming what a state of `ctx` can be loaded into: the model's identity and
    every setting that changes KV bytes or layout (KV type, flash attention's V layout, the
    kernels that computed it, GPU offload, llama.cpp's build and state format, this file
    format, and the KV buffers of a `--parallel N` context: llama.cpp refuses a state saved
    with another count, "n_stream mismatch"). Not n_ctx: a state fits any context with enough
    cells, which restore checks."""
    model: Model = ctx.model
    parts = {"model": model_identity(model.path), "kv": "f16", "flash_attn": ctx.params.flash_attn,
             "repacked": model.repacked, "tiled_mm_off": tiled_matmul_off(),
             "gpu_layers": model.n_gpu_layers, "llama": backend_version(), "build": system_info(),
             "format": FORMAT_VERSION}
    streams = getattr(ctx, "n_stream", 1)        # slots.SeqContext; a lone context's key stays
    if streams != 1:
        parts["streams"] = streams
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Entry files: the checksummed container (files/container.py) holding a KV state


def write_file(path: Path, key: str, tokens, data: np.ndarray, model_name: str,
               meta: Optional[dict] = None, clean: tuple = (0, 0)) -> int:
    """Write an entry atomically and owner-only (a prompt's token ids are its documents): a
    reader sees the old file or the new one, never half of one. `clean`: the saved context's
    Context.clean. Returns the file size."""
    return write_container(path, key, tokens, data, model_name, meta, clean)


def read_header(f) -> tuple:
    """(header dict, tokens [n] int32) of an open cache file; Rejected if it is not one, of
    another format version, damaged, crafted (validate_header) or truncated, or holds negative
    token ids. The payload is left unread."""
    header, tokens = container.read_header(f, "prompt-cache")
    if tokens.size and int(tokens.min()) < 0:
        e = Rejected(f"it holds a negative token id ({int(tokens.min())})")
        e.inode = os.fstat(f.fileno()).st_ino
        raise e
    return header, tokens


def clean_of(header: dict) -> tuple:
    """The saved context's Context.clean from a header; (0, 0), nothing reusable on the grid,
    when absent (files of earlier versions) or not a consistent pair."""
    try:
        n_clean, grid = (int(x) for x in header.get("clean", (0, 0)))
    except (TypeError, ValueError, OverflowError):
        return (0, 0)
    ok = grid > 0 and 0 <= n_clean <= int(header["n_tokens"]) and n_clean % grid == 0
    return (n_clean, grid) if ok else (0, 0)


def read_file(path: Path, key: Optional[str]) -> tuple:
    """(header, tokens, payload [n] uint8) of a cache file whose checksum holds; Rejected when
    it is corrupt or, with `key`, saved from another model or settings."""
    with open(path, "rb") as f:
        header, tokens = read_header(f)
        if key is not None and header["key"] != key:
            e = Rejected(f"saved for another model or settings ({header['model']})")
            e.inode = os.fstat(f.fileno()).st_ino
            raise e
        return header, tokens, container.read_payload(f, header, tokens)
