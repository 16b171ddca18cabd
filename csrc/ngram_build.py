"""cffi (API mode) build of the C n-gram matcher: csrc/ngram.c -> localspec._ngram_c."""
import os

from cffi import FFI

_CSRC = os.path.relpath(os.path.dirname(os.path.abspath(__file__)))  # setuptools wants relative paths


def _declarations(header: str) -> str:
    """The header's declaration-only block (between the CDEF markers) for cdef()."""
    with open(header, encoding="utf-8") as f:
        text = f.read()
    return text.split("/* LSNG_CDEF_BEGIN */")[1].split("/* LSNG_CDEF_END */")[0]


ffibuilder = FFI()
ffibuilder.cdef(_declarations(os.path.join(_CSRC, "ngram.h")))
ffibuilder.set_source("localspec._ngram_c", '#include "ngram.h"',
                      sources=[os.path.join(_CSRC, "ngram.c")], include_dirs=[_CSRC],
                      extra_compile_args=["-std=c99", "-O2"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
