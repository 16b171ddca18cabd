"""What a saved KV state may be loaded into, and how it is stored: the context key (model file
identity + the settings that change KV bytes) and the prompt cache's file format, written
atomically and read back only when its header, size and checksum all hold.

File layout: prefix (8-byte magic b"LSPCACHE", u32 format version, u32 header length), a JSON
header (key, model file name, n_tokens, payload_bytes, sha256 of tokens + payload, created,
meta), the tokens as int32 little-endian, then llama.cpp's sequence state as saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..catalog.models import known_models, model_path
from ..llama import (Context, Model, backend_version, cold_prefix, system_info,
                     tiled_matmul_off)

MAGIC = b"LSPCACHE"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")          # magic, format version, header length
SUFFIX = ".lskv"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix. Example: common_prefix([1, 2, 3], [1, 2, 4]) == 2."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


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


class Rejected(Exception):
    """A cache file that must not be loaded; the message says why, in a few words. `inode`: the
    file that was read, so that only that one is removed, not a newer one of the same name."""

    inode: Optional[int] = None


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
    format). Not n_ctx: a state fits any context with enough cells, which restore checks."""
    model: Model = ctx.model
    parts = {"model": model_identity(model.path), "kv": "f16", "flash_attn": ctx.params.flash_attn,
             "repacked": model.repacked, "tiled_mm_off": tiled_matmul_off(),
             "gpu_layers": model.n_gpu_layers, "llama": backend_version(), "build": system_info(),
             "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# The file format: prefix (magic, version, header length), JSON header, tokens, state payload


def write_file(path: Path, key: str, tokens, data: np.ndarray, model_name: str,
               meta: Optional[dict] = None, clean: tuple = (0, 0), mode: int = 0o666) -> int:
    """Write an entry atomically (temp file in the same dir, then os.replace): a reader sees the
    old file or the new one, never half of one. `clean`: the saved context's Context.clean;
    `mode`: the file's permissions before the umask (0o600: its owner's only). Returns the
    file size."""
    toks = np.ascontiguousarray(tokens, dtype="<i4")
    digest = hashlib.sha256(toks.tobytes())
    digest.update(memoryview(data))
    header = json.dumps({"key": key, "model": model_name, "n_tokens": int(toks.size),
                         "payload_bytes": int(data.size), "sha256": digest.hexdigest(),
                         "created": time.time(), "meta": meta or {},
                         "clean": [int(clean[0]), int(clean[1])]}).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)))
            f.write(header)
            f.write(toks.tobytes())
            f.write(memoryview(data))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return _PREFIX.size + len(header) + toks.nbytes + data.size


def read_header(f) -> tuple:
    """(header dict, tokens [n] int32) of an open cache file; Rejected if it is not one, of
    another format version, or truncated. The payload is left unread. Sizes come from the open
    file itself: a path may be replaced by another process at any moment."""
    st = os.fstat(f.fileno())
    try:
        raw = f.read(_PREFIX.size)
        if len(raw) < _PREFIX.size or raw[:8] != MAGIC:
            raise Rejected("not a localspec prompt-cache file")
        _, version, n_header = _PREFIX.unpack(raw)
        if version != FORMAT_VERSION:
            raise Rejected(f"format version {version}, this localspec reads {FORMAT_VERSION}")
        try:
            header = json.loads(f.read(n_header))
            n_tokens, n_payload = int(header["n_tokens"]), int(header["payload_bytes"])
        except (ValueError, KeyError, TypeError):
            raise Rejected("its header is corrupt") from None
        if n_tokens < 0 or n_payload < 0:
            raise Rejected(f"its header gives negative sizes ({n_tokens} tokens, "
                           f"{n_payload} bytes)")
        want = _PREFIX.size + n_header + 4 * n_tokens + n_payload
        if st.st_size != want:
            raise Rejected(f"truncated or padded ({st.st_size} bytes, its header says {want})")
    except Rejected as e:
        e.inode = st.st_ino
        raise
    tokens = np.frombuffer(f.read(4 * n_tokens), dtype="<i4").astype(np.int32)
    return header, tokens


def clean_of(header: dict) -> tuple:
    """The saved context's Context.clean from a header; (0, 0), nothing reusable on the grid,
    when absent (files of earlier versions) or not a consistent pair."""
    try:
        n_clean, grid = (int(x) for x in header.get("clean", (0, 0)))
    except (TypeError, ValueError):
        return (0, 0)
    ok = grid > 0 and 0 <= n_clean <= int(header["n_tokens"]) and n_clean % grid == 0
    return (n_clean, grid) if ok else (0, 0)


def read_file(path: Path, key: Optional[str]) -> tuple:
    """(header, tokens, payload [n] uint8) of a cache file whose checksum holds; Rejected when
    it is corrupt or, with `key`, saved from another model or settings."""
    with open(path, "rb") as f:
        header, tokens = read_header(f)
        try:
            if key is not None and header.get("key") != key:
                raise Rejected(f"saved for another model or settings ({header.get('model', '?')})")
            data = np.empty(int(header["payload_bytes"]), dtype=np.uint8)
            f.readinto(memoryview(data))
            digest = hashlib.sha256(tokens.astype("<i4").tobytes())
            digest.update(memoryview(data))
            if digest.hexdigest() != header.get("sha256"):
                raise Rejected("checksum mismatch (corrupt)")
        except Rejected as e:
            e.inode = os.fstat(f.fileno()).st_ino
            raise
    return header, tokens, data
