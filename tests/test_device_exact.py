"""The device lane's exactness checks: with localspec's patched Vulkan library (patch
0009-vulkan-batch-invariant-rows; on an NVIDIA GPU the CUDA one, 0010) and its row limit on,
as --exact turns it on, every row of a verify batch is bit-identical to a one-token decode on
the device, so speculative output is plain output token for token with no near-tie guard,
greedy and seeded (docs/gpu.md,
"Batch-invariant rows on Vulkan"). Run by `pytest -m device` (scripts/ci/device_lane.sh, on
Mesa's lavapipe where there is no GPU).

Each test switches the limit on for itself and off again (exact_device), so the other device
tests keep measuring llama.cpp's own choices. lavapipe decodes SmolLM2 at ~2 tokens/s on two
cores, so the weight types are checked on random-weight models of SmolLM2's widths, heads and
vocabulary cut to two blocks (kernel_models.random_smollm(layers=2)): the same kernels, fewer
steps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from localspec.speculative.parallel import Slots
from localspec.llama.backend import gpu_backends
from localspec.llama.exact_rows import (device_exact_backends, device_exact_rows,
                                        device_exact_rows_on, set_device_exact_rows)
from localspec.speculative.sampling import SamplingParams

from kernel_models import random_smollm
from test_batch_invariant import every_row_mismatch
from test_parallel import (config as parallel_config, run_alone, run_together,
                           several_sequences_mismatch)
from test_device import ALL, chats, dev_smollm, dev_tiny, gpu  # noqa: F401 (fixtures)
from test_speculative import PROMPTS, assert_greedy_lossless, engine

pytestmark = pytest.mark.device
# What takes lavapipe minutes (SmolLM2 after 1500 tokens, 20 SmolLM2 chats, every size per weight
# type) runs with LOCALSPEC_DEVICE_FULL=1; CI's lane runs the rest (docs/gpu.md).
FULL = pytest.mark.skipif(not os.environ.get("LOCALSPEC_DEVICE_FULL"),
                          reason="minutes on lavapipe: LOCALSPEC_DEVICE_FULL=1 runs it")
TYPE_SIZES = range(2, 18) if os.environ.get("LOCALSPEC_DEVICE_FULL") else (2, 9, 17)
DEVICE_TYPES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0", "f16", "bf16", "f32")


@pytest.fixture
def exact_device(gpu):
    if not device_exact_backends():
        pytest.fail(f"this build's {'/'.join(gpu_backends())} library is not localspec's patched "
                    "one (install.sh applies the series' 0009-vulkan- or 0010-cuda-batch-"
                    "invariant-rows patch to GPU wheels)")
    with device_exact_rows_on():
        yield


def test_the_patched_gpu_library_says_so_and_its_limit_moves_at_run_time(gpu):
    assert device_exact_backends() == gpu_backends()          # Vulkan, or CUDA on an NVIDIA GPU
    try:
        assert device_exact_rows() == 0           # off until set: llama.cpp's own choices
        set_device_exact_rows(18)
        assert device_exact_rows() == 18
    finally:
        set_device_exact_rows(0)
    assert device_exact_rows() == 0


@pytest.mark.parametrize("n_prompt", [40, 1500])
@pytest.mark.parametrize("one_column", [False, True], ids=["chunks", "one-column"])
def test_every_row_of_a_verify_batch_equals_one_token_decodes_on_the_device_tiny(
        tiny_path, exact_device, n_prompt, one_column, monkeypatch):
    """Batches of 2..17 rows; past 8 rows the weight products run as chunks of at most 8
    columns, or (GGML_VK_EXACT_ONE_COLUMN, the path taken where a chunk would be misaligned)
    as one-column workgroups."""
    if one_column:
        monkeypatch.setenv("GGML_VK_EXACT_ONE_COLUMN", "1")
    assert every_row_mismatch(tiny_path, n_prompt, threads=2, gpu_layers=ALL) == []


def test_verify_batches_past_31_rows_equal_one_token_decodes_with_the_limit_raised_on_the_device(
        tiny_path, exact_device):
    """Drafts of up to 64 tokens: a lone context raises the limit around each wider verify
    decode (exact_for), on the device as on the CPU; every remainder mod 8 (the column chunks)."""
    found = every_row_mismatch(tiny_path, 40, threads=2, gpu_layers=ALL,
                               runs=[(66, [32, 33, 38, 47, 64, 65])])
    assert found == [[]]


# SmolLM2's vocabulary makes a decode on lavapipe cost ~0.5 s: in CI the sizes either side of
# the 8-column chunks after 40 tokens (the tiny model takes every size, 2..17 and past 31)
@pytest.mark.smollm
@pytest.mark.parametrize("n_prompt, sizes", [(40, (2, 9, 17)),
                                             pytest.param(1500, (2, 9, 17), marks=FULL)])
def test_every_row_of_a_verify_batch_equals_one_token_decodes_on_the_device_smollm(
        smollm_path, exact_device, n_prompt, sizes):
    assert every_row_mismatch(smollm_path, n_prompt, threads=2, sizes=sizes,
                              gpu_layers=ALL) == []


@pytest.fixture(scope="module", params=DEVICE_TYPES)
def random_two_block(request, smollm_path, tmp_path_factory):
    """SmolLM2's shape cut to two blocks, every matrix in one weight type (Q4_K_M: the default
    model's Q4_K/Q6_K mixture; Q5_K_M: Q5_K with Q6_K)."""
    folder = tmp_path_factory.getbasetemp() / "device-kernel-models"
    return random_smollm(str(smollm_path), folder, request.param, layers=2)


