"""The draft store's file I/O: one file per model under `<home>/store/`, its validator, the
budget, and the `localspec store stats | clear` listing. What a proposer holds (the store in
memory, its trust, learning) is learning_store.py.

The file is the checksummed container (files/container.py: magic, format version, JSON header
with the model key, tokens, sha256) with an empty payload and `meta.store_version`; written
atomically (temporary file + rename), readable by its owner only (0600, folder 0700). Saving
merges: under the folder's lock the current file is read again and this process's new outputs
are appended to it, so two processes (two servers, a server and a script) add to one store and
neither loses the other's outputs nor sees half a file. The budget keeps the newest tokens.
A file that cannot be loaded (corrupt, truncated, crafted, another version, model or
vocabulary) is one warning line and set aside (NAME.rejected): the store starts empty. A
folder the user made read-only is read, never written: one line says so. A save the disk
refuses (full) is one warning per process; generation goes on with what is in memory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..cache.format import model_identity
from ..files import cache_dir, env_number
from ..files.atomic import (REJECTED_SUFFIX, exclusive_lock, refused_line, remove_stale_temps,
                            set_aside)
from ..files import container
from ..files.container import Rejected, write_container
from ..files.private import private_dir
from .store import BREAK, max_tokens_for

STORE_VERSION = 1
SUFFIX = ".lsds"
DEFAULT_MB = 64.0        # RAM for ~1M tokens (about a year of one person's outputs); the file
                         # is 4 bytes a token, a sixteenth of that
ENV_MB = "LOCALSPEC_STORE_MB"
_EMPTY = np.zeros(0, np.uint8)

__all__ = ["BREAK", "ENV_MB", "StoreFile", "budget_mb", "clear_stores", "list_stores",
           "read_store", "saved_hits", "store_dir", "store_path", "validate_store"]


def budget_mb(value: Optional[float] = None) -> float:
    """The store's budget in MB: `value`, else $LOCALSPEC_STORE_MB, else 64 (0: no store)."""
    if value is not None:
        return max(0.0, float(value))
    return env_number(ENV_MB, DEFAULT_MB, "MB", "the draft store's budget; 0 turns it off",
                      zero_ok=True)


def store_dir() -> Path:
    """`<home>/store`, owner-only (what users generate is private); a folder the user made
    read-only stays so (private_dir never adds owner bits)."""
    return private_dir(cache_dir("store"))


def store_path(model_path: Path) -> tuple:
    """(file path, key) of a model's store: the key is the model file's identity (the prompt
    cache's: its pinned sha256 or a sampled digest), so one tokenizer's ids never meet
    another's; the name starts with the model file's stem for people listing the folder."""
    key = hashlib.sha256(json.dumps({"model": model_identity(model_path)}).encode()).hexdigest()
    return store_dir() / f"{Path(model_path).stem}-{key[:16]}{SUFFIX}", key[:32]


def saved_hits(header: dict) -> Optional[float]:
    """The trust a store file was saved with (a share in 0..1), or None (none, or not a
    number in range: the prior is used)."""
    hits = header.get("meta", {}).get("trust_hits")
    if isinstance(hits, (int, float)) and not isinstance(hits, bool) and 0.0 <= hits <= 1.0:
        return float(hits)
    return None


def validate_store(header: dict, tokens: np.ndarray, key: Optional[str] = None,
                   n_vocab: Optional[int] = None) -> None:
    """Rejected unless a container (already checked by files/container.py) is a store this
    localspec can draft from: store version, (with `key`) this model's, token ids that are
    BREAK or (with `n_vocab`) in the model's vocabulary. An id the model does not have would be
    drafted and fail the verify batch of every prompt that matches it."""
    version = header.get("meta", {}).get("store_version")
    if version != STORE_VERSION:
        raise Rejected(f"draft-store version {version!r:.20}, this localspec reads "
                       f"{STORE_VERSION}")
    if key is not None and header["key"] != key:
        raise Rejected(f"saved for another model ({header['model']:.200})")
    if tokens.size:
        low, high = int(tokens.min()), int(tokens.max())
        if low < BREAK:
            raise Rejected(f"it holds token id {low}, below the break marker {BREAK}")
        if n_vocab is not None and high >= n_vocab:
            raise Rejected(f"it holds token id {high}, outside the model's vocabulary "
                           f"({n_vocab} tokens)")


