"""The checksummed file that holds token ids and a payload: prompt-cache entries and saved
sessions (payload: llama.cpp's KV state) and the draft store (no payload). Written atomically
and owner-only (atomic.py); read back only when the prefix, the header, the size and the
checksum all hold.

Layout: prefix (8-byte magic b"LSPCACHE", u32 format version, u32 header length), a JSON header
(key, model file name, n_tokens, payload_bytes, sha256 of tokens + payload, created, meta,
clean), the tokens as int32 little-endian, then the payload bytes. What `key`, `meta` and the
payload mean is the caller's; validate_header() checks the types and ranges of every field.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Optional

import numpy as np

from . import jsonsafe
from .atomic import atomic_write
from .private import PRIVATE_FILE

MAGIC = b"LSPCACHE"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<8sII")           # magic, format version, header length
_HEX = frozenset("0123456789abcdef")


class Rejected(Exception):
    """A file that must not be loaded; the message says why, in a few words. `inode`: the file
    that was read, so that only that one is set aside, not a newer one of the same name."""

    inode: Optional[int] = None


def write_container(path: Path, key: str, tokens, payload: np.ndarray, model_name: str,
                    meta: Optional[dict] = None, clean: tuple = (0, 0),
                    mode: int = PRIVATE_FILE) -> int:
    """Write a container atomically (the old file or the new one, never half), owner-only
    unless `mode` says otherwise. `tokens`: int32 ids; `payload`: [n] uint8; `clean`: the
    saved context's Context.clean. Returns the file size."""
    toks = np.ascontiguousarray(tokens, dtype="<i4")
    digest = hashlib.sha256(toks.tobytes())
    digest.update(memoryview(payload))
    header = json.dumps({
        "key": key, "model": model_name, "n_tokens": int(toks.size),
        "payload_bytes": int(payload.size), "sha256": digest.hexdigest(), "created": time.time(),
        "meta": meta or {}, "clean": [int(clean[0]), int(clean[1])]}).encode()

    def write(f) -> None:
        f.write(PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)))
        f.write(header)
        f.write(toks.tobytes())
        f.write(memoryview(payload))

    atomic_write(Path(path), write, mode)
    return PREFIX.size + len(header) + toks.nbytes + payload.size


def validate_header(header) -> dict:
    """`header` if every field has the type and range write_container gives it, else Rejected
    naming the first that does not: a crafted but parseable file must not reach a reader that
    trusts it (a `meta` that is a list, sizes that are floats or negative)."""
    if not isinstance(header, dict):
        raise Rejected("its header is not an object")
    for name in ("n_tokens", "payload_bytes"):
        value = header.get(name)
        if type(value) is not int:
            raise Rejected(f"its header's {name} is not a whole number")
        if value < 0:
            raise Rejected(f"its header gives negative sizes ({header.get('n_tokens')} tokens, "
                           f"{header.get('payload_bytes')} bytes)")
    for name in ("key", "model", "sha256"):
        if not isinstance(header.get(name), str):
            raise Rejected(f"its header's {name} is not a string")
    if len(header["sha256"]) != 64 or not set(header["sha256"]) <= _HEX:
        raise Rejected("its header's sha256 is not a sha256")
    if not isinstance(header.get("meta", {}), dict):
        raise Rejected("its header's meta is not an object")
    created = header.get("created", 0)
    if type(created) not in (int, float):
        raise Rejected("its header's created is not a time")
    return header


def read_header(f, what: str = "prompt-cache") -> tuple:
    """(header, tokens [n] int32) of an open container file, the payload left unread; Rejected
    if it is not one ("not a localspec `what` file"), of another format version, damaged,
    crafted or truncated. Sizes come from the open file itself: a path may be replaced by
    another process at any moment."""
    st = os.fstat(f.fileno())
    try:
        raw = f.read(PREFIX.size)
        if len(raw) < PREFIX.size or raw[:8] != MAGIC:
            raise Rejected(f"not a localspec {what} file")
        _, version, n_header = PREFIX.unpack(raw)
        if version != FORMAT_VERSION:
            raise Rejected(f"format version {version}, this localspec reads {FORMAT_VERSION}")
        if n_header > st.st_size - PREFIX.size:
            raise Rejected(f"truncated ({st.st_size} bytes, its header alone says "
                           f"{PREFIX.size + n_header})")
        try:
            header = jsonsafe.loads(f.read(n_header))
        except ValueError as e:
            raise Rejected(f"its header is corrupt ({e})") from None
        validate_header(header)
        n_tokens, n_payload = header["n_tokens"], header["payload_bytes"]
        want = PREFIX.size + n_header + 4 * n_tokens + n_payload
        if st.st_size != want:
            raise Rejected(f"truncated or padded ({st.st_size} bytes, its header says {want})")
    except Rejected as e:
        e.inode = st.st_ino
        raise
    tokens = np.frombuffer(f.read(4 * n_tokens), dtype="<i4").astype(np.int32)
    return header, tokens


def read_payload(f, header: dict, tokens: np.ndarray) -> np.ndarray:
    """The payload [payload_bytes] uint8 that follows read_header()'s tokens in `f`; Rejected
    unless the checksum over tokens and payload holds."""
    data = np.empty(header["payload_bytes"], dtype=np.uint8)
    f.readinto(memoryview(data))
    digest = hashlib.sha256(tokens.astype("<i4").tobytes())
    digest.update(memoryview(data))
    if digest.hexdigest() != header["sha256"]:
        e = Rejected("checksum mismatch (corrupt)")
        e.inode = os.fstat(f.fileno()).st_ino
        raise e
    return data


def read_container(path: Path, what: str = "prompt-cache") -> tuple:
    """(header, tokens, payload) of a whole container file whose checksum holds."""
    with open(path, "rb") as f:
        header, tokens = read_header(f, what)
        return header, tokens, read_payload(f, header, tokens)
