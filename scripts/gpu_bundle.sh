#!/usr/bin/env bash
# Packs what a run on a lent GPU machine needs into the ignored folders .gpu/ and .gpu2/, within
# the device's 64 MiB per call (working tree included). The machine reaches no network, so:
#   .gpu/whl/    llama-cpp-python's sdist, TRIMMED (vendored llama.cpp without models, docs, tests,
#                examples, web UI, and ggml backends other than CPU, CUDA and RPC), plus Python 3.12
#                wheels of what `pip install -e .[server,test]` needs that the image lacks (its
#                package list: /work/.library/device/KINDS.md), and of scikit-build-core (the
#                image's version is unknown; the build needs >= 0.9.2)
#   .gpu/specs/  random_gguf.py specs (metadata only, xz) of the cached catalog models
#   .gpu/smollm2.part1, .gpu2/smollm2.part2   the real SmolLM2-135M in two halves: the first call
#                carries .gpu, the second .gpu2 (a path not named in `carry` stays on the machine)
# Usage: scripts/gpu_bundle.sh          Env: PYTHON (default .venv/bin/python), LOCALSPEC_HOME
# Then see docs/gpu-lent-machine.md for the device calls.
set -euo pipefail
cd "$(dirname "$0")/.."
V=0.3.36                                   # keep in step with install.sh
PY=${PYTHON:-.venv/bin/python}
HOME_DIR=${LOCALSPEC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}
G=.gpu
export PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$G/whl" "$G/specs" .gpu2

# 1. The sdist, once (77 MB), then trimmed to what a CPU + CUDA + RPC build compiles. Never
# `--no-binary :all:`: that builds the sdist's build tools (cmake) from source too, 20+ minutes.
SD="$HOME_DIR/sdist"
if [ ! -f "$SD/llama_cpp_python-$V.tar.gz" ]; then
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$SD" "llama-cpp-python==$V"
fi
# A trim from before the RPC backend was built (GGML_RPC=ON) lacks ggml-rpc: make it again.
if [ -f "$G/whl/llama_cpp_python-$V.tar.gz" ] && \
   ! tar tzf "$G/whl/llama_cpp_python-$V.tar.gz" | grep -q "ggml/src/ggml-rpc/"; then
  rm "$G/whl/llama_cpp_python-$V.tar.gz"
fi
if [ ! -f "$G/whl/llama_cpp_python-$V.tar.gz" ]; then
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
  tar xzf "$SD/llama_cpp_python-$V.tar.gz" -C "$TMP"
  R="$TMP/llama_cpp_python-$V"
  L="$R/vendor/llama.cpp"
  rm -rf "$R"/{.git,.github,docker,docs,examples,tests} "$L/.git"   # .git: a 37 MB pack
  rm -rf "$L"/{.devops,.github,.gemini,.pi,app,benches,ci,conversion,docs,examples,gguf-py} \
         "$L"/{grammars,media,models,pocs,requirements,scripts,skills,tests} "$L"/convert_*.py
  # Tools: only mtmd, which llama-cpp-python builds (LLAVA_BUILD); not its tests and sample media.
  find "$L/tools" -mindepth 1 -maxdepth 1 ! -name mtmd -exec rm -rf {} +
  rm -rf "$L/tools/mtmd"/{tests,legacy-models,test-1.jpeg,test-2.mp3,test-3.mp4}
  # ggml backends: ggml_add_backend() adds a backend's folder only when its GGML_<NAME> option is
  # on, so the others can go (their public headers stay: ggml installs them all). RPC stays:
  # buildflags.py turns it on everywhere (--rpc, localspec rpc-server).
  for b in blas cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu \
           zdnn zendnn; do
    rm -rf "$L/ggml/src/ggml-$b"
  done
  tar czf "$G/whl/llama_cpp_python-$V.tar.gz" -C "$TMP" "llama_cpp_python-$V"
fi

# 2. Wheels for the device's Python (3.12, manylinux x86_64), one version of each: localspec's
# and llama-cpp-python's (cffi, pycparser, diskcache), the test extra's gguf and openai (with
# pydantic, pydantic-core, annotated-types, typing-inspection, distro, jiter, sniffio, httpx2,
# httpcore2, truststore), the server extra (starlette, uvicorn). anyio, typing-extensions, h11
# and idna are in the image but travel too (small), since openai and pydantic want recent ones
# and the image's versions are unknown. The image has the rest (numpy, click, jinja2, pytest,
# scipy, hypothesis, httpx, tqdm).
pyver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
for pkg in cffi pycparser diskcache gguf scikit-build-core starlette uvicorn openai pydantic \
           pydantic-core annotated-types typing-inspection distro jiter sniffio httpx2 httpcore2 \
           truststore anyio typing-extensions h11 idna; do
  ls "$G/whl/${pkg//-/_}-"*.whl >/dev/null 2>&1 && continue
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$G/whl" \
    "$pkg$(v=$(pyver $pkg 2>/dev/null) && echo "==$v")"     # the version tested here, else the latest
done

# 3. Specs of the cached catalog models (a missing one is skipped: pull it first to include it).
spec() {   # catalog file name, spec name; xz: the vocabularies shrink 4x (5.7 -> 1.3 MB)
  local src="$HOME_DIR/models/$1" out="$G/specs/$2.spec.gguf"
  if [ ! -f "$src" ]; then echo "skip $2: $src not cached (localspec models pull)" >&2; return; fi
  [ -f "$out.xz" ] && return
  [ -f "$out" ] || "$PY" scripts/random_gguf.py spec "$src" -o "$out"
  xz -9 "$out"
}
spec qwen2.5-coder-1.5b-instruct-q4_k_m.gguf qwen2.5-coder-1.5b
spec qwen2.5-coder-0.5b-instruct-q4_k_m.gguf qwen2.5-coder-0.5b
spec smollm2-135m-instruct-q4_1.gguf smollm2-135m

# 4. The real SmolLM2-135M (98 MB) in two halves, with its sha256 to check the join.
S="$HOME_DIR/models/smollm2-135m-instruct-q4_1.gguf"
if [ -f "$S" ] && [ ! -f .gpu2/smollm2.part2 ]; then
  half=$(( ($(stat -c %s "$S") + 1) / 2 ))
  head -c "$half" "$S" > "$G/smollm2.part1"
  tail -c +$((half + 1)) "$S" > .gpu2/smollm2.part2
  sha256sum "$S" | cut -d' ' -f1 > "$G/smollm2.sha256"
fi

# Sizes: what each call sends is the working tree (tracked + untracked-not-ignored) + its carry.
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
mib() { awk "BEGIN { printf \"%.1f\", $1 / 1048576 }"; }
g1=$(du -sb "$G" | cut -f1); g2=$(du -sb .gpu2 | cut -f1)
du -ab "$G" .gpu2 | sort -k2 >&2
echo "working tree $(mib "$tree") MiB; call 1 (carry .gpu) $(mib $((tree + g1))) MiB;" \
     "call 2 (carry .gpu2) $(mib $((tree + g2))) MiB; limit 64 MiB per call" >&2
if [ $((tree + g1)) -gt $((64 * 1048576)) ] || [ $((tree + g2)) -gt $((64 * 1048576)) ]; then
  echo "error: over the 64 MiB limit" >&2
  exit 1
fi
