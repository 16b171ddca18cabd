"""`localspec doctor`: what this machine's llama.cpp can do (backend, devices, where a model's
layers and KV cache go), and whether a draft fits a target."""

from __future__ import annotations

import platform
from typing import Optional

from ..llama import buildflags
from ..llama.buildflags import cpu_flags, read_cpuinfo
from ..catalog.models import resolve_model
from ..speculative.compat import check_pair
from ..llama.libs import exact_lib_status
from ..llama import (Model, ModelParams, backend_init_failures, build_has_amx, default_threads,
                     devices, gpu_backends, library_account, supports_gpu_offload, system_info)


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
    """Lines of the report, and whether the pair (if any) is compatible."""
    lines = device_lines()
    with Model(resolve_model(target), ModelParams(n_gpu_layers=gpu_layers)) as t:
        lines += model_lines("target", t) + placement_lines(t)
        if draft is None:
            return lines, True
        with Model(resolve_model(draft), ModelParams(n_gpu_layers=gpu_layers)) as d:
            lines += model_lines("draft", d)
            r = check_pair(t, d)
    lines.append(f"checked {r.facts['shared_ids_checked']} shared token ids")
    if r.ok:
        lines.append("compatible: the draft can propose tokens for this target")
    else:
        lines += ["INCOMPATIBLE:"] + [f"  - {p}" for p in r.problems]
        lines.append("  use a draft from the same model family (same tokenizer), e.g. "
                     "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b")
    return lines, r.ok
