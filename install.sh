#!/usr/bin/env bash
# Sets up localspec in ./.venv (or $LOCALSPEC_VENV): builds llama-cpp-python for this host
# (backend and flags from localspec/llama/buildflags.py: CUDA, Vulkan or Metal where the host has
# that GPU, else CPU; no AMX crash; the decision and its reason are printed) and localspec's
# batch-invariant copy of its ggml-cpu for --exact (patches/ applied to the same source;
# docs/exactness.md), caches both per flag set so a rerun takes seconds, then installs localspec
# with its HTTP server and test extras. pip's output goes to $VENV/install.log, never to stdout;
# a failure prints its tail.
# Usage: ./install.sh            Env: PYTHON, LOCALSPEC_VENV, LOCALSPEC_CMAKE_ARGS, CMAKE_ARGS,
#                                     LOCALSPEC_BACKEND=cpu|cuda|vulkan|metal (forces the backend;
#                                     LOCALSPEC_CUDA=0/1 still works), LOCALSPEC_CUDA_ARCH,
#                                     LOCALSPEC_HOME (cache),
#                                     LOCALSPEC_LLAMA_SRC (an unpacked llama-cpp-python source tree
#                                     to build instead of PyPI's sdist: scripts/gpu/gpu_run.sh),
#                                     LOCALSPEC_EXACT_LIBS=0 (no batch-invariant ggml-cpu for
#                                     --exact: ~2 min less)
set -euo pipefail
cd "$(dirname "$0")"
LLAMA_CPP_PYTHON=0.3.36          # keep in step with pyproject.toml
PY=${PYTHON:-python3}
VENV=${LOCALSPEC_VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" >&2
VPY="$VENV/bin/python"
LOG="$VENV/install.log"
: > "$LOG"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Run a step with its output in $LOG; on failure say which step, where the log is, and its tail.
quiet() {
  local what=$1; shift
  if ! "$@" >>"$LOG" 2>&1; then
    echo "install.sh: $what failed; full log: $LOG" >&2
    tail -n 30 "$LOG" | sed 's/^/  | /' >&2
    exit 1
  fi
}

ARGS=$("$VPY" localspec/llama/buildflags.py --explain)   # prints "backend: X (why)" on stderr
BACKEND=$("$VPY" localspec/llama/buildflags.py --backend)
# A GPU wheel is built from the sdist with the series' patches for that backend applied (the
# Vulkan row limit, patch 0009: off until --exact turns it on), so they are part of its key.
GPATCH=""
case $BACKEND in
  vulkan|cuda) GPATCH=$("$VPY" scripts/patch_series.py key --backend "$BACKEND");;
esac
KEY=$("$VPY" -c 'import hashlib,sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest()[:12])' \
      "$LLAMA_CPP_PYTHON $(uname -s) $(uname -m) $ARGS${GPATCH:+ patches:$GPATCH}")
HOME_DIR=${LOCALSPEC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}
WHEELS="$HOME_DIR/wheels/llama-cpp-python-$LLAMA_CPP_PYTHON-$KEY"

if [ "$(cat "$VENV/.llama-build-key" 2>/dev/null)" != "$KEY" ]; then
  mkdir -p "$(dirname "$WHEELS")"
  exec 9>"$WHEELS.lock"   # a second install.sh waits for the first one's build, then reuses it
  if command -v flock >/dev/null && ! flock -n 9; then
    echo "Waiting for another install.sh to finish building llama-cpp-python..." >&2
    flock 9
  fi
  if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    case $BACKEND in         # measured on 2-core machines (docs/build.md, docs/gpu.md)
      cuda) took="CUDA: 30-45 min on 2 cores for one GPU architecture";;
      vulkan) took="Vulkan: 9-12 min on 2 cores";;
      *) took="$BACKEND: 5-15 min on 2 cores";;
    esac
    echo "Building llama-cpp-python $LLAMA_CPP_PYTHON for $BACKEND ($took;" \
         "log: $LOG) with: $ARGS" >&2
    rm -rf "$WHEELS.tmp" && mkdir -p "$WHEELS.tmp"
    SOURCE=${LOCALSPEC_LLAMA_SRC:-llama-cpp-python==$LLAMA_CPP_PYTHON}
    if [ -n "$GPATCH" ]; then
      SOURCE="$WHEELS.tmp/source"
      LOCALSPEC_HOME="$HOME_DIR" quiet "applying the $BACKEND patches of the series" \
        "$VPY" scripts/patch_series.py apply "$SOURCE" --backend "$BACKEND" \
        ${LOCALSPEC_LLAMA_SRC:+--source "$LOCALSPEC_LLAMA_SRC"}
    fi
    CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2) \
      quiet "building llama-cpp-python" \
      "$VPY" -m pip wheel --no-deps --no-cache-dir -w "$WHEELS.tmp" "$SOURCE"
    rm -rf "$WHEELS.tmp/source"
    rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
  fi
  exec 9>&-
  quiet "installing the llama-cpp-python wheel" \
    "$VPY" -m pip install --no-deps --force-reinstall "$WHEELS"/llama_cpp_python-*.whl
  echo "$KEY" > "$VENV/.llama-build-key"