def read_store(path: Path, key: Optional[str], n_vocab: Optional[int] = None) -> tuple:
    """(header, tokens [n] int32) of a store file; Rejected (why in a few words) if it is not
    one, damaged, crafted, of another store version, or (with `key`) another model's, or
    (with `n_vocab`) holds ids the model does not have."""
    with open(path, "rb") as f:
        try:
            header, tokens = container.read_header(f, "draft-store")
            container.read_payload(f, header, tokens)
            validate_store(header, tokens, key, n_vocab)
        except Rejected as e:
            e.inode = os.fstat(f.fileno()).st_ino
            raise
    return header, tokens


def read_only_reason(folder: Path) -> Optional[str]:
    """Why this process cannot write `folder` (the user made it read-only: its mode, even for
    root; or a read-only file system), None when it can."""
    try:
        mode = stat.S_IMODE(folder.stat().st_mode)
    except OSError as e:
        return e.strerror or str(e)
    if not mode & stat.S_IWUSR or not os.access(folder, os.W_OK | os.X_OK):
        return f"mode {mode:o}"
    return None


class StoreFile:
    """One model's store file: load() once, save(new tokens) after requests, under the lock.
    `max_tokens`: the most tokens kept (the budget's); `n_vocab`: the model's vocabulary size,
    when known, so that a file holding other ids is refused."""

    def __init__(self, path: Path, key: str, model_name: str, max_tokens: int,
                 n_vocab: Optional[int] = None):
        self.path, self.key, self.model_name = Path(path), key, model_name
        self.max_tokens, self.n_vocab = max_tokens, n_vocab
        self.warned = False
        self.hits: Optional[float] = None    # the saved trust (LearningStore.hits), if any
        self.read_only: Optional[str] = None    # why this run only reads the file

    def _warn(self, what: str) -> None:
        if not self.warned:
            self.warned = True
            print(f"localspec: draft store: {what}", file=sys.stderr)

    def _lock(self):
        return exclusive_lock(self.path.parent / ".lock")

    def load(self) -> np.ndarray:
        """The stored tokens (newest `max_tokens`); none, with one warning, if the file cannot
        be used; such a file is set aside (the next save writes a valid one). In a read-only
        folder the file is only read: one line says why nothing is saved this run."""
        self.read_only = read_only_reason(self.path.parent)
        try:
            header, tokens = read_store(self.path, self.key, self.n_vocab)
            self.hits = saved_hits(header)
            tokens = tokens[-self.max_tokens:]
        except FileNotFoundError:
            tokens = np.zeros(0, np.int32)
        except Rejected as e:
            aside = None if self.read_only else \
                set_aside(self.path, e.inode, self.path.parent / ".lock")
            if not self.warned:
                self.warned = True
                stays = f" It stays: {self.path.parent} is read-only ({self.read_only})." \
                    if self.read_only else ""
                print(refused_line("draft store", self.path, str(e), aside) + stays +
                      " Starting an empty store.", file=sys.stderr)
            return np.zeros(0, np.int32)
        except OSError as e:
            self._warn(f"cannot read {self.path} ({e.strerror or e}); starting an empty store.")
            return np.zeros(0, np.int32)
        if self.read_only:
            self._warn(f"{self.path.parent} is read-only ({self.read_only}): drafting from its "
                       f"{len(tokens):,} stored tokens, not saving this run's outputs (chmod "
                       "u+w the folder to let the store learn again).")
        return tokens

    def save(self, new: Sequence[int], hits: Optional[float] = None) -> bool:
        """Append `new` (this process's outputs since its last save) to the file as it is now,
        keep the newest `max_tokens` tokens, write it atomically with `hits` (the trust: the
        last process to save sets it). False (one warning per process) when the disk refuses:
        the caller keeps `new` for the next try. A read-only folder (load() said so) is not
        written: True, nothing to retry."""
        if self.read_only:
            return True
        new = np.asarray(new, np.int32)
        try:
            with self._lock():
                remove_stale_temps(self.path.parent, f".{self.path.name}.*.tmp")
                try:
                    base = read_store(self.path, self.key, self.n_vocab)[1]
                except (FileNotFoundError, Rejected):
                    base = np.zeros(0, np.int32)       # damaged or foreign: rebuilt from here
                tokens = trim(np.concatenate([base, new]), self.max_tokens)
                meta = {"store_version": STORE_VERSION}
                if hits is not None:
                    meta["trust_hits"] = round(float(hits), 6)
                write_container(self.path, self.key, tokens, _EMPTY, self.model_name, meta)
            return True
        except OSError as e:
            hint = "free some space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else \
                "check the folder's permissions"
            self._warn(f"could not save {self.path} ({e.strerror or e}); this run's outputs "
                       f"stay in memory only ({hint}, or set {ENV_MB}=0).")
            return False


