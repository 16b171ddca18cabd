#!/usr/bin/env bash
# Install the editors that tests/editors/ drives headless: Debian's neovim (0.7+) and emacs-nox
# (28+). Does nothing when both are there; says so and exits 0 where it cannot install them
# (not Debian/Ubuntu, or no root and no sudo): the editor tests then skip with that reason.
set -uo pipefail
missing=()
command -v nvim >/dev/null || missing+=(neovim)
command -v emacs >/dev/null || missing+=(emacs-nox)
if [ ${#missing[@]} -eq 0 ]; then
    echo "editors_setup: neovim and emacs are installed" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "editors_setup: no apt-get here; install ${missing[*]} yourself to run tests/editors" >&2
    exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"; else
        echo "editors_setup: not root and no sudo; install ${missing[*]} to run tests/editors" >&2
        exit 0
    fi
fi
echo "editors_setup: installing ${missing[*]} (apt-get)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
       { $sudo apt-get update -q >/dev/null 2>&1 &&
         $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }; }; then
    echo "editors_setup: apt-get could not install ${missing[*]}; tests/editors will skip" >&2
fi
exit 0
