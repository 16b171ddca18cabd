"""Prefill tokens/s of one library set, for comparing library sets in alternating processes.

Decodes a chat prompt like the main job's (data/workloads/mainjob-workload.jsonl: summarize
localspec/speculative/verify.py; ~900 tokens with the default model) from an empty cache in the engine's
prefill chunks (PREFILL_GRID), after a 32-token warm-up, `--reps` times;
prints one JSON line with the libraries this process loaded and every rate. Which libraries load
is the caller's choice: LOCALSPEC_EXACT=0 for llama.cpp's own, LLAMA_CPP_LIB_PATH for a folder.
Usage: python scripts/bench/prefill_rate.py [-m MODEL] [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from localspec.catalog.models import resolve_model
from localspec.llama import (PREFILL_GRID, Context, ContextParams, Model, ModelParams,
                             library_account, system_info)

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    case = json.loads((ROOT / "data" / "workloads" / "mainjob-workload.jsonl").read_text().splitlines()[0])
    source = (ROOT / "localspec" / "speculative" / "verify.py").read_text()
    messages = [{"role": "user", "content": f"{case['instruction']}\n\n{source}"}]
    with Model(str(resolve_model(a.model)), ModelParams()) as model, \
            Context(model, ContextParams(n_ctx=2048, n_threads=a.threads)) as ctx:
        text = model.apply_chat_template(messages, add_assistant=True)
        tokens = model.tokenize(text, add_special=True, parse_special=True)
        ctx.decode(tokens[:32], logits="none")
        rates = []
        for _ in range(a.reps):
            ctx.truncate(0)
            t0 = time.perf_counter()
            for i in range(0, len(tokens), PREFILL_GRID):
                ctx.decode(tokens[i:i + PREFILL_GRID], logits="none")
            rates.append(len(tokens) / (time.perf_counter() - t0))
    print(json.dumps({"libraries": library_account(), "features": system_info(),
                      "tokens": len(tokens), "threads": a.threads,
                      "prefill_tok_s": [round(r, 2) for r in rates]}))


if __name__ == "__main__":
    main()