@pytest.mark.smollm
def test_every_row_of_a_verify_batch_equals_one_token_decodes_on_the_device_per_weight_type(
        random_two_block, exact_device):
    assert every_row_mismatch(random_two_block, 40, threads=2, sizes=TYPE_SIZES,
                              gpu_layers=ALL) == []


def test_greedy_speculative_equals_plain_with_exact_on_the_device_tiny(dev_tiny, exact_device,
                                                                       device_report):
    """No near-tie guard (tie_margin 0): with the rows exact nothing needs re-deciding."""
    fixed = assert_greedy_lossless(dev_tiny, PROMPTS, max_tokens=32, fixed_k=4, exact=True,
                                   tie_margin=0, gpu_layers=ALL)
    some = PROMPTS[::3]
    adaptive = assert_greedy_lossless(dev_tiny, some, max_tokens=32, fixed_k=None,
                                      exact=True, tie_margin=0, gpu_layers=ALL)
    device_report.append(f"tiny, --exact on device: k=4 {len(PROMPTS) - len(fixed)}/"
                         f"{len(PROMPTS)} identical to plain, adaptive "
                         f"{len(some) - len(adaptive)}/{len(some)}")
    assert fixed == [] and adaptive == []


@pytest.mark.smollm
@FULL
def test_greedy_speculative_equals_plain_with_exact_on_the_device_smollm(dev_smollm, exact_device,
                                                                         device_report):
    """Every prompt as a chat, 10 tokens each (lavapipe: ~2 tokens/s for SmolLM2)."""
    diverged = assert_greedy_lossless(dev_smollm, chats(PROMPTS), max_tokens=10, fixed_k=4,
                                      exact=True, tie_margin=0, gpu_layers=ALL)
    device_report.append(f"SmolLM2, --exact on device: {len(PROMPTS) - len(diverged)}/"
                         f"{len(PROMPTS)} identical to plain")
    assert diverged == []


def test_the_engine_trusts_the_device_batches_only_with_exact(dev_tiny, exact_device):
    with engine(dev_tiny, "ngram", fixed_k=4, exact=True, gpu_layers=ALL) as spec:
        assert spec.trusts_batches
    set_device_exact_rows(0)
    with engine(dev_tiny, "ngram", fixed_k=4, gpu_layers=ALL) as spec:
        assert not spec.trusts_batches


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_sampling_gives_the_same_text_speculative_or_not_on_the_device(
        dev_tiny, exact_device, seed):
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
    with engine(dev_tiny, "none") as plain, \
            engine(dev_tiny, "ngram", fixed_k=4, exact=True, gpu_layers=ALL) as spec:
        a = plain.generate(PROMPTS[seed], sp, max_tokens=48).complete_tokens()
        gen = spec.generate(PROMPTS[seed], sp, max_tokens=48)
        b = gen.complete_tokens()
    assert a == b and gen.stats.drafted > 0


