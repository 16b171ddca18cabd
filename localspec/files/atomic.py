"""Writing files that several processes share: the folder lock, atomic writes (temporary file
in the same folder, then rename), the cleanup of temporary files a killed process left, and
what a reader does with a file it refuses (one warning, the file set aside, the run goes on).
Used by the prompt cache, the draft store, calibrations and model pulls alike.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from .private import PRIVATE_FILE, private_dir

REJECTED_SUFFIX = ".rejected"
STALE_AFTER_S = 60           # a temporary file untouched this long, of a gone process, is left over
# ".NAME.PID.RANDOM.tmp": the pid of the writer, 8 hex digits against name clashes
_TEMP = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]{1,200})\.[0-9a-f]{8}\.tmp")
_PID_MAX = 2**22             # Linux's PID_MAX_LIMIT; other systems stay below it too


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created owner-only if missing) across
    processes: what writers of one folder hold while they rename into it, trim it or set a file
    aside, and what serialises two pulls of one model. Blocks until it is free."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; concurrent writers are the user's risk
        yield
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, PRIVATE_FILE)
    with open(fd, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def temp_path(path: Path) -> Path:
    """Where a write of `path` goes first: ".NAME.PID.RANDOM.tmp" beside it."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def atomic_write(path: Path, write: Callable, mode: int = PRIVATE_FILE) -> None:
    """Write `path` whole or not at all: `write(f)` fills a temporary file (created with `mode`,
    owner-only by default, in `path`'s folder, which is made owner-only first), then it is renamed
    over `path`. A reader sees the old file or the new one, never half of one; on any error the
    temporary file is removed and the old file stays."""
    if mode == PRIVATE_FILE:
        private_dir(path.parent)
    tmp = temp_path(path)
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def temp_owner(name: str) -> Optional[int]:
    """The writer's pid in a temporary file's name, 0 when the name holds no pid a process can
    have (a crafted name: 99999999999), None when it is not a temporary file's name at all.

    >>> temp_owner(".a.lskv.1234.0badc0de.tmp"), temp_owner(".a.lskv.99999999999.0badc0de.tmp")
    (1234, 0)
    >>> temp_owner("a.lskv") is None
    True
    """
    m = _TEMP.fullmatch(name)
    if m is None:
        return None
    pid = int(m["pid"])
    return pid if 0 < pid <= _PID_MAX else 0


def stale_temp(path: Path) -> bool:
    """Whether a temporary file of atomic_write was left by a process that no longer runs (or
    never could: no valid pid in its name) and has not been written for a minute."""
    pid = temp_owner(path.name)
    if pid is None:
        return False
    try:
        if time.time() - path.stat().st_mtime < STALE_AFTER_S:
            return False
        if pid:
            os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:       # no permission to signal it: another user's process runs
        return False
    return not pid


def remove_stale_temps(folder: Path, pattern: str = ".*.tmp") -> list:
    """Remove the stale temporary files matching `pattern` in `folder` (call under its lock);
    the paths of those still being written (they count against a folder's budget)."""
    live = []
    for tmp in folder.glob(pattern):
        if stale_temp(tmp):
            tmp.unlink(missing_ok=True)
        else:
            live.append(tmp)
    return live


def set_aside(path: Path, inode: Optional[int], lock: Optional[Path] = None) -> Optional[Path]:
    """Rename a refused file to NAME.rejected (replacing an older one), so that no later run
    trips on it again and its owner can still look at it; only if `path` is still the file that
    was read (`inode`; None: any), never a newer one another process renamed there meanwhile.
    Under the folder's `lock` when given. Returns the new path, or None when it stayed (gone,
    replaced, or a read-only folder)."""
    aside = path.with_name(path.name + REJECTED_SUFFIX)
    try:
        with exclusive_lock(lock) if lock is not None else contextlib.nullcontext():
            if inode is not None and os.stat(path).st_ino != inode:
                return None
            os.replace(path, aside)
        return aside
    except OSError:
        return None


def refused_line(what: str, path: Path, why: str, aside: Optional[Path]) -> str:
    """The one warning for a refused file, the same for every reader.

    >>> refused_line("draft store", Path("/h/m.lsds"), "its header is corrupt", None)
    'localspec: draft store: ignoring /h/m.lsds: its header is corrupt.'
    """
    where = f"; moved it to {aside.name}" if aside is not None else ""
    return f"localspec: {what}: ignoring {path}: {why}{where}."


def warn(line: str) -> None:
    print(line, file=sys.stderr)
