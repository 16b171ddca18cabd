"""cffi (API mode) build of the C n-gram matcher, the draft store and the native guard:
csrc/ngram.c, csrc/store.c and csrc/native_guard.c -> localspec._ngram_c. One module for all:
they share the build flags and the packaging (setup.py's one cffi_modules entry, MANIFEST.in's
graft), and each keeps its own prefix (lsng_, lsst_, lsn_) and header. native_guard is what
llama.cpp's threads call instead of Python (its log sink, abort hook and fatal-signal guard)."""
import os

from cffi import FFI

_CSRC = os.path.relpath(os.path.dirname(os.path.abspath(__file__)))  # setuptools wants relative paths


def _declarations(header: str, marker: str) -> str:
    """The header's declaration-only block (between the CDEF markers) for cdef()."""
    with open(header, encoding="utf-8") as f:
        text = f.read()
    return text.split(f"/* {marker}_CDEF_BEGIN */")[1].split(f"/* {marker}_CDEF_END */")[0]


ffibuilder = FFI()
ffibuilder.cdef(_declarations(os.path.join(_CSRC, "ngram.h"), "LSNG"))
ffibuilder.cdef(_declarations(os.path.join(_CSRC, "store.h"), "LSST"))
ffibuilder.cdef(_declarations(os.path.join(_CSRC, "native_guard.h"), "LSN"))
ffibuilder.set_source("localspec._ngram_c",
                      '#include "ngram.h"\n#include "store.h"\n#include "native_guard.h"',
                      sources=[os.path.join(_CSRC, name)
                               for name in ("ngram.c", "store.c", "native_guard.c")],
                      include_dirs=[_CSRC], extra_compile_args=["-std=c99", "-O2"],
                      libraries=["pthread"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
