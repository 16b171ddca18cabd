"""The device lane: localspec with its models on a GPU device (--gpu-layers -1), run by
`pytest -m device` on a GPU build (scripts/ci/device_lane.sh: Vulkan, on Mesa's lavapipe where there
is no GPU). Weights and KV cache live in device buffers, the graph is split between backends and
states are copied to and from the device: the paths CUDA and Metal take too.

Checked here: greedy speculative == plain greedy on the device (n-gram, draft, hybrid); device
vs CPU greedy identity, with the top-2 gap at every divergence (reported, and held to the
near-tie rule); the random request-sequence property test; prompt-cache save/restore of device
KV (RAM, disk, a fresh context); partial and over-asked offload; calibration keyed by device and
layers; serve --stdio and --http answering from the device. Numbers go to the "device report".
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localspec.llama import Context, ContextParams, Model, ModelParams, devices, gpu_backends
from localspec.policy.calibrate import curve_key
from localspec.policy.config import PolicyConfig
from localspec.speculative.engine import Engine, EngineConfig
from localspec.speculative.factory import load_model
from test_engine_state import N_CTX, PROMPTS as STATE_PROMPTS, FlakyProposer, request, run
from test_speculative import PROMPTS, TIE_GAP, assert_greedy_lossless, first_divergence, top2_gap
from tinymodel import make_tiny_gguf

pytestmark = pytest.mark.device
ALL = -1
# Minutes on lavapipe (2 vCPUs): run with LOCALSPEC_DEVICE_FULL=1; CI's lane skips them so that it
# stays inside CI's hour (docs/gpu.md, "The lane and CI").
FULL = pytest.mark.skipif(not os.environ.get("LOCALSPEC_DEVICE_FULL"),
                          reason="minutes on lavapipe: LOCALSPEC_DEVICE_FULL=1 runs it")


@pytest.fixture(scope="session")
def gpu():
    """The device the lane runs on; no device fails the lane rather than skipping it."""
    found = [d for d in devices() if d.type in ("GPU", "IGPU")]
    if not found:
        pytest.fail(f"no GPU device ({'/'.join(gpu_backends()) or 'a CPU build'}); run "
                    "scripts/ci/device_lane.sh, which builds for Vulkan and shows it lavapipe")
    return found[0]


@pytest.fixture(scope="module")
def dev_tiny(tiny_path, gpu):
    with Model(tiny_path, ModelParams(n_gpu_layers=ALL)) as model:
        yield model


@pytest.fixture(scope="module")
def dev_smollm(smollm_path, gpu):
    with Model(smollm_path, ModelParams(n_gpu_layers=ALL)) as model:
        yield model


@pytest.fixture(scope="module")
def tiny_drafts(tiny_dir):
    return {"noisy": make_tiny_gguf(tiny_dir / "dev-draft-noisy.gguf", seed=0, logit_scale=3.0,
                                    noise=0.2),
            "unrelated": make_tiny_gguf(tiny_dir / "dev-draft-unrelated.gguf", seed=1,
                                        logit_scale=3.0)}


def chats(prompts):
    return [[{"role": "user", "content": f"Repeat exactly: {p}"}] for p in prompts]


# -- placement ---------------------------------------------------------------------------------

def test_every_layer_and_the_kv_cache_go_to_the_device(dev_tiny, gpu, tiny_path, tmp_path):
    assert dev_tiny.placement.startswith(f"3/3 layers on {gpu.name}"), dev_tiny.placement
    out = subprocess.run([sys.executable, "-m", "localspec", "doctor", str(tiny_path),
                          "--gpu-layers", "-1"], capture_output=True, text=True,
                         env=home_env(tmp_path))
    assert out.returncode == 0, out.stderr
    assert f"device {gpu.name}: " in out.stdout and f"layers: 3/3 layers on {gpu.name}" in out.stdout
    assert "KV cache of each layer on that layer's device" in out.stdout


def test_partial_offload_puts_some_layers_on_the_device_and_says_so(smollm_path, gpu, capfd,
                                                                     device_report):
    with load_model(smollm_path, n_gpu_layers=10) as model:
        assert model.placement.startswith(f"10/{model.n_layer + 1} layers on {gpu.name}")
        with Engine(model, EngineConfig(proposer="ngram", n_ctx=1024, n_threads=1,
                                        n_gpu_layers=10, policy=PolicyConfig(fixed_k=4))) as eng:
            out = eng.generate("abcabcabcabc", max_tokens=16).complete_tokens()
        assert len(out) > 0
    err = capfd.readouterr().err
    assert f"smollm2-135m-instruct-q4_1.gguf: 10/{model.n_layer + 1} layers on {gpu.name}" in err
    device_report.append(f"partial offload: {err.strip().splitlines()[-1]}")


def test_more_layers_than_the_model_has_are_clamped_and_said(tiny_path, gpu, capfd):
    with load_model(tiny_path, n_gpu_layers=99) as model:
        assert model.placement.startswith("3/3 layers")
    err = capfd.readouterr().err
    assert "3/3 layers on" in err and "asked for 99: clamped to the model's 3" in err


def _load_log(tiny_path, tmp_path, layers: int) -> list:
    """llama.cpp's own log (LOCALSPEC_LOG_SINK=stderr: it prints every level itself) of a model
    load, a context and one decode at `layers`, in a fresh process."""
    code = ("import sys\n"
            "from localspec.llama import Context, ContextParams, Model, ModelParams\n"
            "with Model(sys.argv[1], ModelParams(n_gpu_layers=int(sys.argv[2]))) as m:\n"
            "    with Context(m, ContextParams(256, n_threads=1)) as c:\n"
            "        c.decode([1, 2, 3])\n")
    env = {**home_env(tmp_path), "LOCALSPEC_LOG_SINK": "stderr"}
    r = subprocess.run([sys.executable, "-c", code, str(tiny_path), str(layers)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stderr.splitlines()


def test_a_zero_layer_load_on_a_gpu_build_gives_llama_cpp_no_device(tiny_path, gpu, tmp_path):
    """Issue 41: --gpu-layers 0 passes an empty device list, so llama.cpp uses no device (no
    device context, no VRAM); with every layer asked for, the same log names the device."""
    full = _load_log(tiny_path, tmp_path, ALL)
    assert any(f"using device {gpu.name}" in line for line in full), "\n".join(full[-40:])
    zero = _load_log(tiny_path, tmp_path, 0)
    assert not [line for line in zero if "using device" in line]
    assert not [line for line in zero if gpu.name in line and "buffer" in line]


# -- greedy identity ---------------------------------------------------------------------------

def test_greedy_speculative_equals_plain_on_the_device_tiny(dev_tiny, device_report):
    fixed = assert_greedy_lossless(dev_tiny, PROMPTS, max_tokens=32, fixed_k=4, gpu_layers=ALL)
    adaptive = assert_greedy_lossless(dev_tiny, PROMPTS[:6], max_tokens=32, fixed_k=None,
                                      gpu_layers=ALL)
    device_report.append(f"tiny, n-gram on device: k=4 {20 - len(fixed)}/20 identical to plain, "
                         f"adaptive {6 - len(adaptive)}/6; divergences (pos, top-2 gap): "
                         f"{[(d, round(g, 3)) for _, d, g in fixed + adaptive]}")
    assert len(fixed) <= 2 and len(adaptive) <= 2


@pytest.mark.smollm
@FULL              # 5 min on lavapipe; CI's lane has SmolLM2's exact rows (test_device_exact.py)
def test_greedy_speculative_equals_plain_on_the_device_smollm(dev_smollm, device_report):
    # Five chats, 24 tokens: SmolLM2 decodes at ~1.6 tok/s on lavapipe (2 vCPUs).
    diverged = assert_greedy_lossless(dev_smollm, chats(PROMPTS[::4]), max_tokens=24, fixed_k=4,
                                      gpu_layers=ALL)
    device_report.append(f"SmolLM2, n-gram on device: {5 - len(diverged)}/5 identical to "
                         f"plain; divergences (pos, top-2 gap): "
                         f"{[(d, round(g, 3)) for _, d, g in diverged]}")


@pytest.mark.parametrize("proposer, which", [("draft", "noisy"), ("draft", "unrelated"),
                                             ("hybrid", "noisy")])
def test_greedy_with_a_draft_model_on_the_device_equals_plain(dev_tiny, tiny_drafts, proposer,
                                                             which):
    diverged = assert_greedy_lossless(dev_tiny, PROMPTS[::2], max_tokens=24, fixed_k=4,
                                      proposer=proposer, draft=tiny_drafts[which], gpu_layers=ALL)
    assert len(diverged) <= 2, diverged


def test_target_and_draft_both_offloaded_and_the_draft_judged_on_device_curves(
        dev_tiny, tiny_model, tiny_drafts, gpu, monkeypatch, tmp_path, device_report):
    """The draft model goes where the target's layers go, and whether it can pay is decided on
    curves measured on the device, cached under keys that name it (not the CPU's)."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    cfg = EngineConfig(proposer="hybrid", n_ctx=1024, n_threads=1, n_gpu_layers=ALL,
                       draft=str(tiny_drafts["noisy"]))
    with Engine(dev_tiny, cfg) as eng:
        draft = eng.proposer.draft_model.model
        assert draft.placement.startswith(f"3/3 layers on {gpu.name}"), draft.placement
        gen = eng.generate("abcabcabc, then something new: qzx", max_tokens=24)
        gen.complete()
        keys = {p.stem for p in (tmp_path / "calibration").glob("*.json")}
        device_key = curve_key(eng.ctx, ALL, cfg.policy.k_max)
        kept = eng.proposer is not None and eng.proposer.uses_draft_model
    with Context(tiny_model, ContextParams(1024, n_threads=1)) as cpu_ctx:
        cpu_key = curve_key(cpu_ctx, 0, cfg.policy.k_max)
    assert device_key in keys and cpu_key not in keys and len(keys) == 2   # target's, draft's
    device_report.append(f"tiny target + tiny draft, both on device: draft model kept: {kept}; "
                         f"drafted by source {gen.stats.drafted_by_source}")


