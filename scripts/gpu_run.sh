#!/usr/bin/env bash
# Runs on a lent GPU machine (no network) what scripts/gpu_bundle.sh packed; results go to $OUT.
#   scripts/gpu_run.sh setup     venv over the image's packages, ./install.sh offline (CUDA build of
#                                the trimmed sdist, resumable), localspec's C extension
#   scripts/gpu_run.sh test      the device tests (pytest -m device), models offloaded
#   scripts/gpu_run.sh measure   random-weight models of the real shapes, r(k) to k=32, identity on
#                                20 prompts, draft cost, per-step overhead (engine vs prototype)
# Phases can be chained: `scripts/gpu_run.sh setup test`. Everything stays in ignored folders
# (.venv, .gpu-src, .gpu-build, .gpu-home, .gpu-models), so a later call on the still-warm
# machine reuses it, and `setup` after a timeout resumes the build.
# On a CPU machine LOCALSPEC_BACKEND=cpu runs the same lines without CUDA (how this script was tested).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.gpu-out}
mkdir -p "$OUT"
ROOT=$PWD
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 LOCALSPEC_OFFLINE=1
export LOCALSPEC_HOME=$ROOT/.gpu-home                  # wheel cache, calibration, models
MODELS=$ROOT/.gpu-models                               # random-weight models (GBs; not carried)
VPY=$ROOT/.venv/bin/python
LAYERS=${GPU_LAYERS:--1}
say() { echo "== $(date +%T) $*" | tee -a "$OUT/run.log" >&2; }

