"""`localspec doctor`: what this machine's llama.cpp can do (backend, devices, where a model's
layers and KV cache go), and whether a draft fits a target. The models are loaded and decoded
in a child process (`python -m localspec.apps.doctor`), so a crash inside llama.cpp is a line of
the report; the device listing (memory probes) stays in this process, which loads nothing."""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys
from typing import Optional

import numpy as np

from ..llama import buildflags
from ..llama.buildflags import cpu_flags, read_cpuinfo
from ..catalog.models import resolve_model
from ..speculative.compat import check_pair
from ..llama.exact_rows import DEVICE_PATCHES, DEVICE_PROVEN, device_exact_backends
from ..llama.libs import exact_lib_status
from ..errors import LocalspecError
from ..llama import (Context, ContextParams, Model, ModelParams, backend_init_failures,
                     build_has_amx, default_threads, devices, gpu_backends, library_account,
                     supports_gpu_offload, system_info)
from ..llama import native
from ..llama.native import CRASH_EXIT


def device_lines() -> list:
    flags = cpu_flags(read_cpuinfo())
    amx_cpu = any(f.startswith("amx") for f in flags)
    if build_has_amx():
        amx = "this build has AMX kernels: models load without repacked weights (slower, no crash)"
    elif amx_cpu:
        amx = "CPU has AMX; this build leaves the AMX kernels out (workaround in effect, repacking on)"
    else:
        amx = "no AMX on this CPU: nothing to work around"
    features = system_info()                 # loads llama.cpp: the account below exists after it
    folder, problem = exact_lib_status()
    return [
        f"platform: {platform.system()} {platform.machine()}, {default_threads()} usable cores",
        f"llama.cpp libraries: {library_account()}",
        f"batch-invariant libraries (the default; --exact insists): {problem or folder}",
        f"llama.cpp features: {features}",
        f"GPU offload available: {gpu_offload_line(features)}",
        f"AMX: {amx}",
    ] + backend_lines()


def backend_lines() -> list:
    """The backend this build has, the devices it sees, and what install.sh would pick here now
    (a CPU build on a machine that has since gained a GPU says so)."""
    built = "/".join(gpu_backends()) or "CPU"
    lines = [f"backend: {built} (this build)"]
    for name in device_exact_backends():
        proven = DEVICE_PROVEN.get(name)
        checked = f"checked bit for bit on {proven}" if proven else \
            "compiled, not yet checked on such a GPU: `pytest -m device` checks it on yours"
        lines.append(f"  {name}: localspec's batch-invariant rows (patch {DEVICE_PATCHES[name]}):"
                     f" off by default, on with --exact and every layer on the device; {checked}"
                     f" (docs/gpu.md)")
    for d in devices():
        memory = f", {d.free_mib} MiB free of {d.total_mib}" if d.total_mib else ""
        lines.append(f"  device {d.name}: {d.description} ({d.type}{memory})")
    if built != "CPU" and not any(d.type in ("GPU", "IGPU") for d in devices()):
        why = "".join(f" ({f})" for f in backend_init_failures())
        lines.append(f"  no {built} device found{why}: --gpu-layers will refuse; install the "
                     "driver" + (", or set GGML_VK_VISIBLE_DEVICES=0 for a CPU-type Vulkan "
                                 "device (lavapipe)" if built == "Vulkan" else ""))
    try:
        plan = buildflags.host_plan()
        lines.append(f"install.sh here would build: {plan.backend} ({plan.reason})")
    except buildflags.BackendError as e:
        lines.append(f"install.sh here would stop: {e}")
    return lines


GPU_BACKENDS = ("CUDA", "METAL", "VULKAN", "HIP", "ROCM", "SYCL", "CANN", "OPENCL", "MUSA")


def gpu_offload_line(features: str) -> str:
    """llama.cpp says it "supports GPU offload" when only the RPC backend is built (layers can go
    to other hosts); say which it is."""
    if not supports_gpu_offload():
        return "no (CPU build)"
    built = gpu_backends()          # llama.cpp's feature line does not name every GPU backend
    if built:
        return f"yes ({'/'.join(built)})"
    if any(name in features.upper() for name in GPU_BACKENDS):
        return "yes"
    return "no GPU backend in this build; layers can go to RPC servers (--rpc)"


def model_lines(label: str, model: Model) -> list:
    return [f"{label}: {model.path}", f"  {model.describe()}, vocab {model.n_vocab} "
            f"(type {model.vocab_type()}), bos {model.bos}, eos {model.eos}, "
            f"chat template: {'yes' if model.chat_template() else 'no'}"]