def trim(tokens: np.ndarray, max_tokens: int) -> np.ndarray:
    """The newest `max_tokens` tokens, starting after a BREAK where one falls in the first half
    of what is kept (a cut output's tail would only add noise).

    >>> trim(np.array([1, 2, -1, 3, 4, -1, 5, -1]), 6).tolist()
    [3, 4, -1, 5, -1]
    """
    if len(tokens) <= max_tokens:
        return tokens
    kept = tokens[len(tokens) - max_tokens:]
    breaks = np.flatnonzero(kept[: max_tokens // 2] == BREAK)
    return kept[breaks[0] + 1:] if breaks.size else kept


def new_store_file(model_path: Path, model_name: str, max_tokens: int,
                   n_vocab: Optional[int] = None) -> StoreFile:
    """The StoreFile of a model (its path and key from store_path)."""
    path, key = store_path(model_path)
    return StoreFile(path, key, model_name, max_tokens, n_vocab)


# -- `localspec store stats | clear` ---------------------------------------------------------

def list_stores() -> list:
    """[(path, header or None, tokens or None, why)] of every file in the store folder, for
    `localspec store stats`: a file that cannot be read says why, and what the next run does
    with it (next_run())."""
    found = []
    folder = store_dir()
    for path in sorted(folder.glob("*" + SUFFIX)):
        try:
            header, tokens = read_store(path, None)
            found.append((path, header, tokens, ""))
        except (Rejected, OSError) as e:
            found.append((path, None, None, f"{e.strerror or e}" if isinstance(e, OSError)
                          else str(e)))
    return found


def next_run(path: Path, why: str = "") -> str:
    """What the next run does with an unusable store file, for `localspec store stats`: it can
    only start afresh where it may rename the file aside and write a new one.

    >>> next_run(Path("/nonexistent/m.lsds"))[:28]
    'the next run cannot replace '
    """
    ro = read_only_reason(path.parent)
    if ro:
        return (f"the next run cannot replace it: {path.parent} is read-only ({ro}); "
                "delete it or make the folder writable")
    if not os.access(path, os.R_OK):
        return "the next run cannot read it either: fix its permissions or delete it"
    return (f"the next run moves it to {path.name}{REJECTED_SUFFIX} and starts an empty "
            "store")


def clear_stores(only: Optional[Path] = None) -> int:
    """Remove every store file (or the one at `only`) under the folder's lock; how many."""
    folder = store_dir()
    n = 0
    with exclusive_lock(folder / ".lock"):
        for path in folder.glob("*" + SUFFIX):
            if only is None or path == only:
                path.unlink(missing_ok=True)
                n += 1
    return n
