"""Where localspec keeps its files, the cheap check that a file is a GGUF model at all, and
the numbers read from the environment. The file plumbing every writer and reader shares lives
beside it: private.py (owner-only modes), atomic.py (the folder lock, atomic writes, stale
temporary files, refused files set aside), jsonsafe.py (JSON headers parsed without surprises),
container.py (the checksummed token file of the prompt cache and the draft store).

The bottom layer, used by the llama door, the cache, calibration, the store and the catalog.
"""

from __future__ import annotations

import datetime
import errno
import os
import tempfile
import traceback
from pathlib import Path
from typing import Optional

from ..errors import LocalspecError
from .private import PRIVATE_FILE, private_dir

GGUF_MAGIC = b"GGUF"


def env_number(name: str, default: float, unit: str, meaning: str, zero_ok: bool = False) -> float:
    """A number (of `unit`: seconds, MB) from the environment variable `name` (unset or blank:
    `default`); anything else than a finite number (> 0, or >= 0 with zero_ok) is one error line
    that says what the setting means."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 <= value if zero_ok else 0 < value) or not value < 1e6:    # NaN fails too
        raise LocalspecError(f"{name}={raw!r} is not a number of {unit} "
                             f"{'>= 0' if zero_ok else 'above 0'} ({meaning}).")
    return value


def localspec_home() -> Path:
    """`$LOCALSPEC_HOME`, else `$XDG_CACHE_HOME/localspec`, else `~/.cache/localspec`."""
    if os.environ.get("LOCALSPEC_HOME"):
        return Path(os.environ["LOCALSPEC_HOME"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "localspec"
    return Path.home() / ".cache" / "localspec"


def cache_dir(*parts: str) -> Path:
    """`localspec_home()/parts...`, created if needed (owner-only: private.py); a home that
    cannot hold directories (a regular file, no permission) is a one-line error naming the
    variable that set it."""
    home = localspec_home()
    path = home.joinpath(*parts)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        source = "LOCALSPEC_HOME" if os.environ.get("LOCALSPEC_HOME") else \
            "XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "the default cache path"
        raise LocalspecError(f"cannot use {home} as localspec's cache directory ({source}): "
                             f"{e.strerror or e}; point LOCALSPEC_HOME at a writable "
                             "directory.") from None
    return path


def write_crash_report(exc: BaseException) -> Path:
    """Write the traceback of an unexpected exception to a file and return its path: under the
    cache directory if it is usable, else the system's temporary directory."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for folder in (lambda: private_dir(cache_dir("crashes")), lambda: Path(tempfile.gettempdir())):
        try:
            path = folder() / f"localspec-crash-{stamp}-{os.getpid()}.txt"
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE),
                      "w") as f:          # a traceback may quote a prompt
                f.write(text)
            return path
        except (OSError, LocalspecError):
            continue
    raise exc


# What the system answers when the machine, not localspec, is in the way: a full disk or quota, a
# file too large, a read-only or failing disk, no permission, a folder where a file should be.
_SYSTEM_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES,
                  errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EMFILE, errno.ENFILE}


def system_error_line(exc: OSError) -> Optional[str]:
    """The one line for an OSError that the machine caused (disk full, no permission...), or
    None when it looks like a bug. Example: "No space left on device (writing
    /home/u/.cache/localspec/x): free some space or point LOCALSPEC_HOME elsewhere"."""
    if exc.errno not in _SYSTEM_ERRNOS:
        return None
    where = f" ({exc.filename})" if exc.filename else ""
    hint = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
            errno.EFBIG: "the file system refuses a file this large"}.get(
        exc.errno, "check the path and its permissions")
    return f"{exc.strerror or exc}{where}: {hint}, or point LOCALSPEC_HOME elsewhere."


def internal_error_line(exc: BaseException) -> str:
    """The one line a user sees for a bug: what broke and where the full traceback is."""
    where = write_crash_report(exc)
    return (f"internal error ({type(exc).__name__}: {exc}); this is a bug in localspec. "
            f"The full traceback is in {where}; please include it in a report.")


def check_gguf_magic(path: Path) -> None:
    """Raise LocalspecError unless `path` starts with the 4 bytes `GGUF`."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise LocalspecError(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); "
            "pass a .gguf model file or a catalog name."
        )