def identity_vs_cpu(dev_model, cpu_model, prompts, max_tokens):
    """Plain greedy on the device vs on the CPU, same build: (identical count, [(pos, CPU top-2
    gap, device top-2 gap)] at each divergence, mean decode tok/s on the device, on the CPU)."""
    same, diverged, tps = 0, [], {"dev": [], "cpu": []}
    # One CPU thread: lavapipe runs its own threads, and two spinning thread pools on two cores
    # (or beside another job) slow both down by an order of magnitude.
    cfg = EngineConfig(proposer="none", n_ctx=1024, n_threads=1, cache_mb=0)
    with Engine(dev_model, cfg) as dev, Engine(cpu_model, cfg) as cpu:
        for prompt in prompts:
            outs = {}
            for name, eng in (("dev", dev), ("cpu", cpu)):
                gen = eng.generate(prompt, max_tokens=max_tokens)
                outs[name] = gen.complete_tokens()
                tps[name].append(gen.stats.decode_tokens_per_s)
            d = first_divergence(outs["cpu"], outs["dev"])
            if d is None:
                same += 1
                continue
            prefix = cpu.tokenize_prompt(prompt) + outs["cpu"][:d]
            diverged.append((d, round(top2_gap(cpu_model, prefix), 4),
                             round(top2_gap(dev_model, prefix), 4)))
    return same, diverged, float(np.mean(tps["dev"])), float(np.mean(tps["cpu"]))


