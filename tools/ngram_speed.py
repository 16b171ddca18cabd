"""Benchmark: per-proposal latency of the C n-gram matcher against a numpy re-implementation of
llama-cpp-python's LlamaPromptLookupDecoding (full rescan per step), on the same token streams.

    python -m tools.ngram_speed                 # lengths 1k 8k 32k 128k
    python -m tools.ngram_speed --steps 50 --lengths 1000,1000000

A benchmark command, not a test: it prints the numbers (table on stdout) and asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from localspec.speculative.ngram import TIE_EARLIEST, TIE_RECENT, NgramIndex

N_PRED = 10                   # num_pred_tokens / k
DECODE_MS_1P5B = 76.0         # one-token decode, Qwen2.5-Coder-1.5B Q4_K_M, 2-vCPU Xeon (docs/design.md)


def prompt_lookup_numpy(history: np.ndarray, max_ngram_size: int = 2,
                        num_pred_tokens: int = N_PRED) -> np.ndarray:
    """The baseline, LlamaPromptLookupDecoding's algorithm: for ngram sizes from max down to 1,
    compare every window of the whole history with the last ngram; the first (earliest) match
    with a full num_pred_tokens continuation that does not overlap the last ngram wins.

    >>> prompt_lookup_numpy(np.array([1, 2, 3, 4, 1, 2]), 2, 2).tolist()
    [3, 4]
    """
    n = history.shape[0]
    for size in range(min(max_ngram_size, n - 1), 0, -1):
        windows = sliding_window_view(history, size)             # [n - size + 1, size]
        hits = np.nonzero(np.all(windows == history[-size:], axis=1))[0]
        for start in hits:
            begin, end = start + size, start + size + num_pred_tokens
            if end <= n and begin < n - size:
                return history[begin:end]
    return history[:0]


def synthetic_stream(n: int, rng: np.random.Generator, vocab: int = 32_000) -> np.ndarray:
    """[n] int32 text-like tokens: Zipf-distributed ids with ~30% spans copied from earlier."""
    out = np.empty(n, np.int32)
    i = 0
    while i < n:
        span = int(rng.integers(4, 40))
        if i > 100 and rng.random() < 0.3:
            start = int(rng.integers(0, i - span)) if i > span else 0
            piece = out[start:start + span]
        else:
            piece = np.minimum(rng.zipf(1.2, span), vocab) - 1
        piece = piece[:n - i]
        out[i:i + len(piece)] = piece
        i += len(piece)
    return out


def time_numpy(stream: np.ndarray, n: int, steps: int) -> tuple[float, list]:
    """Mean seconds per proposal at history lengths n .. n + steps - 1, and the proposals."""
    proposals = []
    t0 = time.perf_counter()
    for i in range(steps):
        proposals.append(prompt_lookup_numpy(stream[:n + i]))
    return (time.perf_counter() - t0) / steps, proposals


def time_c(stream: np.ndarray, n: int, steps: int, tie: str, ngram_max: int,
           repeats: int) -> tuple[float, list]:
    """Mean seconds per step (append the step's token, then propose) through the Python API."""
    with NgramIndex(ngram_min=1, ngram_max=ngram_max, tie=tie, capacity=n + steps) as index:
        index.append(stream[:n - 1])
        best = float("inf")
        for _ in range(repeats):
            index.truncate(n - 1)
            step_tokens = [stream[n - 1 + i:n + i] for i in range(steps)]  # [1] int32 each
            proposals = []
            t0 = time.perf_counter()
            for tokens in step_tokens:
                index.append(tokens)
                proposals.append(index.propose(N_PRED).tokens)
            best = min(best, (time.perf_counter() - t0) / steps)
    return best, proposals


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ngram_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1000,8000,32000,128000",
                        help="history lengths, comma-separated (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="proposals per length")
    parser.add_argument("--repeats", type=int, default=5, help="C timing: best of this many")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(args.seed)
    stream = synthetic_stream(max(lengths) + args.steps, rng)

    print(f"# per-proposal latency, k={N_PRED}, {args.steps} steps per length; C = append 1 token "
          f"+ propose via localspec.speculative.ngram", file=sys.stderr)
    print(f"{'tokens':>8} {'numpy_us':>10} {'c_us':>8} {'speedup':>8} {'c_default_us':>13} "
          f"{'same_as_numpy':>13}")
    for n in lengths:
        t_np, ref = time_numpy(stream, n, args.steps)
        t_c, got = time_c(stream, n, args.steps, TIE_EARLIEST, 2, args.repeats)
        t_def, _ = time_c(stream, n, args.steps, TIE_RECENT, 4, args.repeats)
        same = np.mean([np.array_equal(a, b) for a, b in zip(ref, got)])
        print(f"{n:>8} {t_np * 1e6:>10.1f} {t_c * 1e6:>8.2f} {t_np / t_c:>7.0f}x "
              f"{t_def * 1e6:>13.2f} {same:>12.0%}")
    print(f"# c_us: ngram 1..2, earliest (the baseline's settings); c_default_us: ngram 1..4, "
          f"most recent. same_as_numpy: identical proposals (the baseline insists on a full "
          f"k-token continuation that does not overlap the suffix). 1% of a one-token decode of "
          f"Qwen2.5-Coder-1.5B on the 2-vCPU Xeon = {DECODE_MS_1P5B * 10:.0f} us.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
