"""The draft store across restarts: one file per model under `<home>/store/`, and the
LearningStore a proposer holds (the in-memory DraftStore, what this process added since its last
save, and whether it may learn at all).

The file is the prompt cache's checksummed format (cache/format.py: magic, format version, JSON
header with the model key, tokens, sha256), with an empty payload and `meta.store_version`;
written atomically (temporary file + rename), readable by its owner only (0600, folder 0700).
Saving merges: under the folder's lock the current file is read again and this process's new
outputs are appended to it, so two processes (two servers, a server and a script) add to one
store and neither loses the other's outputs nor sees half a file. The budget keeps the newest
tokens. Whatever cannot be loaded (corrupt, truncated, another version or model) or saved (a
full disk) is one warning line, once per process; generation goes on with what is in memory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..cache.disk import stale_temp
from ..cache.format import Rejected, model_identity, read_file, write_file
from ..catalog.pull import exclusive_lock
from ..files import cache_dir, env_number
from .store import BREAK, DraftStore, capacity_for

STORE_VERSION = 1
SUFFIX = ".lsds"
DEFAULT_MB = 64.0        # RAM for ~1M tokens (about a year of one person's outputs); the file
                         # is 4 bytes a token, a sixteenth of that
ENV_MB = "LOCALSPEC_STORE_MB"
TRUST_PRIOR = 0.6        # share of store offers right, before any is checked (the sessions'
                         # and unrelated requests' replays: 68% where the store competes)
TRUST_DECAY = 0.9        # per checked offer: the last ~10 count
_EMPTY = np.zeros(0, np.uint8)


def budget_mb(value: Optional[float] = None) -> float:
    """The store's budget in MB: `value`, else $LOCALSPEC_STORE_MB, else 64 (0: no store)."""
    if value is not None:
        return max(0.0, float(value))
    return env_number(ENV_MB, DEFAULT_MB, "MB", "the draft store's budget; 0 turns it off",
                      zero_ok=True)


def store_dir() -> Path:
    """`<home>/store`, created owner-only (what users generate is private)."""
    path = cache_dir("store")
    try:
        os.chmod(path, 0o700)
    except OSError:
        pass
    return path


def store_path(model_path: Path) -> tuple:
    """(file path, key) of a model's store: the key is the model file's identity (the prompt
    cache's: its pinned sha256 or a sampled digest), so one tokenizer's ids never meet
    another's; the name starts with the model file's stem for people listing the folder."""
    key = hashlib.sha256(json.dumps({"model": model_identity(model_path)}).encode()).hexdigest()
    return store_dir() / f"{Path(model_path).stem}-{key[:16]}{SUFFIX}", key[:32]


def saved_hits(header: dict) -> Optional[float]:
    """The trust a store file was saved with (a share in 0..1), or None (none, or not a
    number in range: the prior is used)."""
    hits = (header.get("meta") or {}).get("trust_hits")
    if isinstance(hits, (int, float)) and not isinstance(hits, bool) and 0.0 <= hits <= 1.0:
        return float(hits)
    return None


def read_store(path: Path, key: Optional[str]) -> tuple:
    """(header, tokens [n] int32) of a store file; Rejected (why in a few words) if it is not
    one, damaged, of another store version, or (with `key`) another model's."""
    try:
        header, tokens, _ = read_file(path, None)
    except Rejected as e:
        if str(e).startswith("not a localspec"):
            e.args = ("not a localspec draft-store file",)
        raise
    version = (header.get("meta") or {}).get("store_version")
    if version != STORE_VERSION:
        raise Rejected(f"draft-store version {version}, this localspec reads {STORE_VERSION}")
    if key is not None and header.get("key") != key:
        raise Rejected(f"saved for another model ({header.get('model', '?')})")
    return header, tokens


class StoreFile:
    """One model's store file: load() once, save(new tokens) after requests, under the lock."""

    def __init__(self, path: Path, key: str, model_name: str, capacity: int):
        self.path, self.key, self.model_name, self.capacity = Path(path), key, model_name, capacity
        self.warned = False
        self.hits: Optional[float] = None    # the saved trust (LearningStore.hits), if any

    def _warn(self, what: str) -> None:
        if not self.warned:
            self.warned = True
            print(f"localspec: draft store: {what}", file=sys.stderr)

    def _lock(self):
        return exclusive_lock(self.path.parent / ".lock")

    def load(self) -> np.ndarray:
        """The stored tokens (newest `capacity`); none, with one warning, if the file cannot be
        used; such a file is removed (the next save writes a valid one)."""
        try:
            header, tokens = read_store(self.path, self.key)
            self.hits = saved_hits(header)
            return tokens[-self.capacity:]
        except FileNotFoundError:
            return np.zeros(0, np.int32)
        except Rejected as e:
            self._warn(f"ignoring {self.path}: {e}; starting an empty store.")
            self._remove(e.inode)
        except OSError as e:
            self._warn(f"cannot read {self.path} ({e.strerror or e}); starting an empty store.")
        return np.zeros(0, np.int32)

    def _remove(self, inode: Optional[int]) -> None:
        try:
            with self._lock():
                if inode is None or self.path.stat().st_ino == inode:
                    self.path.unlink()
        except OSError:
            pass

    def save(self, new: Sequence[int], hits: Optional[float] = None) -> bool:
        """Append `new` (this process's outputs since its last save) to the file as it is now,
        keep the newest `capacity` tokens, write it atomically with `hits` (the trust: the
        last process to save sets it). False (one warning per process) when the disk refuses:
        the caller keeps `new` for the next try."""
        new = np.asarray(new, np.int32)
        try:
            with self._lock():
                self._clean_temps()
                try:
                    base = read_store(self.path, self.key)[1]
                except (FileNotFoundError, Rejected):
                    base = np.zeros(0, np.int32)       # damaged or foreign: rebuilt from here
                tokens = trim(np.concatenate([base, new]), self.capacity)
                meta = {"store_version": STORE_VERSION}
                if hits is not None:
                    meta["trust_hits"] = round(float(hits), 6)
                write_file(self.path, self.key, tokens, _EMPTY, self.model_name, meta=meta,
                           mode=0o600)
            return True
        except OSError as e:
            hint = "free some space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else \
                "check the folder's permissions"
            self._warn(f"could not save {self.path} ({e.strerror or e}); this run's outputs "
                       f"stay in memory only ({hint}, or set {ENV_MB}=0).")
            return False

    def _clean_temps(self) -> None:
        """Remove temporary files of saves that were killed (their process gone)."""
        for tmp in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            if stale_temp(tmp):
                tmp.unlink(missing_ok=True)