def test_device_and_cpu_agree_up_to_near_ties_tiny(dev_tiny, tiny_model, device_report):
    same, diverged, dev_tps, cpu_tps = identity_vs_cpu(dev_tiny, tiny_model, PROMPTS, 32)
    device_report.append(f"tiny, device vs CPU plain greedy: {same}/{len(PROMPTS)} identical; "
                         f"divergences (pos, CPU top-2 gap, device top-2 gap): {diverged}; "
                         f"decode {dev_tps:.1f} tok/s device, {cpu_tps:.1f} CPU")
    assert all(cpu_gap < TIE_GAP for _, cpu_gap, _ in diverged), diverged


@pytest.mark.smollm
@FULL              # 2.5 min on lavapipe; the tiny model's version runs in CI
def test_device_and_cpu_agree_up_to_near_ties_smollm(dev_smollm, smollm, device_report):
    prompts = chats(PROMPTS[::4])
    same, diverged, dev_tps, cpu_tps = identity_vs_cpu(dev_smollm, smollm, prompts, 24)
    device_report.append(f"SmolLM2, device vs CPU plain greedy: {same}/{len(prompts)} identical; "
                         f"divergences (pos, CPU top-2 gap, device top-2 gap): {diverged}; "
                         f"decode {dev_tps:.1f} tok/s device, {cpu_tps:.1f} CPU (1 thread)")
    assert all(cpu_gap < TIE_GAP for _, cpu_gap, _ in diverged), diverged