fi
# The batch-invariant libraries, llama_cpp/lib-exact: the wheel's own with a ggml-cpu built from
# the same sdist and flags plus localspec's patch series (patches/llama-cpp-python-VERSION/,
# applied by scripts/patch_series.py; docs/exactness.md, docs/build.md): every row of a verify
# batch then equals a one-token decode, bit for bit.
# Only ggml-cpu differs, so only it is compiled. --exact (LOCALSPEC_EXACT=1) loads it.
# LOCALSPEC_EXACT_LIBS=0 skips it (--exact then refuses). A patch
# that no longer applies stops the install with one line; a failed build warns and installs
# without it. Runs in a subshell (quiet exits it): exit 3 means a patch did not apply.
PATCHES=patches/llama-cpp-python-$LLAMA_CPP_PYTHON
PKEY=$(cat "$PATCHES"/series "$PATCHES"/*.patch |
  "$VPY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:12])')
INVARIANT="$WHEELS-invariant-$PKEY"
build_invariant_cpu_lib() {
  src=$(mktemp -d); trap 'rm -rf "$src"' EXIT   # a subshell's globals: the trap still sees src
  echo "Building localspec's batch-invariant ggml-cpu (~2 min on 2 cores)..." >&2
  command -v cmake >/dev/null || quiet "installing cmake" "$VPY" -m pip install cmake
  # the pinned sdist (downloaded once into $HOME_DIR/sdist, its sha256 checked) or a copy of
  # LOCALSPEC_LLAMA_SRC, with the series applied in order, without fuzz (docs/build.md)
  local rc=0
  LOCALSPEC_HOME="$HOME_DIR" "$VPY" scripts/patch_series.py apply "$src/tree" \
    ${LOCALSPEC_LLAMA_SRC:+--source "$LOCALSPEC_LLAMA_SRC"} >>"$LOG" 2>&1 || rc=$?
  if [ "$rc" = 3 ]; then
    echo "install.sh: error: $(tail -n 1 "$LOG" | sed 's/^patch_series.py: error: //');" \
         "or install with LOCALSPEC_EXACT_LIBS=0." >&2
    exit 3
  elif [ "$rc" != 0 ]; then
    echo "install.sh: applying the patch series failed; full log: $LOG" >&2
    tail -n 30 "$LOG" | sed 's/^/  | /' >&2
    exit 1
  fi
  # shellcheck disable=SC2086  # ARGS is a list of -D flags
  quiet "configuring the batch-invariant ggml-cpu" cmake -S "$src/tree" -B "$src/build" \
    -DCMAKE_BUILD_TYPE=Release -DLLAVA_BUILD=OFF $ARGS
  quiet "building the batch-invariant ggml-cpu" cmake --build "$src/build" --target ggml-cpu \
    -j "$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)"
  rm -rf "$INVARIANT.tmp" && mkdir -p "$INVARIANT.tmp"
  find "$src/build" -name 'libggml-cpu*' \( -type f -o -type l \) \
    -exec cp -a {} "$INVARIANT.tmp/" \;
  ls "$INVARIANT.tmp"/libggml-cpu* >/dev/null &&
    rm -rf "$INVARIANT" && mv "$INVARIANT.tmp" "$INVARIANT"
}
if [ "${LOCALSPEC_EXACT_LIBS:-1}" = 0 ]; then
  "$VPY" localspec/llama/libs.py remove
elif [ "$("$VPY" localspec/llama/libs.py key)" != "$KEY-$PKEY" ]; then
  exec 9>"$WHEELS.lock"
  if command -v flock >/dev/null && ! flock -n 9; then
    echo "Waiting for another install.sh to finish building the batch-invariant ggml-cpu..." >&2
    flock 9
  fi
  built=0
  ls "$INVARIANT"/libggml-cpu* >/dev/null 2>&1 ||
    (PATH="$(cd "$VENV" && pwd)/bin:$PATH" build_invariant_cpu_lib) || built=$?
  [ "$built" = 3 ] && exit 1
  if [ "$built" = 0 ]; then
    quiet "laying out llama_cpp/lib-exact" \
      "$VPY" localspec/llama/libs.py install "$INVARIANT" "$KEY-$PKEY"
  else
    echo "install.sh: warning: localspec's batch-invariant ggml-cpu did not build; --exact" \
         "refuses until ./install.sh builds it (default mode is installed)." >&2
  fi
  exec 9>&-
fi
echo "Installing localspec and its dependencies (log: $LOG)..." >&2
quiet "installing localspec" "$VPY" -m pip install -e ".[server,test]"
echo "localspec installed in $VENV; llama.cpp: $("$VPY" -c 'from localspec import llama
print(llama.system_info()); print(llama.library_account())' 2>&1 | tail -n 2 | tr '\n' ' ')" >&2
