"""Where localspec keeps its files, and the cheap check that a file is a GGUF model at all.

Standard library only: the bottom layer, used by the llama door, calibration and the catalog alike.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import LocalspecError

GGUF_MAGIC = b"GGUF"


def localspec_home() -> Path:
    """`$LOCALSPEC_HOME`, else `$XDG_CACHE_HOME/localspec`, else `~/.cache/localspec`."""
    if os.environ.get("LOCALSPEC_HOME"):
        return Path(os.environ["LOCALSPEC_HOME"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "localspec"
    return Path.home() / ".cache" / "localspec"


def check_gguf_magic(path: Path) -> None:
    """Raise LocalspecError unless `path` starts with the 4 bytes `GGUF`."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise LocalspecError(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); "
            "pass a .gguf model file or a catalog name."
        )