# -- KV bookkeeping on the device ----------------------------------------------------------------

@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=2, max_size=6), k=st.sampled_from([None, 1, 4]))
def test_any_request_sequence_leaves_the_device_engine_as_good_as_new(dev_tiny, requests, k):
    """tests/test_engine_state.py's property, with the KV cache in device memory: empty,
    over-long, cancelled, failing and normal requests in any order; every normal request's
    output equals a fresh engine's, and the KV cache holds exactly the rows the engine thinks."""
    proposer = FlakyProposer()
    cfg = EngineConfig(proposer="ngram", n_ctx=N_CTX, n_threads=1, n_gpu_layers=ALL,
                       policy=PolicyConfig(fixed_k=k))
    with Engine(dev_tiny, cfg, proposer=proposer) as engine:
        for req in requests:
            run(engine, proposer, req)
            assert engine.ctx.rows_held() == engine.ctx.n_past, req
            assert engine.ctx.n_past < N_CTX
        run(engine, proposer, ("normal", STATE_PROMPTS[0], True, 16))


# -- prompt cache with device KV ---------------------------------------------------------------

def test_a_device_kv_state_restores_into_a_fresh_context_identically(dev_tiny):
    prefix = dev_tiny.tokenize("def alpha(x): return x * 3\n" * 6)
    rest = dev_tiny.tokenize("alpha(2) is", add_special=False)
    with Context(dev_tiny, ContextParams(1024, n_threads=1)) as ref:
        ref.decode(prefix, logits="none")
        want = ref.decode(rest, logits="all").copy()
    with Context(dev_tiny, ContextParams(1024, n_threads=1)) as src:
        src.decode(prefix, logits="none")
        state = src.save_state().copy()          # copied out of device buffers
    with Context(dev_tiny, ContextParams(1024, n_threads=1)) as dst:
        dst.decode(dev_tiny.tokenize("other rows the restore replaces"), logits="none")
        dst.restore_state(state, prefix)
        assert dst.n_past == len(prefix)
        assert np.array_equal(dst.decode(rest, logits="all"), want)


