"""A prompt cache's folder on disk: every kept state written through to `<root>/<context key>/`
(atomic files, format.py), found again by later processes, trimmed to a byte budget by least
recent use. Whatever sits in the folder that is not a valid entry of the key asked for (damaged,
crafted, another model's, a folder, a killed save's temporary file) is reported once and skipped
or set aside (NAME.rejected), never an error on every request. The folders are owner-only.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path
from typing import Optional

from ..files.atomic import (REJECTED_SUFFIX, exclusive_lock, refused_line, remove_stale_temps,
                            set_aside, warn)
from ..files.private import private_dir
from .format import SUFFIX, Entry, Rejected, clean_of, read_header, write_file


class DiskFolder:
    """`root`: the folder (its `sessions/` subfolder is the user's named saves, never evicted);
    `budget`: bytes for the entries of every key together, temporary files included."""

    def __init__(self, root: Path, budget: int):
        self.root, self.budget = Path(root), int(budget)
        self._index: dict = {}                 # path -> ((size, mtime_ns), Entry)
        self._warned: set = set()              # paths already reported as unusable
        self._written: dict = {}               # path -> (inode, mtime_ns) of this process's write

    def lock(self):
        """The lock writers hold while they rename into the folder or trim it."""
        return exclusive_lock(self.root / ".lock")

    def write(self, entry: Entry, model_name: str) -> Optional[Path]:
        """Write `entry` to its key's folder (atomic), then trim the folder to the budget, under
        the lock so that two processes trimming at once do not both overshoot. None (with one
        line) when the disk refuses: the state stays in RAM only."""
        folder = self.root / entry.key
        name = hashlib.sha256(entry.tokens.astype("<i4").tobytes()).hexdigest()[:24] + SUFFIX
        try:
            private_dir(self.root)
            private_dir(folder)
            with self.lock():
                write_file(folder / name, entry.key, entry.tokens, entry.data, model_name,
                           clean=entry.clean)
                st = (folder / name).stat()
                self._written[folder / name] = (st.st_ino, st.st_mtime_ns)
                self._trim()
        except OSError as e:
            print(f"localspec: prompt cache: could not write to {folder} ({e}); "
                  "keeping the state in RAM only.", file=sys.stderr)
            return None
        return folder / name

    def scan(self, key: str) -> list:
        """The entries of `key` (headers and tokens only; payloads are read on restore)."""
        try:
            items = list(os.scandir(self.root / key))
        except FileNotFoundError:
            return []
        except OSError as e:
            self._warn_once(self.root / key, f"cannot list it ({e.strerror or e})")
            return []
        found = []
        for item in items:
            if not item.name.endswith(SUFFIX):
                continue
            path = Path(item.path)
            try:
                st = item.stat()
                known = self._index.get(path)
                if known is None or known[0] != (st.st_size, st.st_mtime_ns):
                    known = self._index[path] = _index_entry(path, key)
            except Rejected as e:
                self.discard(path, e)
                continue
            except FileNotFoundError:
                continue
            except OSError as e:       # a folder under an entry's name, no permission...
                self._warn_once(path, e.strerror or str(e))
                continue
            found.append(known[1])
        return found

    def remove_own(self, path: Path) -> None:
        """Remove the file of an entry a newer state replaced, if this process wrote it and
        nobody has rewritten it since: a file is named by its tokens, so another process that
        read the same document wrote the same name, and it is that one's entry as well."""
        written = self._written.pop(path, None)
        if written is None:
            return
        try:
            with self.lock():
                st = path.stat()
                if (st.st_ino, st.st_mtime_ns) == written:
                    path.unlink()
        except OSError:               # gone already (evicted), or the folder is unusable
            pass
        self.forget(path)

    def forget(self, path: Path) -> None:
        """Another process removed `path`: drop what is known of it."""
        self._index.pop(path, None)

    def discard(self, path: Path, why: Rejected) -> None:
        """Say why a file in the folder is not loaded, and set it aside (it can never load:
        files appear there only by atomic rename, each key folder holds one key), unless
        another process has meanwhile put a new file under that name: the check and the rename
        happen under the lock that writers hold while they rename."""
        self._index.pop(path, None)
        aside = set_aside(path, why.inode, self.root / ".lock") if why.inode is not None else None
        warn(refused_line("prompt cache", path, str(why), aside))

    def _trim(self) -> None:
        """Evict least recently used entries until the folder fits the budget. Temporary files
        count too; those of a save that was killed (its process gone) are removed. Refused
        files set aside (NAME.rejected) count and go first: kept for a look, not for ever."""
        files = [(0, _size(path), None)              # another save in progress: count it
                 for folder in self.root.iterdir() if folder.is_dir()
                 for path in remove_stale_temps(folder)]
        files += [(-1, _size(path), path) for path in self.root.glob("*/*" + REJECTED_SUFFIX)
                  if path.parent.name != "sessions"]
        for path in self.root.glob("*/*" + SUFFIX):
            if path.parent.name == "sessions":        # named saves are the user's, never evicted
                continue
            try:
                st = path.stat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files, key=lambda f: f[:2]):
            if total <= self.budget:
                break
            if path is not None:
                path.unlink(missing_ok=True)
                total -= size

    def _warn_once(self, path: Path, why: str) -> None:
        """One line for a path that cannot be used, the first time only: a request is not the
        place to fail for it, nor to repeat it on every request."""
        if path not in self._warned:
            self._warned.add(path)
            print(f"localspec: prompt cache: skipping {path}: {why}.", file=sys.stderr)


def touch(path: Path) -> None:
    """Mark an entry recently used (the budget evicts by mtime, oldest first)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _index_entry(path: Path, key: str) -> tuple:
    """((size, mtime_ns), Entry without its payload) of the file now at `path`."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        header, tokens = read_header(f)
    if header.get("key") != key:
        e = Rejected(f"saved for another model or settings ({header.get('model', '?')})")
        e.inode = st.st_ino
        raise e
    return (st.st_size, st.st_mtime_ns), Entry(key, tokens, None, path,
                                               int(header["payload_bytes"]), clean_of(header))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0

