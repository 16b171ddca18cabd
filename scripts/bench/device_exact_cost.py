#!/usr/bin/env python3
"""What a GPU backend's batch-invariant rows cost (patch 0009 on Vulkan): the verify cost curve
r(k) (a batch of k+1 rows, all logits, in one-token decodes) with the row limit off (llama.cpp's
own choices) and on (--exact), measured side by side: every round times each size in both modes
in turn, after the same context, and the medians are compared.

    .venv-device/bin/python scripts/bench/device_exact_cost.py MODEL [--ctx 40] [--rounds 7]

Prints one row per k: the median milliseconds off and on, r(k) off and on, and on/off. Needs a
GPU build whose backend carries the patch (localspec doctor --build-only says so); on a
machine without a GPU, GGML_VK_VISIBLE_DEVICES=0 shows it Mesa's lavapipe. Speed on lavapipe is
the CPU's, so its figures describe the shaders' work, not a GPU's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from localspec.llama import Context, ContextParams, Model, ModelParams  # noqa: E402
from localspec.llama.exact_rows import (device_exact_backends,  # noqa: E402
                                        set_device_exact_rows)

TEXT = "Speculative decoding verifies many drafted tokens at once, then keeps the longest " \
       "prefix the target agrees with. "


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=40, help="tokens of context before the batches")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--k", default="0,1,2,4,8,16", help="draft lengths (k+1 rows)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not device_exact_backends():
        print("device_exact_cost.py: this build has no GPU backend with localspec's batch-"
              "invariant rows (patch 0009); build for Vulkan with ./install.sh", file=sys.stderr)
        return 1
    ks = [int(k) for k in a.k.split(",")]
    times = {(k, mode): [] for k in ks for mode in ("off", "on")}
    with Model(a.model, ModelParams(n_gpu_layers=-1)) as model, \
            Context(model, ContextParams(n_ctx=a.ctx + max(ks) + 64,
                                         n_threads=a.threads)) as ctx:
        ctx.decode(model.tokenize(TEXT * 80)[:a.ctx], logits="none")
        base = ctx.n_past
        tokens = [(97 * i + 11) % model.n_vocab for i in range(max(ks) + 1)]
        try:
            for r in range(a.rounds + 1):                 # round 0 warms every pipeline
                for k in ks:
                    for mode in ("off", "on"):
                        set_device_exact_rows(32 if mode == "on" else 0)
                        ctx.truncate(base)
                        t0 = time.perf_counter()
                        ctx.decode(tokens[:k + 1], logits="all")
                        if r:
                            times[(k, mode)].append(time.perf_counter() - t0)
        finally:
            set_device_exact_rows(0)
    med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    print(f"# {Path(a.model).name}, {a.ctx} tokens of context, {a.rounds} rounds, medians")
    print("k  rows  off ms    on ms   r(k) off  r(k) on  on/off")
    for k in ks:
        off, on = med[(k, "off")], med[(k, "on")]
        print(f"{k:<2} {k + 1:>4} {off:8.1f} {on:8.1f} {off / med[(ks[0], 'off')]:9.2f} "
              f"{on / med[(ks[0], 'on')]:8.2f} {on / off:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