def test_prompt_cache_reuses_device_kv_from_ram_and_disk(dev_tiny, monkeypatch, tmp_path,
                                                        device_report):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    docs = [f"def {n}(x): return x * {i}\n" * 8 + "Q: what does it return?"
            for i, n in enumerate(("alpha", "beta"))]
    cfg = EngineConfig(proposer="ngram", n_ctx=1024, n_threads=1, n_gpu_layers=ALL,
                       cache_mb=64, cache_disk=True, policy=PolicyConfig(fixed_k=4))
    with Engine(dev_tiny, cfg) as eng:
        cold = eng.generate(docs[0], max_tokens=16)
        want = cold.complete_tokens()
        eng.generate(docs[1], max_tokens=16).complete()      # the live KV moves to doc B
        ram = eng.generate(docs[0], max_tokens=16)
        assert ram.complete_tokens() == want
        assert ram.stats.reused_by_source.get("ram", 0) > 0, ram.stats.reused_by_source
    with Engine(dev_tiny, cfg) as fresh:                      # empty RAM cache: disk only
        disk = fresh.generate(docs[0], max_tokens=16)
        assert disk.complete_tokens() == want
        assert disk.stats.reused_by_source.get("disk", 0) > 0, disk.stats.reused_by_source
    device_report.append(f"prompt cache on device: reused {ram.stats.reused_by_source} then "
                         f"{disk.stats.reused_by_source} of {cold.stats.prompt_tokens} prompt tokens")


# -- calibration and the servers ----------------------------------------------------------------

def home_env(tmp_path) -> dict:
    return {**os.environ, "LOCALSPEC_HOME": str(tmp_path / "home")}


def calibrate(tiny_path, tmp_path, layers: int) -> str:
    out = subprocess.run([sys.executable, "-m", "localspec", "calibrate", "-m", str(tiny_path),
                          "--gpu-layers", str(layers), "--threads", "1"], capture_output=True,
                         text=True, env=home_env(tmp_path))
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_calibrate_on_the_device_is_cached_apart_from_other_layer_counts(tiny_path, tmp_path,
                                                                         gpu, device_report):
    curves = tmp_path / "home" / "calibration"
    found = []
    for layers in (ALL, 1, 0):
        text = calibrate(tiny_path, tmp_path, layers)
        assert "r(k):" in text
        found.append(len(list(curves.glob("*.json"))))
        if layers == ALL:
            device_report.append("calibrate, tiny on device: " +
                                 " | ".join(text.strip().splitlines()[:3]))
    assert found == [1, 2, 3]          # device, 1 layer and CPU: three curves, three keys


def test_serve_stdio_answers_with_the_model_on_the_device(tiny_path, tmp_path, gpu):
    from test_serve import Server

    srv = Server(tiny_path, tmp_path, "--gpu-layers", "-1", "--ctx", "2048")
    try:
        res = srv.call("generate", {"prompt": "abcabcabc", "max_tokens": 12, "stream": False})
        assert "result" in res and res["result"]["text"], res
        assert f"layers on {gpu.name}" in srv.err()
    finally:
        assert srv.close() == 0


def test_serve_http_answers_with_the_model_on_the_device(tiny_path, tmp_path, gpu):
    from test_http import KEY, Server as HttpServer

    srv = HttpServer(tiny_path, tmp_path, "--api-key", KEY, "--gpu-layers", "-1", "--ctx", "2048")
    try:
        reply = srv.client().completions.create(model=tiny_path.stem, prompt="abcabcabc",
                                                max_tokens=12, temperature=0)
        assert reply.choices[0].text
        assert f"layers on {gpu.name}" in srv.err()
    finally:
        srv.close()


@pytest.mark.parametrize("hide", [
    {"GGML_VK_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": ""},     # no device visible
    {"VK_ICD_FILENAMES": "/nonexistent/icd.json"},                     # no Vulkan driver at all
])
def test_a_gpu_build_without_its_device_refuses_in_one_line(tiny_path, gpu, tmp_path, hide):
    """The device or its driver missing (as on a machine without them): one line with the fix,
    exit 1, no crash."""
    if "VK_ICD_FILENAMES" in hide and not gpu.name.startswith("Vulkan"):
        pytest.skip(f"{gpu.name} is not a Vulkan device: hiding Vulkan's driver hides nothing")
    env = {**home_env(tmp_path), **hide}
    r = subprocess.run([sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path),
                        "-n", "4", "--gpu-layers", "-1", "hello"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert "found no device" in r.stderr and "LOCALSPEC_BACKEND=cpu ./install.sh" in r.stderr
