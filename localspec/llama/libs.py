"""Which llama.cpp shared libraries this process loads: llama-cpp-python's own build, or the copy
./install.sh lays beside it (llama_cpp/lib-exact) whose ggml-cpu carries localspec's patches
(patches/, docs/exactness.md): batches of up to 31 rows compute every row as a one-token decode
does, so speculative output is plain output bit for bit. Processes load it by default
(INVARIANT_BY_DEFAULT: with its F16 attention tiles it costs nothing measurable against llama.cpp's own,
docs/exactness.md) and fall back to llama.cpp's own, with the near-tie guard, where install.sh
did not build it; LOCALSPEC_EXACT=0 chooses llama.cpp's own, and LOCALSPEC_EXACT=1 (`--exact`)
insists on the patched copy (one error line without it).

llama-cpp-python loads its libraries once, at `import llama_cpp`, from LLAMA_CPP_LIB_PATH if set;
so the choice is made once per process, before that import (llama/backend.py asks here first).
Standard library only and never imports llama_cpp, so install.sh runs it as a script to lay out
the copy: `python localspec/llama/libs.py install CPU_LIB_DIR KEY | key | remove`.
LOCALSPEC_EXACT_LIB names another batch-invariant library folder (a build of your own).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

EXACT_DIR = "lib-exact"          # beside llama_cpp/lib in the installed package
KEY_FILE = ".localspec-key"      # the build key (install.sh's flag-set hash) it was made for
CPU_LIB = "libggml-cpu"          # the one library that differs: the patches touch only ggml-cpu
TRUE_WORDS = ("1", "true", "t", "yes", "y", "on")   # what click accepts for LOCALSPEC_EXACT
FALSE_WORDS = ("0", "false", "f", "no", "n", "off")
INVARIANT_BY_DEFAULT = True      # code edits level with llama.cpp's own (docs/exactness.md)
# A wheel built with one of these backends runs, by default, exactly the libraries it ships: the
# patched ggml-cpu is a second build that no GPU run has proven beside a GPU backend, its rows are
# not what GPU layers compute, and a GPU user's first load must be the one llama-cpp-python runs.
GPU_BACKEND_LIBS = ("libggml-cuda", "libggml-vulkan", "libggml-metal", "libggml-hip",
                    "libggml-sycl", "libggml-musa", "libggml-opencl")


def exact_requested(environ=os.environ) -> Optional[bool]:
    """LOCALSPEC_EXACT (the CLI's --exact env var): True asks for the batch-invariant libraries,
    False for llama.cpp's own, None (unset) takes INVARIANT_BY_DEFAULT."""
    word = environ.get("LOCALSPEC_EXACT", "").strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


def package_lib_dir() -> Optional[Path]:
    """llama_cpp's own library folder, found without importing (and so loading) it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def cpu_lib_stamp(environ=os.environ) -> str:
    """Which ggml-cpu this process loads (the folder choose() pointed it at, else the package's):
    its file name, size and modification time, so that what was measured with one build (the
    verify cost curve) is not believed of another: a patch changes a kernel, not the feature line."""
    folder = Path(environ["LLAMA_CPP_LIB_PATH"]) if environ.get("LLAMA_CPP_LIB_PATH") \
        else package_lib_dir()
    lib = _lib_file(folder, "ggml-cpu") if folder is not None else None
    if lib is None:
        return ""
    st = lib.stat()
    return f"{lib.name}:{st.st_size}:{int(st.st_mtime)}"


def _lib_file(folder: Path, name: str) -> Optional[Path]:
    """The library `name` in `folder` (libNAME.so.x.y.z, NAME.dll...: the file, not a link)."""
    return next((p for p in sorted(folder.iterdir()) if p.name.startswith((f"lib{name}.", f"{name}."))
                 and not p.is_symlink()), None) if folder.is_dir() else None


def exact_lib_status(environ=os.environ) -> tuple:
    """(folder, problem): the batch-invariant library folder (LOCALSPEC_EXACT_LIB, else
    llama_cpp/lib-exact) and "" when it is usable, else why not. A copy left from an earlier
    llama-cpp-python install is not usable: its libllama must be the installed one's twin."""
    given = environ.get("LOCALSPEC_EXACT_LIB")
    if given:
        return Path(given), ("" if _lib_file(Path(given), "llama") else f"{given} holds no libllama")
    lib = package_lib_dir()
    if lib is None:
        return None, "llama-cpp-python is not installed"
    folder = lib.parent / EXACT_DIR
    mine, theirs = _lib_file(folder, "llama"), _lib_file(lib, "llama")
    if mine is None:
        return folder, f"{folder} is missing"
    if theirs is None or mine.name != theirs.name or _stamp(mine) != _stamp(theirs):
        return folder, f"{folder} is left from another llama-cpp-python install"
    return folder, ""


def _stamp(path: Path) -> tuple:
    st = path.stat()
    return st.st_size, int(st.st_mtime)


def gpu_backend(lib: Optional[Path]) -> str:
    """The GPU backend library llama-cpp-python's `lib` folder holds ("" for a CPU build).

    Example: a folder with libggml-cuda.so -> "libggml-cuda"."""
    if lib is None or not lib.is_dir():
        return ""
    names = [p.name for p in lib.iterdir()]
    return next((b for b in GPU_BACKEND_LIBS if any(n.startswith(b + ".") for n in names)), "")


def choose(exact: Optional[bool], environ=os.environ) -> str:
    """Point llama-cpp-python at the libraries for this process; returns which ones, as a phrase.
    exact None takes INVARIANT_BY_DEFAULT, except on a GPU build (GPU_BACKEND_LIBS), which loads
    the libraries its wheel ships unless --exact asks. Without a usable copy it loads llama.cpp's
    own libraries and the account says why; llama.enable_exact_kernels() then refuses them
    (--exact), while default mode runs on them with the near-tie guard. A LLAMA_CPP_LIB_PATH
    the user set is never overridden."""
    if environ.get("LLAMA_CPP_LIB_PATH"):
        return f"the libraries in LLAMA_CPP_LIB_PATH={environ['LLAMA_CPP_LIB_PATH']}"
    if exact is None and not environ.get("LOCALSPEC_EXACT_LIB"):
        backend = gpu_backend(package_lib_dir())
        if backend:
            return (f"llama.cpp's own libraries (a GPU build, {backend}: the batch-invariant "
                    "CPU library is opt-in there, --exact)")
    if not (INVARIANT_BY_DEFAULT if exact is None else exact):
        return "llama.cpp's own libraries"
    folder, problem = exact_lib_status(environ)
    if problem:
        return f"llama.cpp's own libraries ({problem})"
    environ["LLAMA_CPP_LIB_PATH"] = str(folder)
    return f"the batch-invariant libraries in {folder}"


# ---------------------------------------------------------------------------------------------
# Laying out the copy (install.sh)


def install_exact(lib: Path, cpu_dir: Path, key: str) -> Path:
    """Make lib-exact beside `lib`: every library of `lib` hard-linked (no disk cost, and the
    twin check in exact_lib_status holds), except ggml-cpu, copied from `cpu_dir`. Built in a
    temporary folder and renamed, so a half-made copy is never taken for a usable one."""
    cpu_files = sorted(p for p in cpu_dir.iterdir() if p.name.startswith(CPU_LIB))
    if not cpu_files:
        raise SystemExit(f"error: no {CPU_LIB} library in {cpu_dir}")
    final, tmp = lib.parent / EXACT_DIR, lib.parent / (EXACT_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for src in sorted(lib.iterdir()):
        if src.name.startswith(CPU_LIB):
            continue
        _link_or_copy(src, tmp / src.name)
    for src in cpu_files:
        _link_or_copy(src, tmp / src.name, link=False)
    (tmp / KEY_FILE).write_text(key + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def _link_or_copy(src: Path, dst: Path, link: bool = True) -> None:
    if src.is_symlink():                       # libfoo.so -> libfoo.so.0: same relative link
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True)
    else:
        try:
            if not link:
                raise OSError
            os.link(src, dst)
        except OSError:                        # another filesystem, or a copy was asked for
            shutil.copy2(src, dst)


def installed_key() -> str:
    lib = package_lib_dir()
    try:
        return (lib.parent / EXACT_DIR / KEY_FILE).read_text().strip() if lib else ""
    except OSError:
        return ""


def remove_exact() -> None:
    lib = package_lib_dir()
    if lib is not None:
        shutil.rmtree(lib.parent / EXACT_DIR, ignore_errors=True)


def main(argv: list) -> int:
    if argv[:1] == ["install"] and len(argv) == 3:
        print(install_exact(package_lib_dir(), Path(argv[1]), argv[2]))
    elif argv == ["key"]:
        print(installed_key())
    elif argv == ["remove"]:
        remove_exact()
    else:
        print("usage: libs.py install CPU_LIB_DIR KEY | key | remove", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
