#!/usr/bin/env bash
# Sets up localspec in ./.venv (or $LOCALSPEC_VENV): builds llama-cpp-python for this host
# (backend and flags from localspec/llama/buildflags.py: CUDA, Vulkan or Metal where the host has
# that GPU, else CPU; no AMX crash; the decision and its reason are printed) and the copy of its
# libraries that --exact loads, caches both per flag set so a rerun takes seconds, then installs
# localspec with its HTTP server and test extras. pip's output goes to $VENV/install.log, never to
# stdout; a failure prints its tail.
# Usage: ./install.sh            Env: PYTHON, LOCALSPEC_VENV, LOCALSPEC_CMAKE_ARGS, CMAKE_ARGS,
#                                     LOCALSPEC_BACKEND=cpu|cuda|vulkan|metal (forces the backend;
#                                     LOCALSPEC_CUDA=0/1 still works), LOCALSPEC_CUDA_ARCH,
#                                     LOCALSPEC_HOME (cache),
#                                     LOCALSPEC_LLAMA_SRC (an unpacked llama-cpp-python source
#                                     tree to build instead of PyPI's sdist: scripts/gpu_run.sh),
#                                     LOCALSPEC_EXACT_LIBS=0 (no --exact libraries: ~2 min less)
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
KEY=$("$VPY" -c 'import hashlib,sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest()[:12])' \
      "$LLAMA_CPP_PYTHON $(uname -s) $(uname -m) $ARGS")
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
    echo "Building llama-cpp-python $LLAMA_CPP_PYTHON for $BACKEND (CPU: 10-15 min on 2 cores;" \
         "log: $LOG) with: $ARGS" >&2
    rm -rf "$WHEELS.tmp" && mkdir -p "$WHEELS.tmp"
    CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2) \
      quiet "building llama-cpp-python" \
      "$VPY" -m pip wheel --no-deps --no-cache-dir -w "$WHEELS.tmp" \
      "${LOCALSPEC_LLAMA_SRC:-llama-cpp-python==$LLAMA_CPP_PYTHON}"
    rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
  fi
  exec 9>&-
  quiet "installing the llama-cpp-python wheel" \
    "$VPY" -m pip install --no-deps --force-reinstall "$WHEELS"/llama_cpp_python-*.whl
  echo "$KEY" > "$VENV/.llama-build-key"
fi
# --exact's libraries, llama_cpp/lib-exact: the wheel's own with a ggml-cpu built without
# llamafile's tinyBLAS (docs/build.md). Only ggml-cpu differs (GGML_USE_LLAMAFILE is private to it),
# so only it is compiled, from the same sdist and flags. LOCALSPEC_EXACT_LIBS=0 skips it (--exact
# then refuses).
# Runs in a subshell: a failure (quiet exits) leaves default mode installed, with a warning.
build_exact_cpu_lib() {
  src=$(mktemp -d); trap 'rm -rf "$src"' EXIT   # a subshell's globals: the trap still sees src
  local args; args=$("$VPY" localspec/llama/buildflags.py --exact)
  echo "Building ggml-cpu without llamafile for --exact (~2 min on 2 cores) with: $args" >&2
  command -v cmake >/dev/null || quiet "installing cmake" "$VPY" -m pip install cmake
  local tree=${LOCALSPEC_LLAMA_SRC:-}            # the wheel's own source tree when one was given
  if [ -z "$tree" ]; then
    quiet "downloading the llama-cpp-python source" "$VPY" -m pip download --no-deps \
      --no-cache-dir -d "$src" "llama-cpp-python==$LLAMA_CPP_PYTHON"
    quiet "unpacking the llama-cpp-python source" \
      tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
    tree=$(echo "$src"/llama_cpp_python-*/)
  fi
  # shellcheck disable=SC2086  # args is a list of -D flags
  quiet "configuring ggml-cpu without llamafile" cmake -S "$tree" -B "$src/build" \
    -DCMAKE_BUILD_TYPE=Release -DLLAVA_BUILD=OFF $args
  quiet "building ggml-cpu without llamafile" cmake --build "$src/build" --target ggml-cpu \
    -j "$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)"
  rm -rf "$WHEELS-exact.tmp" && mkdir -p "$WHEELS-exact.tmp"
  find "$src/build" -name 'libggml-cpu*' \( -type f -o -type l \) \
    -exec cp -a {} "$WHEELS-exact.tmp/" \;
  ls "$WHEELS-exact.tmp"/libggml-cpu* >/dev/null &&
    rm -rf "$WHEELS-exact" && mv "$WHEELS-exact.tmp" "$WHEELS-exact"
}
if [ "${LOCALSPEC_EXACT_LIBS:-1}" = 0 ]; then
  "$VPY" localspec/llama/libs.py remove
elif [ "$("$VPY" localspec/llama/libs.py key)" != "$KEY" ]; then
  exec 9>"$WHEELS.lock"
  if command -v flock >/dev/null && ! flock -n 9; then
    echo "Waiting for another install.sh to finish building ggml-cpu for --exact..." >&2
    flock 9
  fi
  if ls "$WHEELS-exact"/libggml-cpu* >/dev/null 2>&1 ||
     (PATH="$(cd "$VENV" && pwd)/bin:$PATH" build_exact_cpu_lib); then
    quiet "laying out llama_cpp/lib-exact" "$VPY" localspec/llama/libs.py install "$WHEELS-exact" "$KEY"
  else
    echo "install.sh: warning: --exact is unavailable until ./install.sh builds its libraries;" \
         "default mode is installed." >&2
  fi
  exec 9>&-
fi
echo "Installing localspec and its dependencies (log: $LOG)..." >&2
quiet "installing localspec" "$VPY" -m pip install -e ".[server,test]"
echo "localspec installed in $VENV (llama.cpp: $("$VPY" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode().strip())'))" >&2
if [ -n "$("$VPY" localspec/llama/libs.py key)" ]; then
  echo "--exact loads: $(LOCALSPEC_EXACT=1 "$VPY" -c 'from localspec import llama
llama.enable_exact_kernels(); print(llama.system_info())' 2>&1 | tail -n 1)" >&2
fi
