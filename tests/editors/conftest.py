"""Real editors driven headless against a real `localspec serve --stdio` on the tiny model with
FIM tokens. scripts/ci/editors_setup.sh installs Debian's neovim and emacs-nox (CI runs it)."""

from __future__ import annotations

import os
import shutil
import stat
import sys

import pytest


def need(program: str, package: str) -> str:
    """The editor's path; the test is skipped, saying why, where it is not installed (CI runs
    scripts/ci/editors_setup.sh first, which installs it wherever apt-get can)."""
    path = shutil.which(program)
    if path is None:
        pytest.skip(f"{program} is not installed and scripts/ci/editors_setup.sh could not install "
                    f"it here (it needs Debian's {package} through apt-get)")
    return path


@pytest.fixture(scope="session")
def localspec_cmd(tmp_path_factory):
    """An executable `localspec` that runs this checkout with this Python, as the plugins'
    `cmd` option points at one."""
    path = tmp_path_factory.mktemp("bin") / "localspec"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m localspec "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def editor_env(tmp_path, tiny_fim_path, localspec_cmd):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {**os.environ, "LOCALSPEC_HOME": str(tmp_path / "home"),
            "LOCALSPEC_CMD": localspec_cmd, "LOCALSPEC_TEST_MODEL": str(tiny_fim_path),
            "LOCALSPEC_TEST_OUT": str(tmp_path / "out.json"),
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            "LOCALSPEC_REPO": root}
