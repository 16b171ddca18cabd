"""Which llama.cpp shared libraries this process loads: the default build (llamafile's tinyBLAS on,
fastest prefill) or the llamafile-free copy that ./install.sh lays beside it for `--exact`.

llama-cpp-python loads its libraries once, at `import llama_cpp`, from LLAMA_CPP_LIB_PATH if set;
so the choice is made once per process, before that import (localspec/llama.py asks here first).
Standard library only, and never imports llama_cpp itself.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional

EXACT_DIR = "lib-exact"          # beside llama_cpp/lib in the installed package
TRUE_WORDS = ("1", "true", "t", "yes", "y", "on")   # what click accepts for LOCALSPEC_EXACT


def exact_requested(environ=os.environ) -> bool:
    """LOCALSPEC_EXACT=1 asks for exact mode for the whole process (the CLI's --exact env var)."""
    return environ.get("LOCALSPEC_EXACT", "").strip().lower() in TRUE_WORDS


def package_lib_dir() -> Optional[Path]:
    """llama_cpp's own library folder, found without importing (and so loading) it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def exact_lib_dir(environ=os.environ) -> Optional[Path]:
    """The llamafile-free library folder: LOCALSPEC_EXACT_LIB, else llama_cpp/lib-exact; None when
    it holds no llama library (install.sh was not run, or skipped it)."""
    given = environ.get("LOCALSPEC_EXACT_LIB")
    if given:
        folder = Path(given)
    else:
        lib = package_lib_dir()
        if lib is None:
            return None
        folder = lib.parent / EXACT_DIR
    has_llama = folder.is_dir() and any(p.name.startswith(("libllama.", "llama.")) for p in folder.iterdir())
    return folder if has_llama else None


def choose(exact: bool, environ=os.environ) -> str:
    """Point llama-cpp-python at the libraries for this process; returns a one-line account.

    A LLAMA_CPP_LIB_PATH the user set is never overridden."""
    if environ.get("LLAMA_CPP_LIB_PATH"):
        return f"LLAMA_CPP_LIB_PATH given: {environ['LLAMA_CPP_LIB_PATH']}"
    if not exact:
        return "default libraries"
    folder = exact_lib_dir(environ)
    if folder is None:
        return "no llamafile-free libraries installed: default libraries"
    environ["LLAMA_CPP_LIB_PATH"] = str(folder)
    return f"exact mode: llamafile-free libraries from {folder}"
