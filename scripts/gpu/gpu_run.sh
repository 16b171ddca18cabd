#!/usr/bin/env bash
# The offline GPU recipe (docs/gpu-offline-recipe.md): runs on the GPU machine what
# scripts/gpu/gpu_bundle.sh packed, step by step in order of value, each step under its own timeout,
# each writing its result file into $OUT when it ends (a run cut short returns what it finished):
#
#   step      timeout  result file      what
#   setup       480 s  setup.log        a venv over the image's packages, the carried wheels,
#                                       ./install.sh offline (the CUDA build: 5 min 23 s once)
#   exact       240 s  exact.json       the CUDA patch's batch-invariant rows (--exact): every
#                                       row of 2..17-row batches after 40 and 1500 tokens, greedy
#                                       identity (n-gram; scripted k = 1, 4, 16), r(k) off and on
#   diagnose    150 s  diagnose.json    one load per process: llama_cpp.Llama, localspec's door,
#                                       the raw load + one suspect per case; cuda-gdb stacks
#   identity     90 s  identity.json    greedy speculative == plain (n-gram; scripted k=8)
#   parallel     75 s  parallel.json    4 slots in one context (--parallel): each request's text
#                                       against its lone run, tokens/s against one at a time
#   curve        90 s  curve.json       r(k) for k = 0..16 and the policy's k (SmolLM2 shape),
#                                       and with CUDA graphs off (patch 0011's price)
#   overhead     75 s  overhead.json    Python time per step around the device, one-pass/per-row
#   bench       120 s  bench.json       the real SmolLM2-135M: plain, ngram, peer
#   tests       300 s  tests.log        pytest -m device (tests/test_device.py)
#   llamacpp    200 s  llamacpp.json    the real SmolLM2-135M, 8 code edits: localspec plain and
#                                       ngram (--exact on a GPU) against llama.cpp's own
#                                       speculation (llamacpp-plain, -mod, -simple), the bundle's
#                                       linked tool running on this machine's CUDA wheel
#   qwen        240 s  qwen.json        the Qwen2.5-Coder 1.5B/0.5B shapes (when their specs
#                                       came): r(k), the draft's cost, the per-step overhead
#
# plus run.log (every step's status and headline numbers, all calls so far): at most 8 files a
# call (a step that waits for a later call writes none).
# Steps done in an earlier call on the same machine are not run again (.gpu-state/), so the same
# command is made twice: call 1 carries .gpu (setup ... overhead), call 2 .gpu2 (SmolLM2's
# second part: bench, tests, llamacpp, qwen, and whatever call 1 did not finish). A step that waits for a
# later call holds back the steps after it: they are worth less. The whole run keeps within
# RUN_BUDGET_S (560) seconds: a step gets what is left when less than its own timeout is.
# On a machine without a GPU (LOCALSPEC_BACKEND=cpu: the rehearsal, tests/test_gpu_rehearsal.py)
# every step but `tests` runs on the CPU (layers 0) and `tests` says "skipped: no GPU" (GPU or
# not: whether the build sees a GPU device, setup.log's "GPU devices: N").
# Usage: scripts/gpu/gpu_run.sh [STEP ...]     (default: every step not done yet)
# Env: OUT, RUN_BUDGET_S, GPU_LAYERS, IMAGE_PYTHON (python3), FORCE=1 (redo done steps),
#      <STEP>_TIMEOUT (SETUP_TIMEOUT, ...), DIAG_CASES, DIAG_CASE_TIMEOUT (40), TOKENS (32),
#      IDENTITY_PROMPTS (20), IDENTITY_KS (8: the scripted drafts' k, comma-separated),
#      IDENTITY_WHAT (identity; rows,identity: also each batch row against one-token decodes),
#      EXACT_WHAT (rows,identity,curve), EXACT_CONTEXTS (40,1500), EXACT_KS (1,4,16),
#      PARALLEL_TOKENS (64), K_MAX (16), KS (0,4,8,16), OVERHEAD_TOKENS (64),
#      BENCH_ARGS ("-n 64"), LLAMACPP_ARGS ("-n 256"), TESTS_ARGS, THREADS (identity, curve, overhead; default: all cores),
#      GPU_LEAN_BUILD=1 (no flash-attention kernels: a shorter CUDA build)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/.gpu-out}
STATE=$ROOT/.gpu-state
mkdir -p "$OUT" "$STATE/logs"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 LOCALSPEC_OFFLINE=1
export LOCALSPEC_HOME=$ROOT/.gpu-home                  # wheel cache, calibration, models
MODELS=$ROOT/.gpu-models                               # made here (GBs; never carried)
VPY=$ROOT/.venv/bin/python
IMAGE_PYTHON=${IMAGE_PYTHON:-python3}
BUDGET=${RUN_BUDGET_S:-560}
T0=$(date +%s)
SMOL=$LOCALSPEC_HOME/models/smollm2-135m-instruct-q4_1.gguf
for d in /usr/local/cuda/bin; do [ -d $d ] && case ":$PATH:" in *":$d:"*) ;; *) PATH=$PATH:$d;; esac; done
export PATH

