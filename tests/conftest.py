"""Shared fixtures: the tiny self-made GGUF (no download) and SmolLM2-135M from the catalog."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tools/

# The suite runs on the default kernels, as users do. Only a process that asked for --exact's
# libraries (tests/test_exact_libs.py starts one, LOCALSPEC_EXACT=1, to run the bit-for-bit tests)
# turns the tiled K-quant matmul off, before its first decode: ggml reads that switch once.
if os.environ.get("LOCALSPEC_EXACT") == "1":
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")

from tinymodel import make_tiny_gguf

# LOCALSPEC_TEST_GPU_LAYERS=-1 runs the suite with every model offloaded (a CUDA build on a GPU
# machine, scripts/gpu_run.sh): Models loaded with the default of 0 layers get this many instead.
# Unset (CI), nothing changes.
if os.environ.get("LOCALSPEC_TEST_GPU_LAYERS"):
    import dataclasses

    from localspec import llama as _llama

    _load = _llama.Model.__init__

    def _offloaded(self, path, params=_llama.ModelParams()):
        if params.n_gpu_layers == 0:
            params = dataclasses.replace(
                params, n_gpu_layers=int(os.environ["LOCALSPEC_TEST_GPU_LAYERS"]))
        _load(self, path, params)

    _llama.Model.__init__ = _offloaded


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_path(tiny_dir):
    """A 259-token byte-vocabulary llama model with moderately peaked distributions."""
    return make_tiny_gguf(tiny_dir / "tiny-target.gguf", seed=0, logit_scale=3.0)


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
