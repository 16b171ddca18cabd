"""Owner-only modes for localspec's user data under $LOCALSPEC_HOME: prompt-cache entries and
saved sessions (a prompt's token ids are its documents), calibrations, the draft store, crash
reports. Files 0600, folders 0700. Model files are not private and keep the umask's modes.

A folder written to is made owner-only first, and what it already holds with it (files left by
an earlier localspec at 0644 in 0755 folders), said once per process. Owner bits are never
added: a folder the user made read-only (0500) stays read-only.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
_OTHERS = 0o077               # group and other permission bits
_said = False                 # the one line per process about fixed modes


def private_dir(path: Path) -> Path:
    """`path` as an owner-only folder: created 0700 (its missing parents too), or, when it exists
    open to others, closed with everything in it. Returns `path`. OSError when it cannot be
    created; a mode that cannot be changed (a folder of another user) is left as it is.

    Example: an old `prompt-cache/` at 0755 holding 0644 entries -> 0700 and 0600, one line."""
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return path
    if mode & _OTHERS:
        _close_tree(path)
        _say_once(path, mode)
    return path


def is_private(path: Path) -> bool:
    """Whether `path` (file or folder) is closed to group and others."""
    return not stat.S_IMODE(os.stat(path).st_mode) & _OTHERS


def _close_tree(top: Path) -> None:
    """Remove the group/other bits of `top` and of everything under it (symbolic links under it
    are not followed: they may point at a user's own files elsewhere)."""
    try:
        os.chmod(top, stat.S_IMODE(os.stat(top).st_mode) & ~_OTHERS)
    except OSError:
        return                    # not ours to change: leave what it holds alone too
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            _close(Path(root) / name)


def _close(path: Path) -> None:
    try:
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & _OTHERS:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~_OTHERS)
    except OSError:
        pass


def _say_once(path: Path, mode: int) -> None:
    global _said
    if not _said:
        _said = True
        print(f"localspec: {path} was readable by other users (mode {mode:o}); made it and "
              "the files in it owner-only (folders 0700, files 0600), as localspec keeps all "
              "its user data now.", file=sys.stderr)