def trim(tokens: np.ndarray, capacity: int) -> np.ndarray:
    """The newest `capacity` tokens, starting after a BREAK where one falls in the first half
    of what is kept (a cut output's tail would only add noise).

    >>> trim(np.array([1, 2, -1, 3, 4, -1, 5, -1]), 6).tolist()
    [3, 4, -1, 5, -1]
    """
    if len(tokens) <= capacity:
        return tokens
    kept = tokens[len(tokens) - capacity:]
    breaks = np.flatnonzero(kept[: capacity // 2] == BREAK)
    return kept[breaks[0] + 1:] if breaks.size else kept


class LearningStore:
    """What a proposer holds: the store in memory, its file (None: memory only, e.g. the bench),
    and `learn` (False: outputs are not added, the file is only read). Requests call
    begin_output(), add() per step, end_output()."""

    def __init__(self, store: DraftStore, file: Optional[StoreFile] = None, learn: bool = True):
        self.store, self.file, self.learn = store, file, learn
        self._pending: list = []           # tokens added since the last save
        # decayed share of store offers whose first token was right, across requests and
        # (saved with the file) restarts: an agent script's every call
        saved = file.hits if file is not None else None
        self.hits = TRUST_PRIOR if saved is None else saved
        self._open = False                 # an output is being added

    @classmethod
    def for_model(cls, model_path: Path, model_name: str, mb: Optional[float] = None,
                  learn: bool = True, disk: bool = True) -> Optional["LearningStore"]:
        """The store of a model (None when the budget is 0): loaded from its file when `disk`."""
        capacity = capacity_for(budget_mb(mb))
        if capacity < 1:
            return None
        store = DraftStore(capacity)
        file = None
        if disk:
            path, key = store_path(model_path)
            file = StoreFile(path, key, model_name, capacity)
            store.extend(file.load())
        return cls(store, file, learn)

    def checked(self, right: bool) -> None:
        """One store offer's first token against what was emitted there (drafted or not)."""
        self.hits = TRUST_DECAY * self.hits + (1.0 - TRUST_DECAY) * right

    @property
    def trust(self) -> float:
        """The logit by which recent offers were right more (or less) often than offers in
        general: an agent loop's store earns trust, one of unrelated requests loses it."""
        h = min(0.99, max(0.01, self.hits))
        return math.log(h / (1.0 - h)) - math.log(TRUST_PRIOR / (1.0 - TRUST_PRIOR))

    def begin_output(self, prompt: Sequence[int] = ()) -> None:
        """A request starts; the last tokens of its prompt go in first (the chat template's
        "assistant" turn, the question's end), so that the first tokens of later outputs have
        a long context to match, not only the 2-token rest of a chat template."""
        self._open = self.learn
        self.add(list(prompt[-self.store.ngram_max:]))

    def add(self, tokens: Sequence[int]) -> None:
        if self._open and tokens:
            self.store.extend(tokens)
            self._pending.extend(tokens)

    def end_output(self) -> None:
        """The output is complete (or cut short: still what the model wrote): close it with a
        BREAK and save, if learning and a file is kept."""
        if not self._open:
            return
        self._open = False
        self.store.extend([BREAK])
        self._pending.append(BREAK)
        self.flush()

    def remember(self, tokens: Sequence[int], prompt: Sequence[int] = ()) -> None:
        """Add one finished output (after the end of its prompt) at once: the bench and the
        replay add a request's output when it ends, so repeated rounds of one case never
        draft from themselves."""
        self.store.extend(list(prompt[-self.store.ngram_max:]) + list(tokens) + [BREAK])

    def reset(self) -> None:
        """An empty store (a bench session's start); the file is not touched."""
        self.store.clear()
        self._pending = []
        self.hits = TRUST_PRIOR

    def flush(self) -> None:
        """Save what this process added since its last save; kept for the next try when the
        disk refuses (at most the store's capacity of it: the newest)."""
        if self.file is None or not self._pending:
            return
        if self.file.save(self._pending, self.hits):
            self._pending = []
        else:
            del self._pending[:-self.store.capacity]

    def close(self) -> None:
        if self._open:
            self.end_output()
        self.flush()
        self.store.close()


# -- `localspec store stats | clear` ---------------------------------------------------------

def list_stores() -> list:
    """[(path, header or None, tokens or None, why)] of every file in the store folder, for
    `localspec store stats`: a file that cannot be read says why instead."""
    found = []
    for path in sorted(store_dir().glob("*" + SUFFIX)):
        try:
            header, tokens = read_store(path, None)
            found.append((path, header, tokens, ""))
        except (Rejected, OSError) as e:
            found.append((path, None, None, str(e)))
    return found


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
