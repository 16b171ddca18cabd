"""Benchmark: the draft store's cost per decoding step (lookup + update) and its load time, at a
given number of stored tokens.

    python -m tools.store_speed                     # 1M stored tokens
    python -m tools.store_speed --tokens 100000,1000000 --steps 20000

The stored tokens are real text with real repetition: this Python's standard library sources,
split into words, spaces and punctuation, each distinct piece one token id (a stand-in for a
tokenizer: what matters is how often contexts recur), cut into "outputs" of 300 tokens. A step
is what the n-gram proposer does per decode with a store: one propose(context, 16) and one
add() of the 1-3 tokens the step emitted. A benchmark, not a test: it prints and asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from localspec.speculative.store import BREAK, DraftStore, bytes_per_token
from localspec.speculative.learning_store import LearningStore
from localspec.speculative.store_file import StoreFile

_PIECE = re.compile(r"\w+|\s+|[^\w\s]")


def corpus(n_tokens: int, output_len: int = 300) -> np.ndarray:
    """[n] int32 token ids from the stdlib's sources, a BREAK every `output_len` tokens."""
    ids: dict = {}
    out: list = []
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for piece in _PIECE.findall(text):
            out.append(ids.setdefault(piece, len(ids)))
            if len(out) % (output_len + 1) == output_len:
                out.append(BREAK)
        if len(out) >= n_tokens:
            break
    return np.array(out[:n_tokens], np.int32)


def step_cost(store: LearningStore, queries: np.ndarray, steps: int, k: int = 16) -> tuple:
    """(us per step, share of steps with a draft): propose on the last 6 tokens of a moving
    window over `queries`, then add 1-3 tokens (what a step emits)."""
    rng = np.random.default_rng(0)
    emitted = rng.integers(1, 4, steps)
    hist = queries.tolist()
    pos, found = 8, 0
    store.begin_output()
    t0 = time.perf_counter()
    for i in range(steps):
        m = store.propose(hist[pos - 6:pos], k)
        found += m is not None
        n = int(emitted[i])
        store.add(hist[pos:pos + n])
        pos += n
        if pos + 4 > len(hist):
            pos = 8
    us = 1e6 * (time.perf_counter() - t0) / steps
    return us, found / steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1000000", help="stored tokens, comma-separated")
    ap.add_argument("--steps", type=int, default=20000)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.tokens.split(",")]
    data = corpus(max(sizes) + 100_000)
    queries = data[-100_000:]            # text not in the store: the next session's outputs
    queries = queries[queries != BREAK]
    per = bytes_per_token()
    print(f"{'stored':>9} {'RAM MB':>7} {'file MB':>7} {'load s':>7} {'step us':>8} {'found':>6}")
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "s.lsds"
            max_tokens = n + args.steps * 3 + 1000
            StoreFile(path, "k" * 32, "bench", max_tokens).save(data[:n])
            t0 = time.perf_counter()
            tokens = StoreFile(path, "k" * 32, "bench", max_tokens).load()
            store = DraftStore(max_tokens)
            store.extend(tokens)
            load_s = time.perf_counter() - t0
            learning = LearningStore(store, None, learn=True)
            us, found = step_cost(learning, queries, args.steps)
            print(f"{n:>9} {max_tokens * per / 1e6:>7.1f} {os.path.getsize(path) / 1e6:>7.2f} "
                  f"{load_s:>7.3f} {us:>8.2f} {found:>6.0%}")
            store.close()


if __name__ == "__main__":
    sys.exit(main())
