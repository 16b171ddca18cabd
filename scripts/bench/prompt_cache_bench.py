"""Measure what the prompt cache costs and saves on this machine, for one model:

  evaluate N prompt tokens from scratch     vs   save / restore their KV state (RAM)
  write / read + verify a cache file (disk) vs   the same evaluation

and, with --compare-seq-cp, the design alternative the cache did not take: cached prefixes kept as
extra sequences of one unified KV cache and switched into seq 0 with llama_memory_seq_cp, whose
switch is nearly free but whose cells every later decode attends over.

Usage (from the repository root, with its .venv):
  python scripts/bench/prompt_cache_bench.py smollm2-135m -n 1000 --threads 2 --compare-seq-cp
Prints one JSON object (medians in ms) on stdout; record it with `uptime` load and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from localspec.cache.format import context_key, read_file, write_file
from localspec.catalog.models import resolve_model
from localspec.llama import Context, ContextParams, Model

clock = time.perf_counter


def prompt_tokens(model: Model, n: int) -> list:
    """n tokens of real code (this repository's sources), so the text is not degenerate."""
    sources = sorted(Path(__file__).parents[2].glob("localspec/**/*.py"))
    text = "".join(p.read_text() for p in sources)
    tokens = model.tokenize(text)
    if len(tokens) < n:
        raise SystemExit(f"only {len(tokens)} tokens of source text; ask for fewer")
    return tokens[:n]


def state_numbers(model: Model, tokens: list, threads: int, repeats: int) -> dict:
    n = len(tokens)
    with Context(model, ContextParams(n_ctx=n + 64, n_threads=threads)) as ctx:
        evaluate, save, restore, write, read = [], [], [], [], []
        folder = Path(tempfile.mkdtemp(prefix="lspc-bench-"))
        path = folder / "entry.lskv"
        for _ in range(repeats):               # interleaved: each round measures every path once
            ctx.clear()
            t = clock()
            ctx.decode(tokens, logits="last")
            evaluate.append(clock() - t)
            t = clock()
            state = ctx.save_state()
            save.append(clock() - t)
            ctx.clear()
            t = clock()
            ctx.restore_state(state, tokens)
            restore.append(clock() - t)
            t = clock()
            size = write_file(path, context_key(ctx), tokens, state, model.path.name)
            write.append(clock() - t)
            t = clock()
            _, _, data = read_file(path, context_key(ctx))
            read.append(clock() - t)
        os.unlink(path)
        os.rmdir(folder)
    ms = lambda xs: round(1000 * statistics.median(xs), 2)
    return {"tokens": n, "state_bytes": int(state.size), "file_bytes": size,
            "bytes_per_token": round(state.size / n, 1),
            "evaluate_ms": ms(evaluate), "save_ms": ms(save), "restore_ms": ms(restore),
            "file_write_ms": ms(write), "file_read_verify_ms": ms(read)}


def seq_cp_numbers(model: Model, tokens: list, threads: int, others: int, repeats: int) -> dict:
    """The alternative design, measured with llama_cpp directly: localspec does not implement
    it (this script is its one caller), so it stays out of localspec.llama."""
    import llama_cpp as C

    n = len(tokens)
    cp = C.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = (others + 2) * (n + 64), others + 2, True
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = C.llama_init_from_model(model._model, cp)
    mem = C.llama_get_memory(ctx)
    batch = C.llama_batch_init(512, 0, 1)

    def decode(toks, seq, pos0):
        for start in range(0, len(toks), 512):
            chunk = toks[start:start + 512]
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos0 + start + i, 1
                batch.seq_id[i][0], batch.logits[i] = seq, i == len(chunk) - 1
            batch.n_tokens = len(chunk)
            assert C.llama_decode(ctx, batch) == 0

    for seq in range(1, others + 1):          # distinct cells: each prefix decoded on its own
        decode(tokens[seq:] + tokens[:seq], seq, 0)
    decode(tokens, others + 1, 0)
    plain = Context(model, ContextParams(n_ctx=n + 64, n_threads=threads))
    plain.decode(tokens, logits="none")
    switch, step_shared, step_plain = [], [], []
    for _ in range(repeats):
        t = clock()
        C.llama_memory_seq_rm(mem, 0, -1, -1)
        C.llama_memory_seq_cp(mem, others + 1, 0, -1, -1)
        switch.append(clock() - t)
        t = clock()
        decode([tokens[7]], 0, n)
        step_shared.append(clock() - t)
        C.llama_memory_seq_rm(mem, 0, n, -1)
        t = clock()
        plain.decode([tokens[7]], logits="last")
        step_plain.append(clock() - t)
        plain.truncate(n)
    plain.close()
    C.llama_batch_free(batch)
    C.llama_free(ctx)
    ms = lambda xs: round(1000 * statistics.median(xs), 3)
    return {"seq_cp_switch_ms": ms(switch), "cached_prefixes_beside_seq0": others,
            "one_token_decode_ms_unified_with_cached": ms(step_shared),
            "one_token_decode_ms_plain_context": ms(step_plain)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=1000, help="prompt tokens (default 1000)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compare-seq-cp", action="store_true")
    ap.add_argument("--others", type=int, default=3, help="cached prefixes beside seq 0")
    args = ap.parse_args()
    with Model(resolve_model(args.model)) as model:
        tokens = prompt_tokens(model, args.n)
        out = {"model": model.path.name, "threads": args.threads,
               "load_before": os.getloadavg()[0]}
        out.update(state_numbers(model, tokens, args.threads, args.repeats))
        if args.compare_seq_cp:
            out.update(seq_cp_numbers(model, tokens, args.threads, args.others, 10))
        out["load_after"] = os.getloadavg()[0]
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
