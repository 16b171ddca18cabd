#!/usr/bin/env bash
# Builds llama.cpp's stock llama-speculative-simple once per machine, for `localspec bench
# --modes ...,llamacpp-mod,llamacpp-simple`: from the installed llama-cpp-python's vendored
# llama.cpp (its sdist, cached under $LOCALSPEC_HOME/sdist) with install.sh's CMake flags
# (localspec/llama/buildflags.py), into $LOCALSPEC_HOME/llamacpp-bin/llama-cpp-python-VER-KEY/
# (KEY: the wheel's). 9 CPU-minutes the first time (~5 min on 2 idle cores), seconds after.
# --target llama-server builds llama.cpp's HTTP server into the same folder instead, for
# scripts/bench/bench_parallel.py (its tools/ tree too, no web UI, nothing downloaded; see
# localspec/bench/llamacpp_build.py for the time it took).
# Progress on stderr, the binary's path on stdout; a failure is one line naming the build log.
# --linked builds the tool alone on shared libraries, run on the installed wheel's own (the GPU
# recipe carries it to a GPU machine: docs/gpu-offline-recipe.md).
# Usage: scripts/llamacpp_tools.sh [--target llama-speculative-simple|llama-server] [--path] [--linked]
#        [-j JOBS]                              Env: PYTHON (default .venv/bin/python),
#        LOCALSPEC_HOME, LOCALSPEC_LLAMA_SRC, LOCALSPEC_CMAKE_ARGS, CMAKE_ARGS (as install.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -c \
  "import sys; from localspec.bench.llamacpp_build import main; sys.exit(main(sys.argv[1:]))" "$@"
