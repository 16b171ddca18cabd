#!/usr/bin/env bash
# Sets up localspec in ./.venv (or $LOCALSPEC_VENV): builds llama-cpp-python for this host
# (flags from localspec/buildflags.py: no AMX crash, llamafile on, CUDA/Metal when present), plus
# the llamafile-free copy of ggml-cpu that --exact loads (llama_cpp/lib-exact), caches both per
# flag set so a rerun takes seconds, then installs localspec with its test extras.
# Usage: ./install.sh            Env: PYTHON, LOCALSPEC_VENV, LOCALSPEC_CMAKE_ARGS, CMAKE_ARGS,
#                                     LOCALSPEC_CUDA=0/1, LOCALSPEC_HOME (cache location),
#                                     LOCALSPEC_EXACT_LIBS=0 (skip the --exact copy, ~1/8 of a build)
set -euo pipefail
cd "$(dirname "$0")"
LLAMA_CPP_PYTHON=0.3.36          # keep in step with pyproject.toml
PY=${PYTHON:-python3}
VENV=${LOCALSPEC_VENV:-.venv}
JOBS=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

ARGS=$("$VPY" localspec/buildflags.py --explain)
EXACT_ARGS=$("$VPY" localspec/buildflags.py --exact)
KEY=$("$VPY" -c 'import hashlib,sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest()[:12])' \
      "$LLAMA_CPP_PYTHON $(uname -s) $(uname -m) $ARGS")
HOME_DIR=${LOCALSPEC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}
WHEELS="$HOME_DIR/wheels/llama-cpp-python-$LLAMA_CPP_PYTHON-$KEY"
EXACT_CACHE="$WHEELS-exact"      # the llamafile-free libggml-cpu.* for this same flag set

SRC=""                           # the pinned sdist, fetched at most once per run
fetch_source() {
  if [ -z "$SRC" ]; then
    SRC=$(mktemp -d)
    trap 'rm -rf "$SRC"' EXIT
    "$VPY" -m pip download -q --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$LLAMA_CPP_PYTHON"
  fi
}

# Only ggml-cpu differs between the two builds (GGML_USE_LLAMAFILE is private to that target), so
# the same sdist is configured with the same flags plus GGML_LLAMAFILE=OFF and only ggml-cpu is
# compiled. Runs inside `if`, where set -e is off: every step checks itself.
build_exact_cpu_lib() {
  fetch_source || return 1
  tar -xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$SRC" || return 1
  if ! command -v cmake >/dev/null || ! { command -v make || command -v ninja; } >/dev/null; then
    "$VPY" -m pip install -q cmake ninja || return 1
  fi
  local gen=() log="$SRC/exact-build.log"
  command -v ninja >/dev/null && gen=(-G Ninja)
  echo "Building the llamafile-free ggml-cpu for --exact with: $EXACT_ARGS" >&2
  # shellcheck disable=SC2086  # EXACT_ARGS is a list of -D flags
  PATH="$PWD/$VENV/bin:$PATH" cmake -S "$(echo "$SRC"/llama_cpp_python-*/)" -B "$SRC/build" \
    "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAVA_BUILD=OFF $EXACT_ARGS >"$log" 2>&1 &&
  PATH="$PWD/$VENV/bin:$PATH" cmake --build "$SRC/build" --target ggml-cpu -j "$JOBS" >>"$log" 2>&1 ||
    { tail -20 "$log" >&2; return 1; }
  rm -rf "$EXACT_CACHE.tmp" && mkdir -p "$EXACT_CACHE.tmp" &&
  find "$SRC/build" \( -type f -o -type l \) \( -name 'libggml-cpu.so*' -o -name 'libggml-cpu*.dylib' \) \
    -exec cp -a {} "$EXACT_CACHE.tmp/" \; &&
  ls "$EXACT_CACHE.tmp"/libggml-cpu* >/dev/null 2>&1 &&
  rm -rf "$EXACT_CACHE" && mv "$EXACT_CACHE.tmp" "$EXACT_CACHE"
}

if [ "$(cat "$VENV/.llama-build-key" 2>/dev/null)" != "$KEY" ]; then
  if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "Building llama-cpp-python $LLAMA_CPP_PYTHON (takes ~5 min on 2 cores) with: $ARGS" >&2
    fetch_source
    mkdir -p "$WHEELS.tmp"
    CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
      "$VPY" -m pip wheel --no-deps --no-cache-dir -w "$WHEELS.tmp" "$SRC"/llama_cpp_python-*.tar.gz
    rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
  fi
  "$VPY" -m pip install -q --no-deps --force-reinstall "$WHEELS"/llama_cpp_python-*.whl
  echo "$KEY" > "$VENV/.llama-build-key"
fi

# llama_cpp/lib-exact: the wheel's libraries with the llamafile-free ggml-cpu in place of its own;
# localspec points llama-cpp-python at it (LLAMA_CPP_LIB_PATH) in processes that ask for --exact.
LIB=$("$VPY" -c 'import importlib.util as u, os; print(os.path.join(list(u.find_spec("llama_cpp").submodule_search_locations)[0], "lib"))')
if [ "$(cat "$LIB-exact/.localspec-key" 2>/dev/null)" != "$KEY" ]; then
  rm -rf "$LIB-exact"
  if [ "${LOCALSPEC_EXACT_LIBS:-1}" != 0 ]; then
    if ls "$EXACT_CACHE"/libggml-cpu* >/dev/null 2>&1 || build_exact_cpu_lib; then
      rm -rf "$LIB-exact.tmp" && cp -a "$LIB" "$LIB-exact.tmp" && cp -a "$EXACT_CACHE"/libggml-cpu* "$LIB-exact.tmp/" &&
        echo "$KEY" > "$LIB-exact.tmp/.localspec-key" && mv "$LIB-exact.tmp" "$LIB-exact"
    else
      echo "warning: the llamafile-free libraries did not build; --exact is unavailable until" \
           "./install.sh succeeds at it (default mode is unaffected)." >&2
    fi
  fi
fi
"$VPY" -m pip install -q -e ".[test]"
echo "localspec installed in $VENV (llama.cpp: $("$VPY" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode().strip())'))" >&2
if [ -d "$LIB-exact" ]; then
  echo "--exact libraries: $(LOCALSPEC_EXACT=1 "$VPY" -c 'from localspec import llama
llama.enable_exact_kernels(); print(llama.system_info())' 2>&1 | tail -1)" >&2
fi
