#!/usr/bin/env bash
# Sanitizer run of the C n-gram matcher and draft store (AddressSanitizer +
# UndefinedBehaviorSanitizer), in two stages: (1) csrc/ngram.c with its random-case driver
# csrc/tests/ngram_fuzz.c, checked against the driver's brute-force reference; (2) the cffi module
# built with the sanitizers and tests/test_ngram.py plus the C-index tests of tests/test_store.py
# (the two share csrc/table.h) run on it (libasan preloaded, so numpy's buffers get red zones too).
# Where valgrind is installed, the driver also runs under memcheck (uninitialised reads).
# Exits non-zero on any sanitizer or memcheck report, or failed case.
# usage: scripts/ci/ngram_sanitize.sh [n_cases=200000] [seed=1]       (CC, PYTHON override)
set -euo pipefail
cd "$(dirname "$0")/../.."
repo="$(pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
cc="${CC:-gcc}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
flags=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g)
export ASAN_OPTIONS="halt_on_error=1:log_path=$work/report"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$work/report"

reports() {  # reports land in files: pytest would swallow them on stderr
    if compgen -G "$work/report.*" >/dev/null; then
        cat "$work"/report.* >&2
        echo "ngram_sanitize: sanitizer report(s) above" >&2
        exit 1
    fi
}

echo "== 1/2: C driver" >&2
"$cc" -std=c99 -O1 "${flags[@]}" -Wall -Wextra -Icsrc csrc/ngram.c csrc/tests/ngram_fuzz.c \
    -o "$work/ngram_fuzz"
"$work/ngram_fuzz" "${1:-200000}" "${2:-1}" || { reports; exit 1; }
reports
if command -v valgrind >/dev/null; then   # uninitialised reads, which ASan does not see
    echo "== 1b: C driver under valgrind memcheck" >&2
    "$cc" -std=c99 -O1 -g -Icsrc csrc/ngram.c csrc/tests/ngram_fuzz.c -o "$work/ngram_fuzz_vg"
    valgrind -q --error-exitcode=1 "$work/ngram_fuzz_vg" 20000 "${2:-1}"
fi

echo "== 2/2: tests/test_ngram.py and the store's C-index tests on the sanitized cffi module" >&2
mkdir "$work/pkg"
cp -r localspec csrc "$work/pkg/"   # a copy: the build leaves objects next to the sources
rm -f "$work"/pkg/localspec/_ngram_c*.so "$work"/pkg/csrc/*.o
build="import sys; sys.path.insert(0, 'csrc'); import ngram_build as b
b.ffibuilder.compile(tmpdir='.')"
(cd "$work/pkg" && CFLAGS="${flags[*]}" LDFLAGS="${flags[*]}" "$python" -c "$build" \
    >"$work/build.log" 2>&1) || { cat "$work/build.log" >&2; exit 1; }
export LD_PRELOAD="$("$cc" -print-file-name=libasan.so):$("$cc" -print-file-name=libubsan.so)"
export ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0"   # CPython's own allocations are not leaks
cd "$work/pkg"   # first on sys.path: this localspec, with the sanitized module
"$python" -c "import localspec._ngram_c as c; assert c.__file__.startswith('$work'), c.__file__"
"$python" -m pytest -q -p no:cacheprovider --import-mode=append "$repo/tests/test_ngram.py" \
    || { reports; exit 1; }
"$python" -m pytest -q -p no:cacheprovider --import-mode=append "$repo/tests/test_store.py" \
    -k "c_index or evicts or budget_in_mb or starts_small or bad_handle" || { reports; exit 1; }
reports
echo "ngram_sanitize: no sanitizer reports" >&2