setup() {
  command -v nvcc >/dev/null || [ ! -x /usr/local/cuda/bin/nvcc ] || export PATH=/usr/local/cuda/bin:$PATH
  say "machine"
  { nvidia-smi 2>&1 | head -15; nvcc --version 2>&1 | tail -2; python3 --version; cmake --version | head -1
    nproc; grep -m1 "model name" /proc/cpuinfo; uptime; } >> "$OUT/run.log" 2>&1
  # A venv that also sees the image's own packages (numpy, pytest, scipy, click, jinja2,
  # scikit-build-core, cmake, ninja): the image's python3 is itself a venv, whose packages a
  # nested --system-site-packages venv would not see, so a .pth file adds them.
  # Without ensurepip in the base Python, a venv without pip still runs the image's pip.
  [ -x "$VPY" ] || python3 -m venv "$ROOT/.venv" || python3 -m venv --without-pip "$ROOT/.venv" \
    || return 1
  local site vsite
  site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  vsite=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" > "$vsite/image-packages.pth"
  # The carried wheels first: cffi must be importable when setup.py runs without build
  # isolation, or setuptools skips `cffi_modules` with a warning and the C matcher is never
  # built; our scikit-build-core (the build wants >= 0.9.2) shadows whatever the image has.
  "$VPY" -m pip install -q --no-index --no-deps .gpu/whl/*.whl || return 1
  # The trimmed sdist, unpacked once into a fixed folder and built there with a fixed build dir:
  # a build cut off by the 10-minute limit resumes on the next call (pip's own temp folders
  # would change the source path, and scikit-build-core then starts over).
  local src=$ROOT/.gpu-src/llama_cpp_python-0.3.36
  if [ ! -f "$src/pyproject.toml" ]; then
    mkdir -p "$ROOT/.gpu-src" && tar xzf .gpu/whl/llama_cpp_python-0.3.36.tar.gz -C "$ROOT/.gpu-src"
  fi
  say "install.sh (offline: .gpu/whl is the only index)"
  # PIP_NO_BUILD_ISOLATION=0 means "no build isolation" (pip reads the no- option's value).
  # No --exact libraries: exactness is a CPU claim, and their build would spend device minutes.
  PIP_NO_INDEX=1 PIP_FIND_LINKS=$ROOT/.gpu/whl PIP_NO_BUILD_ISOLATION=0 LOCALSPEC_EXACT_LIBS=0 \
    LOCALSPEC_LLAMA_SRC=$src SKBUILD_BUILD_DIR=$ROOT/.gpu-build ./install.sh > "$OUT/install.log" 2>&1
  local rc=$?
  tail -3 "$OUT/install.log" | tee -a "$OUT/run.log" >&2
  "$VPY" localspec/llama/buildflags.py --explain >> "$OUT/run.log" 2>&1
  "$VPY" -c 'import localspec.speculative.ngram, localspec.llama as l; print("C extension ok; GPU offload:",
             l.supports_gpu_offload(), "|", l.system_info())' 2>&1 | tee -a "$OUT/run.log"
  return $rc
}

run_tests() {
  say "device tests (pytest -m device: models offloaded, tests/test_device.py)"
  timeout "${TEST_TIMEOUT:-540}" "$VPY" -m pytest -q -p no:cacheprovider -m device \
    tests/ > "$OUT/tests.log" 2>&1
  local rc=$?
  tail -25 "$OUT/tests.log" | tee -a "$OUT/run.log" >&2
  return $rc
}

join_smollm2() {   # the real SmolLM2-135M, carried in two halves, into the catalog's cache
  local dst=$LOCALSPEC_HOME/models/smollm2-135m-instruct-q4_1.gguf
  [ -f "$dst" ] && return 0
  [ -f .gpu/smollm2.part1 ] && [ -f .gpu2/smollm2.part2 ] || { say "no SmolLM2 halves"; return 1; }
  mkdir -p "$(dirname "$dst")"
  cat .gpu/smollm2.part1 .gpu2/smollm2.part2 > "$dst.tmp"
  if [ "$(sha256sum "$dst.tmp" | cut -d' ' -f1)" = "$(cat .gpu/smollm2.sha256)" ]; then
    mv "$dst.tmp" "$dst"
  else
    say "SmolLM2 halves do not join to the pinned sha256"; rm -f "$dst.tmp"; return 1
  fi
}

make_models() {
  mkdir -p "$MODELS"
  for s in .gpu/specs/*.spec.gguf.xz; do
    local name
    name=$(basename "$s" .spec.gguf.xz)
    [ -f "$MODELS/$name.gguf" ] && continue
    xz -dkc "$s" > "$MODELS/$name.spec.gguf"
    say "random $name"
    "$VPY" scripts/random_gguf.py make "$MODELS/$name.spec.gguf" -o "$MODELS/$name.gguf" \
      --workdir "$MODELS" 2>&1 | tee -a "$OUT/run.log" >&2
  done
}

measure() {
  join_smollm2
  make_models
  local t=$MODELS/qwen2.5-coder-1.5b.gguf smol=$LOCALSPEC_HOME/models/smollm2-135m-instruct-q4_1.gguf
  local also=("$MODELS/smollm2-135m.gguf")
  [ -f "$smol" ] && also+=("$smol")
  say "curves, identity, draft cost"
  "$VPY" scripts/gpu_measure.py --target "$t" --draft "$MODELS/qwen2.5-coder-0.5b.gguf" \
    --also "${also[@]}" --gpu-layers "$LAYERS" --k-max "${K_MAX:-32}" \
    --tokens "${TOKENS:-64}" --json "$OUT/measure.json" 2>&1 | tee -a "$OUT/run.log" >&2
  say "per-step overhead: engine step vs prototype, interleaved"
  "$VPY" scripts/step_overhead.py "$t" --gpu-layers "$LAYERS" --ks "${KS:-0,4,8,16}" \
    --tokens "${OVERHEAD_TOKENS:-128}" --reps 3 --fast --profile 8 --json "$OUT/overhead.json" \
    2>>"$OUT/profile.txt" | tee -a "$OUT/run.log" >&2
  "$VPY" scripts/step_overhead.py --tiny --gpu-layers "$LAYERS" --ks "${KS:-0,4,8,16}" --reps 3 \
    --fast --json "$OUT/overhead-tiny.json" 2>>"$OUT/profile.txt" | tee -a "$OUT/run.log" >&2
}

[ $# -gt 0 ] || { echo "usage: $0 setup|test|measure ..." >&2; exit 2; }
status=0
for phase in "$@"; do
  case $phase in
    setup) setup || { status=1; break; } ;;
    test) run_tests || status=1 ;;
    measure) measure || status=1 ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
say "done (status $status)"
exit $status
