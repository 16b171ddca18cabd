"""Shared fixtures: the tiny self-made GGUF (no download) and SmolLM2-135M from the catalog."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tools/

# The suite runs on the default kernels, as users do: the batch-invariant libraries where
# install.sh built them (tests/test_exact_libs.py also starts processes on each set explicitly).

from tinymodel import make_tiny_gguf

# The device lane: tests marked `device` load their models with --gpu-layers -1 themselves
# (tests/test_device.py) and run only when the marker expression names them (`pytest -m device`,
# scripts/ci/device_lane.sh on a GPU build); any other run deselects them, so a CPU run never loads
# a model onto a device it does not have. What they measure is printed in a "device report"
# section above pytest's summary line.
_device_report: list = []


def pytest_collection_modifyitems(config, items):
    if "device" in (config.option.markexpr or ""):
        return
    device = [item for item in items if item.get_closest_marker("device")]
    if device:
        config.hook.pytest_deselected(items=device)
        items[:] = [item for item in items if not item.get_closest_marker("device")]


def pytest_terminal_summary(terminalreporter):
    if _device_report:
        terminalreporter.section("device report")
        for line in _device_report:
            terminalreporter.write_line(line)


# What the suite's runs learn stays out of the user's cache: LOCALSPEC_HOME is a fresh folder for
# the session (the draft store, prompt caches and crash reports of the tests go there), in which
# the user's model, download and calibration folders are linked, so that models are pulled and
# calibrated once per machine as before (and the llama-cpp-python sdist install.sh keeps, for
# tests/test_patch_series.py). Tests that need a home of their own set one.
_SHARED = ("models", "downloads", "calibration", ".locks", "sdist")


@pytest.fixture(scope="session", autouse=True)
def _test_home(tmp_path_factory):
    from localspec.files import localspec_home
    real = localspec_home()
    home = tmp_path_factory.mktemp("localspec-home")
    for part in _SHARED:
        (real / part).mkdir(parents=True, exist_ok=True)
        (home / part).symlink_to(real / part, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALSPEC_HOME", str(home))
        yield home


@pytest.fixture(scope="session")
def device_report():
    """Lines for the device report (identity rates, top-2 gaps, tokens/s): measured, not
    asserted."""
    return _device_report


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_path(tiny_dir):
    """A 259-token byte-vocabulary llama model with moderately peaked distributions."""
    return make_tiny_gguf(tiny_dir / "tiny-target.gguf", seed=0, logit_scale=3.0)


@pytest.fixture(scope="session")
def tiny_fim_path(tiny_dir):
    """The tiny model with fill-in-the-middle tokens in its vocabulary (265 tokens)."""
    return make_tiny_gguf(tiny_dir / "tiny-fim.gguf", seed=0, logit_scale=3.0, fim=True)


@pytest.fixture(scope="session")
def tiny_model(tiny_path):
    from localspec.llama import Model

    with Model(tiny_path) as model:
        yield model


@pytest.fixture(scope="session")
def smollm_path():
    """SmolLM2-135M-Instruct, pulled once through the catalog and cached in the user cache."""
    from localspec.catalog.models import resolve_model
    from localspec.errors import LocalspecError

    try:
        return resolve_model("smollm2-135m", progress=False)
    except LocalspecError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2-135M not available: {e}")


@pytest.fixture(scope="session")
def smollm(smollm_path):
    from localspec.llama import Model

    with Model(smollm_path) as model:
        yield model