say() { echo "== $(date -u +%T) $*" | tee -a "$STATE/run.log" >&2; cp "$STATE/run.log" "$OUT/run.log"; }
layers() { cat "$STATE/gpu_layers" 2>/dev/null || echo 0; }
have_gpu() { [ "$(cat "$STATE/gpu" 2>/dev/null)" = 1 ]; }

# ---- the steps: each runs in a child (`gpu_run.sh --one STEP`) under `timeout`; its exit status
# 0 ok, 3 skipped until a later call / 4 skipped for good (its reason on a log line starting
# "skipped:"), else failed

step_setup() {
  { echo "# machine"; nvidia-smi 2>&1 | head -15; nvcc --version 2>&1 | tail -2
    "$IMAGE_PYTHON" --version; cmake --version 2>&1 | head -1; echo "cores: $(nproc)"
    grep -m1 "model name" /proc/cpuinfo; uptime; free -g | head -2; df -h "$ROOT" | tail -1
    command -v cuda-gdb gdb; } > "$OUT/setup.log" 2>&1
  # A venv that also sees the image's own packages (numpy, pytest, scipy, click, jinja2, cmake,
  # ninja): the image's python3 may itself be a venv, whose packages a nested
  # --system-site-packages venv would not see, so a .pth file adds them. Without ensurepip in
  # the base Python, a venv without pip still runs the image's pip.
  [ -x "$VPY" ] || "$IMAGE_PYTHON" -m venv "$ROOT/.venv" \
    || "$IMAGE_PYTHON" -m venv --without-pip "$ROOT/.venv" || return 1
  local site vsite
  site=$("$IMAGE_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  vsite=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" > "$vsite/image-packages.pth"
  # The carried wheels first: cffi must be importable when setup.py runs without build
  # isolation, or setuptools skips `cffi_modules` and the C module is never built; the carried
  # scikit-build-core (the build wants >= 0.9.2) shadows the image's.
  "$VPY" -m pip install -q --no-index --no-deps .gpu/whl/*.whl >> "$OUT/setup.log" 2>&1 || return 1
  # The trimmed sdist, unpacked once into a fixed folder and built there with a fixed build dir:
  # a build cut off by a timeout resumes in the next call (pip's temp folders would change the
  # source path, and scikit-build-core would start over).
  local src=$ROOT/.gpu-src/llama_cpp_python-0.3.36
  if [ ! -f "$src/pyproject.toml" ]; then
    mkdir -p "$ROOT/.gpu-src" && tar xzf .gpu/whl/llama_cpp_python-0.3.36.tar.gz -C "$ROOT/.gpu-src"
  fi
  echo "# install.sh (offline: .gpu/whl and the image's packages only)" >> "$OUT/setup.log"
  # PIP_NO_BUILD_ISOLATION=0 means "no build isolation" (pip reads the no- option's value).
  # No --exact CPU libraries: their build would cost device minutes, and the exact step keeps every
  # layer on the GPU, where the CUDA wheel's own patch (0010) is what --exact needs.
  local rc=0
  # GPU_LEAN_BUILD=1: no flash-attention kernels (their templates are most of the CUDA build's
  # time): for a run that only has minutes left to find why a load crashes
  PIP_NO_INDEX=1 PIP_FIND_LINKS=$ROOT/.gpu/whl PIP_NO_BUILD_ISOLATION=0 LOCALSPEC_EXACT_LIBS=0 \
    CMAKE_ARGS="${CMAKE_ARGS:-}${GPU_LEAN_BUILD:+ -DGGML_CUDA_FA=OFF}" LOCALSPEC_LLAMA_SRC=$src SKBUILD_BUILD_DIR=$ROOT/.gpu-build ./install.sh >> "$OUT/setup.log" 2>&1 || rc=$?
  if [ $rc != 0 ]; then
    echo "# .venv/install.log, last 60 lines" >> "$OUT/setup.log"
    tail -60 "$ROOT/.venv/install.log" >> "$OUT/setup.log" 2>/dev/null
    return $rc
  fi
  "$VPY" localspec/llama/buildflags.py --explain >> "$OUT/setup.log" 2>&1
  # The GPU devices the build sees, asked of llama_cpp alone in a child of its own (not through
  # localspec's door; llama_supports_gpu_offload is no test: the RPC backend makes it true)
  local probe=0
  timeout 120 "$VPY" - > "$STATE/devices.txt" 2>> "$OUT/setup.log" <<'PY'
import ctypes, llama_cpp as l
lib = l.llama_cpp._lib
def fn(name, res, *args):
    f = lib[name]; f.restype, f.argtypes = res, list(args); return f
count, get = fn("ggml_backend_dev_count", ctypes.c_size_t), fn("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
kind = fn("ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
name = fn("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)
desc = fn("ggml_backend_dev_description", ctypes.c_char_p, ctypes.c_void_p)
l.llama_backend_init()
print(l.llama_print_system_info().decode())
for i in range(count()):
    d = get(i)
    print("device", name(d).decode(), desc(d).decode(), "type", kind(d))
print("GPU devices:", sum(kind(get(i)) in (1, 2) for i in range(count())))
PY
  probe=$?
  cat "$STATE/devices.txt" >> "$OUT/setup.log"
  if [ $probe != 0 ]; then      # the probe itself failed: trust nvidia-smi (the matrix will say)
    echo "# the device probe failed (exit $probe)" >> "$OUT/setup.log"
    nvidia-smi -L 2>/dev/null | grep -q "^GPU" && echo "GPU devices: 1 (nvidia-smi)" >> "$STATE/devices.txt"
  fi
  "$VPY" -c 'import localspec._ngram_c; print("localspec C module: ok")' >> "$OUT/setup.log" 2>&1
  if grep -q "^GPU devices: [1-9]" "$STATE/devices.txt"; then echo 1; else echo 0; fi > "$STATE/gpu"
  echo "${GPU_LAYERS:-$(have_gpu && echo -1 || echo 0)}" > "$STATE/gpu_layers"
  echo "# GPU: $(cat "$STATE/gpu"), layers for every step: $(layers)" >> "$OUT/setup.log"
}

tiny_model() {
  [ -f "$MODELS/tiny.gguf" ] || "$VPY" -c "import sys; sys.path.insert(0, 'tests')
from tinymodel import make_tiny_gguf
make_tiny_gguf('$MODELS/tiny.gguf', seed=0, logit_scale=3.0)" >&2 || return 1
  echo "$MODELS/tiny.gguf"
}

shape_model() {   # shape_model NAME: the random-weight model of a carried spec, made once
  local name=$1
  [ -f ".gpu/specs/$name.spec.gguf.xz" ] || return 1
  if [ ! -f "$MODELS/$name.gguf" ]; then
    "$VPY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      ".gpu/specs/$name.spec.gguf.xz" "$MODELS/$name.spec.gguf" || return 1     # no xz needed there
    echo "making the random $name" >&2
    "$VPY" scripts/random_gguf.py make "$MODELS/$name.spec.gguf" -o "$MODELS/$name.part.gguf" \
      --workdir "$MODELS" >&2 || return 1
    mv "$MODELS/$name.part.gguf" "$MODELS/$name.gguf"       # whole, or not there
  fi
  echo "$MODELS/$name.gguf"
}

join_smollm2() {   # the real SmolLM2-135M, carried in two parts, into the catalog's cache
  [ -f "$SMOL" ] && return 0
  [ -f .gpu/smollm2.part1 ] && [ -f .gpu2/smollm2.part2 ] || return 1
  mkdir -p "$(dirname "$SMOL")"
  cat .gpu/smollm2.part1 .gpu2/smollm2.part2 > "$SMOL.tmp"
  if [ "$(sha256sum "$SMOL.tmp" | cut -d' ' -f1)" = "$(cat .gpu/smollm2.sha256)" ]; then
    mv "$SMOL.tmp" "$SMOL"
  else
    echo "SmolLM2 parts do not join to the pinned sha256" >&2; rm -f "$SMOL.tmp"; return 1
  fi
}

step_diagnose() {
  local tiny
  tiny=$(tiny_model) || return 1
  "$VPY" scripts/gpu/gpu_diagnose.py matrix "$tiny" --layers "$(layers)" \
    --json "$OUT/diagnose.json" --budget $(( STEP_TIMEOUT - 5 )) \
    --case-timeout "${DIAG_CASE_TIMEOUT:-40}" ${DIAG_CASES:+--cases "$DIAG_CASES"}
  [ -f "$OUT/diagnose.json" ]      # a crashing case is a result, not a failed step
}

step_exact() {     # the batch-invariant rows (patch 0010 on CUDA): rows, greedy identity, r(k)
  "$VPY" -c 'import sys; from localspec.llama.exact_rows import device_exact_backends as d
sys.exit(0 if d() else 1)' 2>/dev/null || {
    echo "skipped: this build's GPU library has no batch-invariant rows (a CPU or unpatched build)"
    return 4; }
  local models=() m
  m=$(shape_model smollm2-135m) && models+=("$m")
  models+=("$(tiny_model)")
  "$VPY" scripts/gpu/gpu_measure.py --exact --what "${EXACT_WHAT:-rows,identity,curve}" \
    --target "${models[0]}" --also "${models[@]:1}" --gpu-layers "$(layers)" \
    --contexts "${EXACT_CONTEXTS:-40,1500}" --rows-max 17 --tokens "${TOKENS:-32}" \
    --prompts "${IDENTITY_PROMPTS:-20}" --scripted-ks "${EXACT_KS:-1,4,16}" --k-max 16 \
    ${THREADS:+--threads "$THREADS"} --json "$OUT/exact.json"
}

step_identity() {
  local models=() m
  m=$(shape_model smollm2-135m) && models+=("$m")
  models+=("$(tiny_model)")
  "$VPY" scripts/gpu/gpu_measure.py --what "${IDENTITY_WHAT:-identity}" --target "${models[0]}" \
    --also "${models[@]:1}" \
    --gpu-layers "$(layers)" --tokens "${TOKENS:-32}" --prompts "${IDENTITY_PROMPTS:-20}" \
    --scripted-ks "${IDENTITY_KS:-8}" ${THREADS:+--threads "$THREADS"} --json "$OUT/identity.json"
}

step_parallel() {
  local m
  m=$(shape_model smollm2-135m) || m=$(tiny_model)
  "$VPY" scripts/gpu/gpu_measure.py --what parallel --target "$m" --gpu-layers "$(layers)" \
    --tokens "${PARALLEL_TOKENS:-64}" --prompts "${IDENTITY_PROMPTS:-20}" --slots 4 \
    ${THREADS:+--threads "$THREADS"} --json "$OUT/parallel.json"
}

step_curve() {
  local models=() m
  m=$(shape_model smollm2-135m) && models+=("$m")
  join_smollm2 2>/dev/null && models+=("$SMOL")
  [ ${#models[@]} -gt 0 ] || models+=("$(tiny_model)")
  "$VPY" scripts/gpu/gpu_measure.py --what curve --target "${models[0]}" --also "${models[@]:1}" \
    --gpu-layers "$(layers)" --k-max "${K_MAX:-16}" ${THREADS:+--threads "$THREADS"} \
    --json "$OUT/curve.json" || return 1
  graphs_off "${models[0]}" "$OUT/curve.json" --k-max "${K_MAX:-16}"
}

graphs_off() {   # graphs_off MODEL JSON [ARGS]: MODEL's curve with CUDA graphs off, added to JSON
  # (patch 0011's price: every batch size replayed from its own graph, against direct launches)
  local m=$1 json=$2; shift 2
  GGML_CUDA_DISABLE_GRAPHS=1 "$VPY" scripts/gpu/gpu_measure.py --what curve --target "$m" \
    --gpu-layers "$(layers)" ${THREADS:+--threads "$THREADS"} "$@" \
    --json "$STATE/graphs-off.json" || return 1
  "$VPY" -c 'import json, sys
out, off = (json.load(open(p)) for p in sys.argv[1:3])
out["curves"] += off["curves"]
json.dump(out, open(sys.argv[1], "w"), indent=1)' "$json" "$STATE/graphs-off.json"
}

overhead() {   # overhead MODEL JSON
  "$VPY" scripts/bench/step_overhead.py "$1" --gpu-layers "$(layers)" --ks "${KS:-0,4,8,16}" \
    --tokens "${OVERHEAD_TOKENS:-64}" --reps 1 --per-row --profile 8 ${THREADS:+--threads "$THREADS"} \
    --json "$2" || return 1
  # The argmax on the device (experimental in llama.cpp; it crashed on lavapipe) in a process of
  # its own, beside the engine's step: a crash costs these rows only. Into JSON's "argmax".
  local log=$STATE/logs/argmax-$(basename "$2").log extra=$STATE/argmax-$(basename "$2")
  rm -f "$extra"
  "$VPY" scripts/bench/step_overhead.py "$1" --gpu-layers "$(layers)" --ks "${KS:-0,4,8,16}" \
    --tokens "${OVERHEAD_TOKENS:-64}" --reps 1 --device-argmax ${THREADS:+--threads "$THREADS"} \
    --json "$extra" > "$log" 2>&1
  local rc=$?
  "$VPY" -c 'import json, os, sys
out, extra, rc, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
data = json.load(open(out))
if rc == 0 and os.path.exists(extra):
    data["argmax"] = {"status": "ok", "rows": json.load(open(extra))["rows"]}
else:
    data["argmax"] = {"status": f"failed (exit {rc})", "log_tail": open(log, errors="replace").read().splitlines()[-20:]}
json.dump(data, open(out, "w"), indent=1)' "$2" "$extra" "$rc" "$log"
}

step_overhead() {
  local m
  m=$(shape_model smollm2-135m) || m=$(tiny_model)
  overhead "$m" "$OUT/overhead.json"
}

step_qwen() {      # the default model's shape and its draft's: made here (~1 min), then measured
  [ -f .gpu/specs/qwen2.5-coder-1.5b.spec.gguf.xz ] || {
    echo "skipped: the bundle holds no Qwen specs (GPU_BUNDLE_SPECS, models pulled here)"; return 4; }
  local t d draft=()
  t=$(shape_model qwen2.5-coder-1.5b) || return 1
  d=$(shape_model qwen2.5-coder-0.5b) && draft=(--draft "$d")
  "$VPY" scripts/gpu/gpu_measure.py --what curve,draft --target "$t" "${draft[@]}" \
    --gpu-layers "$(layers)" --k-max "${K_MAX:-16}" ${THREADS:+--threads "$THREADS"} \
    --json "$OUT/qwen.json" || return 1
  graphs_off "$t" "$OUT/qwen.json" --k-max "${K_MAX:-16}" || return 1
  overhead "$t" "$STATE/qwen-overhead.json" || return 1
  "$VPY" -c 'import json, sys
q, o = (json.load(open(p)) for p in sys.argv[1:3])
q["overhead"] = o
json.dump(q, open(sys.argv[1], "w"), indent=1)' "$OUT/qwen.json" "$STATE/qwen-overhead.json"
}

step_bench() {
  [ -f .gpu/smollm2.sha256 ] || { echo "skipped: the bundle holds no SmolLM2-135M"; return 4; }
  join_smollm2 || { echo "skipped: no SmolLM2-135M yet (.gpu2/smollm2.part2 comes with call 2)"; return 3; }
  # shellcheck disable=SC2086  # BENCH_ARGS: a list of options
  "$VPY" -m localspec bench -m "$SMOL" --modes plain,ngram,peer --gpu-layers "$(layers)" \
    ${BENCH_ARGS:--n 64} --json "$OUT/bench.json"
}

step_llamacpp() {
  [ -f .gpu/llamacpp.sha256 ] || { echo "skipped: the bundle holds no llama.cpp tool"; return 4; }
  join_smollm2 || { echo "skipped: no SmolLM2-135M yet (.gpu2/smollm2.part2 comes with call 2)"; return 3; }
  [ -f .gpu2/llamacpp.tar.xz ] || \
    { echo "skipped: the llama.cpp tool comes with call 2 (.gpu2/llamacpp.tar.xz)"; return 3; }
  [ "$(sha256sum .gpu2/llamacpp.tar.xz | cut -d' ' -f1)" = "$(cat .gpu/llamacpp.sha256)" ] \
    || { echo "the llama.cpp tool's archive is not the bundle's (sha256)"; return 1; }
  local dir    # where the bench looks for the linked tool (llamacpp_build.linked_dir)
  dir=$(PYTHON=$VPY bash scripts/llamacpp_tools.sh --linked --path) || return 1
  dir=$(dirname "$dir")
  rm -rf "$dir" && mkdir -p "$dir" && xz -dc .gpu2/llamacpp.tar.xz | tar -C "$dir" -xf - || return 1
  local exact=()
  have_gpu && exact=(--exact)       # the CPU rehearsal installs no batch-invariant CPU copy
  # shellcheck disable=SC2086  # LLAMACPP_ARGS: a list of options
  "$VPY" -m localspec bench -m "$SMOL" --kinds code-edit --lockstep "${exact[@]}" \
    --modes plain,ngram,llamacpp-plain,llamacpp-mod,llamacpp-simple --gpu-layers "$(layers)" \
    ${LLAMACPP_ARGS:--n 256} --json "$OUT/llamacpp.json"
}

step_tests() {
  have_gpu || { echo "skipped: no GPU (this build sees no GPU device)" | tee "$OUT/tests.log"; return 4; }
  join_smollm2 || { echo "skipped: no SmolLM2-135M yet (.gpu2/smollm2.part2 comes with call 2)"; return 3; }
  # shellcheck disable=SC2086
  "$VPY" -m pytest -q -p no:cacheprovider -m device tests/ ${TESTS_ARGS:-} > "$OUT/tests.log" 2>&1
}

STEPS=(setup exact diagnose identity parallel curve overhead bench tests llamacpp qwen)
declare -A CAP=([setup]=480 [exact]=240 [diagnose]=150 [identity]=90 [parallel]=75 [curve]=90
                [overhead]=75 [bench]=120 [tests]=300 [llamacpp]=200 [qwen]=240)
declare -A RESULT=([setup]=setup.log [exact]=exact.json [diagnose]=diagnose.json
                   [identity]=identity.json
                   [parallel]=parallel.json [curve]=curve.json [overhead]=overhead.json
                   [bench]=bench.json [tests]=tests.log [llamacpp]=llamacpp.json
                   [qwen]=qwen.json)

if [ "${1:-}" = --one ]; then      # a child: one step, its output in the step's log
  mkdir -p "$MODELS"
  "step_$2"
  exit $?
fi

run_step() {
  local name=$1 cap left t rc status start log=$STATE/logs/$1.log
  if [ -f "$STATE/$name.done" ] && [ -z "${FORCE:-}" ]; then return 0; fi
  local var=${name^^}_TIMEOUT
  cap=${!var:-${CAP[$name]}}
  left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 25 ]; then
    status="skipped: out of time (make the same call again)"
    log=/dev/null
  elif [ ! -f "$OUT/${RESULT[$name]}" ] && [ "$(ls "$OUT" | wc -l)" -ge 8 ]; then
    status="skipped: 8 files in OUT already, the most a call returns (make the same call again)"
    rc=3
  else
    t=$(( cap < left - 5 ? cap : left - 5 ))
    say "$name (timeout ${t} s)"
    start=$(date +%s)
    STEP_TIMEOUT=$t timeout -k 10 "$t" bash "$ROOT/scripts/gpu/gpu_run.sh" --one "$name" \
      > "$log" 2>&1
    rc=$?
    case $rc in
      0) status=ok; touch "$STATE/$name.done";;
      3|4) status=$(grep '^skipped:' "$log" | tail -1); status=${status:-skipped}
         [ $rc = 3 ] || touch "$STATE/$name.done";;   # 4: skipped for good, 3: until a later call
      124|137) status="timed out after ${t} s"     # at its own timeout: not again; cut
         [ "$name" = setup ] || [ "$t" -lt "$cap" ] || touch "$STATE/$name.done";;  # short: again
      *) status="failed (exit $rc)"
         if [ $rc -gt 128 ]; then status="crashed (signal $((rc - 128)), exit $rc)"; fi
         [ "$name" = setup ] || touch "$STATE/$name.done";;
    esac
    status="$status, $(( $(date +%s) - start )) s"
  fi
  if [ "${rc:-}" = 3 ]; then        # waits for a later call: a line here, no result file yet
    say "$name: $status"
  elif [ "$name" = setup ]; then
    [ -f "$OUT/setup.log" ] || cp "$log" "$OUT/setup.log"
    echo "setup: $status" >> "$OUT/setup.log"
    say "setup: $status"
  else
    say "$("$IMAGE_PYTHON" scripts/gpu/gpu_result.py "$name" "$OUT/${RESULT[$name]}" "$status" \
             "$log")"
  fi
  [ "$name" != setup ] || [ -f "$STATE/setup.done" ] || return 1   # no setup, no later step
  [ "${rc:-}" != 3 ] || return 3
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=("${STEPS[@]}")
for s in "${steps[@]}"; do
  [ -n "${CAP[$s]:-}" ] || { echo "unknown step $s (steps: ${STEPS[*]})" >&2; exit 2; }
done
say "gpu_run.sh ${steps[*]} (budget ${BUDGET} s; $(nproc) cores; OUT=$OUT)"
# In order of value: once a step waits for a later call, the steps after it wait too (the GPU time
# a call leaves unused is the next call's).
waiting=""
for s in "${steps[@]}"; do
  if [ -n "$waiting" ]; then
    [ -f "$STATE/$s.done" ] && [ -z "${FORCE:-}" ] || say "$s: waits for $waiting (a later call)"
    continue
  fi
  run_step "$s"
  case $? in
    1) say "setup did not finish: nothing else can run (make the same call again)"; break;;
    3) waiting=$s;;
  esac
done
left=()
for s in "${STEPS[@]}"; do [ -f "$STATE/$s.done" ] || left+=("$s"); done
if [ ${#left[@]} = 0 ]; then say "all steps done"; else say "not done yet: ${left[*]}"; fi
cat "$STATE/run.log"
