#!/usr/bin/env bash
# The series' CUDA patches compile, without a GPU: the pinned sdist with the patches that touch
# only ggml-cuda applied (scripts/patch_series.py apply --backend cuda), then every .cu file they
# touch compiled by nvcc for each architecture asked (compile only, no link; a header a patch
# touches is compiled through the .cu files that include it). What it cannot say: that the rows
# are exact; that takes a GPU (scripts/gpu/gpu_run.sh, its exact step; docs/gpu.md).
#
#   bash scripts/ci/cuda_compile.sh            # sm_75 (Turing's mmvq table) and sm_80 (Ampere on)
#   CUDA_ARCHS="80 90" bash scripts/ci/cuda_compile.sh
#
# Needs nvcc (CUDA 12 or 13) and, once, PyPI: cuBLAS's headers come from NVIDIA's nvidia-cublas
# wheel (the headers alone are kept, in $LOCALSPEC_HOME/cuda-headers/). ~40 s an architecture on
# 2 cores. Exit 0 compiled, 1 a file did not compile (its errors on stderr), 75 nothing to check
# with here (no nvcc, no headers to be had): CI says so and goes on.
set -euo pipefail
cd "$(dirname "$0")/../.."
HOME_DIR=${LOCALSPEC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
ARCHS=${CUDA_ARCHS:-75 80}
say() { echo "cuda_compile: $*" >&2; }

NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
[ -n "$NVCC" ] || { say "skipped: no nvcc on this machine"; exit 75; }
CUDA_MAJOR=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
case $CUDA_MAJOR in
  12) WHEEL="nvidia-cublas-cu12>=12,<13";;
  13) WHEEL="nvidia-cublas>=13,<14";;
  *) say "skipped: nvcc $CUDA_MAJOR (this script knows CUDA 12 and 13)"; exit 75;;
esac
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")

# cuBLAS's headers: the toolkit's own where it has them, else the wheel's, kept once
INC=""
if [ ! -f "$CUDA_ROOT/include/cublas_v2.h" ]; then
  INC="$HOME_DIR/cuda-headers/cublas-cu$CUDA_MAJOR"
  if [ ! -f "$INC/cublas_v2.h" ]; then
    say "fetching cuBLAS's headers ($WHEEL, from PyPI; kept in $INC)"
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    "$PY" -m pip download -q --no-deps -d "$tmp" "$WHEEL" >&2 ||
      { say "skipped: could not download $WHEEL (no package index?)"; exit 75; }
    mkdir -p "$INC.tmp"
    "$PY" - "$tmp" "$INC.tmp" <<'EOF'
import glob, os, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(os.path.join(sys.argv[1], "*.whl"))[0])
for name in wheel.namelist():
    if "/include/" in name and name.endswith(".h"):
        with open(os.path.join(sys.argv[2], os.path.basename(name)), "wb") as out:
            out.write(wheel.read(name))
EOF
    rm -rf "$INC" && mv "$INC.tmp" "$INC"
  fi
fi

# the patched source, made once per series key
KEY=$("$PY" scripts/patch_series.py key --backend cuda)
[ -n "$KEY" ] || { say "skipped: the series has no CUDA patch"; exit 75; }
SRC="$HOME_DIR/cuda-compile/$KEY"
if [ ! -d "$SRC/tree" ]; then
  rm -rf "$SRC" && mkdir -p "$SRC"
  LOCALSPEC_HOME="$HOME_DIR" "$PY" scripts/patch_series.py apply "$SRC/tree.tmp" --backend cuda >&2
  mv "$SRC/tree.tmp" "$SRC/tree"
fi
GG="$SRC/tree/vendor/llama.cpp/ggml"
mapfile -t FILES < <(cat patches/llama-cpp-python-*/0*.patch |
  sed -n 's|^+++ b/vendor/llama.cpp/ggml/src/ggml-cuda/\(.*\.cu\)$|\1|p' | sort -u)
[ ${#FILES[@]} -gt 0 ] || { say "skipped: the CUDA patches touch no .cu file"; exit 75; }

# compiled with ggml-cuda's CMakeLists flags: fast math, extended lambdas, CUDA graphs on
JOBS=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
OBJ="$SRC/obj" && mkdir -p "$OBJ"
export NVCC GG OBJ INC
compile_one() {     # compile_one ARCH FILE: its object, log and seconds in $OBJ
  local arch=$1 f=$2 t rc=0 base
  base="$OBJ/${2%.cu}.sm_$1"
  t=$(date +%s)
  "$NVCC" -c -std=c++17 -O3 -use_fast_math -extended-lambda -DGGML_CUDA_USE_GRAPHS \
    -DGGML_USE_CUDA -DGGML_SCHED_MAX_COPIES=4 -I"$GG/include" -I"$GG/src" -I"$GG/src/ggml-cuda" \
    ${INC:+-I"$INC"} -arch="sm_$arch" "$GG/src/ggml-cuda/$f" -o "$base.o" > "$base.log" 2>&1 || rc=$?
  echo "$rc $(( $(date +%s) - t ))" > "$base.status"
}
export -f compile_one
start=$(date +%s)
rm -f "$OBJ"/*.status
for arch in $ARCHS; do for f in "${FILES[@]}"; do echo "$arch $f"; done; done |
  xargs -P "$JOBS" -L 1 bash -c 'compile_one "$@"' _
failed=0
for arch in $ARCHS; do
  for f in "${FILES[@]}"; do
    base="$OBJ/${f%.cu}.sm_$arch"
    read -r rc secs < "$base.status"
    if [ "$rc" = 0 ]; then
      say "ok: $f for sm_$arch ($secs s)"
    else
      say "FAILED: $f for sm_$arch; nvcc said:"; sed 's/^/  | /' "$base.log" | head -40 >&2
      failed=1
    fi
  done
done
[ $failed = 0 ] || exit 1
say "the series' CUDA patches compile: ${FILES[*]} for sm_${ARCHS// /, sm_}" \
    "(nvcc $CUDA_MAJOR, $(( $(date +%s) - start )) s wall)"
