#!/usr/bin/env bash
# The device lane: the tests marked `device` (pytest -m device), run on llama.cpp's Vulkan backend.
# On a machine without a GPU the device is Mesa's lavapipe, a Vulkan driver that runs on the CPU:
# slow, but the same device paths CUDA and Metal take (weights and KV cache in device buffers,
# the graph split between backends, states copied to and from the device).
#   1. the Debian packages it needs, apt-get installed only when missing
#   2. its own venv (.venv-device) made by ./install.sh with LOCALSPEC_BACKEND=vulkan: the Vulkan
#      wheel is cached per flag set beside the CPU one (~/.cache/localspec/wheels), so a rerun
#      takes seconds; the CPU venv (.venv) is not touched
#   3. `localspec doctor` (backend, devices) and pytest -m device, ending with pytest's summary
#      line; the exit status is pytest's (0 only if every device test passed), or 75 when the
#      machine could not be set up (no apt-get, a package or header download failed): .ci/run
#      reports that and goes on, since it says nothing about the code
# llama.cpp skips CPU-type Vulkan devices unless GGML_VK_VISIBLE_DEVICES names them: 0 here.
# Usage: scripts/ci/device_lane.sh [pytest args]
#        Env: LOCALSPEC_DEVICE_VENV, GGML_VK_VISIBLE_DEVICES
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${LOCALSPEC_DEVICE_VENV:-.venv-device}
PACKAGES="mesa-vulkan-drivers libvulkan-dev glslc spirv-headers vulkan-tools"
t0=$(date +%s)

missing=""
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  command -v apt-get >/dev/null || { echo "device_lane.sh: needs$missing (Debian package names)" >&2; exit 75; }
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "device_lane.sh: apt-get install$missing" >&2
  mkdir -p "$VENV"
  if ! { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -qq $missing; } > "$VENV/apt.log" 2>&1; then
    echo "device_lane.sh: apt-get failed; log: $VENV/apt.log" >&2; tail -n 20 "$VENV/apt.log" >&2; exit 75
  fi
fi

# Debian 12's Vulkan headers (1.3.239) lack VK_EXT_layer_settings, which the vendored llama.cpp
# uses unguarded (its build stops in ggml-vulkan.cpp). Debian 13's libvulkan-dev has them: its
# headers alone are unpacked into the cache (a private apt list; the system's sources and
# packages are not touched) and handed to CMake. The installed 1.3.239 loader stays: ggml looks
# Vulkan's functions up at run time.
HOME_DIR=${LOCALSPEC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}
if [ -z "${VULKAN_SDK:-}" ] && ! grep -q VK_EXT_layer_settings /usr/include/vulkan/vulkan_core.h; then
  HEADERS=$(ls -d "$HOME_DIR"/vulkan-headers/*/include 2>/dev/null | tail -n 1 || true)
  if [ -z "$HEADERS" ]; then
    echo "device_lane.sh: the Vulkan headers here are too old; unpacking Debian 13's" >&2
    apt=$(mktemp -d)
    mkdir -p "$apt/lists/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]" \
         "http://deb.debian.org/debian trixie main" > "$apt/sources.list"
    opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o "Dir::Etc::sourceparts=-"
          -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache")
    if ! { apt-get "${opts[@]}" update -qq && (cd "$apt" && apt-get "${opts[@]}" download \
           libvulkan-dev); } > "$apt/log" 2>&1; then
      echo "device_lane.sh: fetching Debian 13's libvulkan-dev failed:" >&2; tail -n 5 "$apt/log" >&2
      exit 75
    fi
    deb=$(ls "$apt"/libvulkan-dev_*.deb)
    dest=$HOME_DIR/vulkan-headers/$(dpkg-deb -f "$deb" Version)
    dpkg-deb -x "$deb" "$apt/x" && mkdir -p "$dest" && cp -a "$apt/x/usr/include" "$dest/"
    rm -rf "$apt"
    HEADERS=$dest/include
  fi
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DVulkan_INCLUDE_DIR=$HEADERS"
fi

LOCALSPEC_VENV=$VENV LOCALSPEC_BACKEND=vulkan LOCALSPEC_EXACT_LIBS=0 ./install.sh
echo "device_lane.sh: packages and install took $(( $(date +%s) - t0 )) s" >&2

export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
"$VENV/bin/localspec" doctor --build-only >&2
exec "$VENV/bin/python" -m pytest -m device -q -p no:cacheprovider "$@"