def placement_lines(model: Model) -> list:
    """Where the layers went and where the KV cache lives (it follows its layer's device)."""
    if not model.n_gpu_layers:
        return ["  layers: all on the CPU (--gpu-layers 0); KV cache in RAM"]
    if not model.placement:
        return [f"  layers: all on the CPU (asked for {model.n_gpu_layers}); KV cache in RAM"]
    return [f"  layers: {model.placement}; KV cache of each layer on that layer's device"]


def report(target: str, draft: Optional[str], gpu_layers: int = 0) -> tuple:
    """Lines of the report, and whether the pair (if any) is compatible and nothing crashed.
    The models are loaded and decoded in a child process (probe_in_child): a crash inside
    llama.cpp (a GPU driver, a backend) becomes a line of this report, not the end of it."""
    paths = [str(resolve_model(target))] + ([str(resolve_model(draft))] if draft else [])
    found, crash = probe_in_child(paths, gpu_layers)
    lines = device_lines()
    if crash is not None:
        return lines + [f"target: {paths[0]}", f"  the load-and-decode check {crash}"], False
    lines += found["target"]
    if draft is None:
        return lines, True
    lines += found["draft"]
    pair = found["pair"]
    lines.append(f"checked {pair['checked']} shared token ids")
    if pair["ok"]:
        lines.append("compatible: the draft can propose tokens for this target")
    else:
        lines += ["INCOMPATIBLE:"] + [f"  - {p}" for p in pair["problems"]]
        lines.append("  use a draft from the same model family (same tokenizer), e.g. "
                     "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b")
    return lines, pair["ok"]


def probe_in_child(paths: list, gpu_layers: int, crash_test: Optional[int] = None) -> tuple:
    """(what probe() found, None), or (None, the crash line) when the child crashed inside
    native code (it exits with native.CRASH_EXIT after writing that line and its report).
    The child's other stderr lines pass through; its one-line errors are raised here.
    crash_test (tests only): the child crashes on purpose after loading (native.test_crash)."""
    proc = subprocess.run([sys.executable, "-m", "localspec.apps.doctor", json.dumps(
        {"paths": paths, "gpu_layers": gpu_layers, "crash_test": crash_test})],
        capture_output=True, text=True)
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in said if line.startswith("error: ")]
    for line in said:
        if line not in errors:
            print(line, file=sys.stderr)
    if proc.returncode == 0:
        return json.loads(proc.stdout), None
    if proc.returncode == CRASH_EXIT and errors:
        return None, errors[-1][len("error: "):]
    if proc.returncode < 0:          # LOCALSPEC_CRASH_GUARD=0: the bare signal
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return None, f"died of {name} (no report: LOCALSPEC_CRASH_GUARD=0)"
    if errors:
        raise LocalspecError(errors[-1][len("error: "):])
    raise LocalspecError(f"the doctor's model check failed (exit {proc.returncode}): "
                         f"{said[-1] if said else 'no message'}")


def probe(paths: list, gpu_layers: int, crash_test: Optional[int] = None) -> dict:
    """In the child: load the target (and draft), decode a prompt and a verify-sized batch on
    the device asked for, compare the pair. Runs llama.cpp the way an engine does."""
    found: dict = {}
    with Model(paths[0], ModelParams(n_gpu_layers=gpu_layers)) as t:
        if crash_test is not None:
            native.set_phase(f"in llama.cpp while testing the crash guard with {t.path.name} "
                             f"on {t.device} {t.crash_hint}")
            native.test_crash(crash_test)
        found["target"] = model_lines("target", t) + placement_lines(t) + decode_lines(t)
        if len(paths) > 1:
            with Model(paths[1], ModelParams(n_gpu_layers=gpu_layers)) as d:
                found["draft"] = model_lines("draft", d)
                r = check_pair(t, d)
            found["pair"] = {"ok": r.ok, "problems": list(r.problems),
                             "checked": r.facts["shared_ids_checked"]}
    return found


VERIFY_ROWS = 9          # a verify batch of [last] + 8 drafts


def decode_lines(model: Model) -> list:
    """Decode a short prompt, then one verify-sized batch, where the engine would."""
    with Context(model, ContextParams(n_ctx=256, n_batch=64)) as ctx:
        prompt = model.tokenize("The capital of France is") or [model.bos]
        row = ctx.decode(prompt, logits="last")[0]
        batch = [int(row.argmax())] * VERIFY_ROWS
        rows = ctx.decode(batch, logits="all")
        finite = bool(np.isfinite(rows).all())
    verdict = "ok" if finite else "NaN or infinite logits"
    return [f"  decode: a prompt of {len(prompt)} tokens and a batch of {VERIFY_ROWS} on "
            f"{model.device}: {verdict}"]


def _child_main(argv: list) -> int:
    args = json.loads(argv[0])
    try:
        found = probe(args["paths"], args["gpu_layers"], args.get("crash_test"))
    except LocalspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