def localspec_cli(*args, home):
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "localspec", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_exact_is_accepted_with_every_layer_on_the_device_and_gives_plain_text(
        tiny_path, gpu, tmp_path):
    """The CLI: --exact --gpu-layers -1 loads, says where the layers went, and writes what plain
    decoding writes; --exact with a layer left on the CPU and no batch-invariant CPU library
    is one error line."""
    common = ["generate", "-m", str(tiny_path), "-n", "48", "--gpu-layers", "-1",
              "abcabcabc abcabc and then"]
    spec = localspec_cli(*common, "--exact", home=tmp_path)
    plain = localspec_cli(*common, "--proposer", "none", home=tmp_path)
    assert spec.returncode == 0, spec.stderr[-2000:]
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert spec.stdout == plain.stdout and spec.stdout.strip()
    assert f"layers on {gpu.name}" in spec.stderr
    partial = localspec_cli("generate", "-m", str(tiny_path), "-n", "8", "--gpu-layers", "1",
                            "--exact", "abc", home=tmp_path)
    if partial.returncode != 0:                # the lane installs no batch-invariant CPU copy
        lines = [line for line in partial.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "--exact" in lines[0] and "--gpu-layers -1" in lines[0], \
            partial.stderr


def test_every_row_of_a_batch_of_several_sequences_equals_a_lone_decode_on_the_device(
        dev_tiny, exact_device):
    """`--parallel` slots share a decode: one llama_decode carrying 1, 6 and 12 rows of three
    sequences, each row against the same token decoded alone in a lone context on the device."""
    assert several_sequences_mismatch(dev_tiny) == []


def test_two_slots_give_their_lone_texts_with_exact_on_the_device(dev_tiny, exact_device):
    """`--parallel 2` with --exact: greedy and seeded requests, speculative, two at a time, each
    with the text it gets alone."""
    reqs = [{"prompt": p, "sampling": SamplingParams(temperature=0.8, seed=i) if i % 2
             else SamplingParams(), "max_tokens": 32, "speculate": True, "delay": 0.0}
            for i, p in enumerate(PROMPTS[:6])]
    kw = {"exact": True, "n_gpu_layers": ALL}
    alone = run_alone(dev_tiny, reqs, **kw)
    with Slots(dev_tiny, parallel_config(2, **kw), 2) as slots:
        assert run_together(slots, reqs) == alone


def test_the_device_argmax_is_refused_on_vulkan_and_greedy_text_keeps_its_rows(dev_tiny):
    """The argmax on the device (EngineConfig.device_argmax) crashed on lavapipe: on Vulkan a
    context refuses it and the engine keeps reading rows, with the same greedy text. On CUDA it
    is the recipe's overhead step that times it (scripts/bench/step_overhead.py
    --device-argmax)."""
    from localspec.llama import Context, ContextParams
    if "Vulkan" not in dev_tiny.device:
        pytest.skip(f"not Vulkan ({dev_tiny.device})")
    with Context(dev_tiny, ContextParams(512, 512, 2)) as ctx:
        assert not ctx.device_argmax(True) and not ctx.argmax_on
    from localspec.policy.config import PolicyConfig
    from localspec.speculative.engine import Engine, EngineConfig
    texts = []
    for flag in (True, False):
        config = EngineConfig(n_ctx=1024, n_threads=1, n_gpu_layers=ALL, tie_margin=0.0,
                              device_argmax=flag, policy=PolicyConfig(fixed_k=4))
        with Engine(dev_tiny, config) as e:
            texts.append([e.generate(p, SamplingParams(), max_tokens=16).complete_tokens()
                          for p in PROMPTS[:3]])
    assert texts[0] == texts[1]
