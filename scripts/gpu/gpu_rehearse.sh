#!/usr/bin/env bash
# Rehearses the offline GPU recipe on this machine's CPU, as the GPU machine would run it:
#   1. a copy of what a call sends (tracked + untracked-not-ignored files) in DIR/tree, and the
#      bundle (scripts/gpu/gpu_bundle.sh) made for it: .gpu and .gpu2
#   2. DIR/image: a venv of Python 3.12 (where this machine has one; else this Python, said on
#      stderr) holding exactly the image's packages the recipe uses (.gpu/image-packages.txt),
#      installed with no index from the bundle's download cache: the GPU machine's python3
#   3. the llama-cpp-python CPU wheel that ./install.sh cached here, seeded into the copy's
#      LOCALSPEC_HOME, so setup installs it instead of building (LOCALSPEC_BACKEND=cpu)
#   4. scripts/gpu/gpu_run.sh, twice, as the two calls: call 1 without .gpu2 (setup ... overhead;
#      bench waits for SmolLM2's second part), call 2 with it (bench); each into its own OUT
#      (DIR/out1, DIR/out2), pip with no index throughout, small sizes and one thread (a
#      shared 2-core machine slows two spinning threads most), REHEARSAL_BUDGET_S each
# Exit: 0 when both calls ran every step they could (tests: "skipped: no GPU"), 75 when the
# bundle could not reach a package index or no CPU wheel is cached (./install.sh first), else 1.
# Usage: scripts/gpu/gpu_rehearse.sh [DIR]
#        Env: PYTHON (the tools' Python, default .venv/bin/python),
#        REHEARSAL_PYTHON (the image's Python; default: python3.12 if found), REHEARSAL_BUDGET_S
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PYTHON:-$REPO/.venv/bin/python}
DIR=${1:-$(mktemp -d /tmp/gpu-rehearsal.XXXXXX)}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
HOME_DIR=${LOCALSPEC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}
say() { echo "gpu_rehearse: $*" >&2; }
t0=$(date +%s)

# The image's Python: 3.12 as on the GPU machine where this machine has it.
IPY=${REHEARSAL_PYTHON:-}
if [ -z "$IPY" ]; then
  for c in "$(command -v python3.12 || true)" \
           $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1) \
           "$(command -v uv >/dev/null && uv python find 3.12 2>/dev/null || true)"; do
    [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
      && { IPY=$c; break; }
  done
fi
if [ -z "$IPY" ]; then
  IPY=$("$PY" -c 'import sys; print(sys._base_executable)')
  say "no Python 3.12 here: rehearsing with $("$IPY" --version 2>&1) instead"
fi
PYV=$("$IPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
say "the image's Python: $IPY ($PYV)"

# The CPU wheel install.sh would look for with LOCALSPEC_BACKEND=cpu (its key, as install.sh
# makes it): without it setup would build llama.cpp, 15 minutes on 2 cores.
ARGS=$(LOCALSPEC_BACKEND=cpu "$PY" localspec/llama/buildflags.py --explain 2>/dev/null)
KEY=$("$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest()[:12])' \
      "$(sed -n 's/^LLAMA_CPP_PYTHON=\([^ ]*\).*/\1/p' install.sh) $(uname -s) $(uname -m) $ARGS")
WHEELDIRS=$(ls -d "$HOME_DIR"/wheels/llama-cpp-python-*-"$KEY"/ 2>/dev/null || true)
WHEELDIRS=$(for d in $WHEELDIRS; do ls "$d"/llama_cpp_python-*.whl >/dev/null 2>&1 && echo "$d"; done)
[ -n "$WHEELDIRS" ] || { say "no CPU llama-cpp-python wheel (key $KEY) cached in $HOME_DIR/wheels: run ./install.sh (LOCALSPEC_BACKEND=cpu)"; exit 75; }

# 1. What a call sends, and the bundle for it.
rm -rf "$DIR/tree" "$DIR/image" "$DIR/out1" "$DIR/out2"
mkdir -p "$DIR/tree" "$DIR/out1" "$DIR/out2"
git ls-files -co --exclude-standard -z | tar --null -T - --ignore-failed-read -cf - 2>/dev/null \
  | tar -xf - -C "$DIR/tree"
# No Qwen specs: a CPU cannot make a random 1.5B model in a rehearsal's minutes.
GPU_PY_VERSION=$PYV GPU_BUNDLE_OUT=$DIR/tree PYTHON=$PY LOCALSPEC_HOME=$HOME_DIR \
  GPU_BUNDLE_SPECS=smollm2-135m \
  bash scripts/gpu/gpu_bundle.sh 2> "$DIR/bundle.log"
rc=$?
tail -3 "$DIR/bundle.log" >&2
[ $rc = 0 ] || { say "gpu_bundle.sh failed (exit $rc; $DIR/bundle.log)"; exit $rc; }
say "bundle made ($(( $(date +%s) - t0 )) s)"

# 2. The image: its packages only, with no index.
"$IPY" -m venv "$DIR/image" || exit 1
grep -v '^pip==' "$DIR/tree/.gpu/image-packages.txt" > "$DIR/image-packages.txt"
if ! "$DIR/image/bin/python" -m pip install -q --no-compile --no-index \
     --find-links "$HOME_DIR/gpu-wheels/cp${PYV/./}" -r "$DIR/image-packages.txt" > "$DIR/image.log" 2>&1; then
  tail -20 "$DIR/image.log" >&2; say "the image's packages did not install"; exit 1
fi
say "image venv ready ($(( $(date +%s) - t0 )) s)"

# 3. The CPU wheel, where install.sh looks for it.
mkdir -p "$DIR/tree/.gpu-home/wheels"
for d in $WHEELDIRS; do ln -s "${d%/}" "$DIR/tree/.gpu-home/wheels/"; done

# 4. The two calls. Only the tree, its carried folders and the OUT folder; pip reaches no index.
mv "$DIR/tree/.gpu2" "$DIR/gpu2-later"
call() {
  local n=$1
  (cd "$DIR/tree" && env -u LOCALSPEC_HOME -u VIRTUAL_ENV OUT="$DIR/out$n" IMAGE_PYTHON="$DIR/image/bin/python" \
     LOCALSPEC_BACKEND=cpu PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null \
     RUN_BUDGET_S=${REHEARSAL_BUDGET_S:-420} DIAG_CASE_TIMEOUT=60 TOKENS=6 IDENTITY_PROMPTS=2 PARALLEL_TOKENS=8 \
     K_MAX=4 KS=0,2 OVERHEAD_TOKENS=4 THREADS=1 \
     BENCH_ARGS="--cases chat-haiku -n 8 --no-warmup --threads 1 --ctx 1024" BENCH_TIMEOUT=300 \
     LLAMACPP_ARGS="--cases edit-c2py-docstring -n 8 --no-warmup --threads 1 --ctx 1024" \
     LLAMACPP_TIMEOUT=300 \
     bash scripts/gpu/gpu_run.sh) > "$DIR/call$n.log" 2>&1
}
call 1; rc1=$?
say "call 1: exit $rc1 ($(( $(date +%s) - t0 )) s)"
mv "$DIR/gpu2-later" "$DIR/tree/.gpu2"
call 2; rc2=$?
say "call 2: exit $rc2 ($(( $(date +%s) - t0 )) s)"
cat "$DIR/tree/.gpu-state/run.log" >&2
grep -q "all steps done" "$DIR/out2/run.log" || { say "not every step finished"; exit 1; }
say "done in $(( $(date +%s) - t0 )) s; results: $DIR/out1, $DIR/out2"
