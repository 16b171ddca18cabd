"""Plain decoding speed: localspec's own loop vs llama-cpp-python's high-level Llama, side by side.

Same model, prompt, threads and greedy settings; rounds alternate between the two so machine
drift hits both alike. Prints decode tokens/s per round, the ratio, and the process's peak RSS.
Usage: python scripts/plain_parity.py [-m MODEL] [--tokens 64] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import llama_cpp

from localspec.catalog.models import resolve_model
from localspec.speculative.engine import Engine, EngineConfig
from localspec.llama import default_threads

PROMPT = "Write a Python function that parses an ISO 8601 date string and explain each step."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=default_threads())
    a = ap.parse_args()
    path = str(resolve_model(a.model))
    ours = Engine(path, EngineConfig(proposer="none", n_ctx=1024, n_threads=a.threads))
    peer = llama_cpp.Llama(model_path=path, n_ctx=1024, n_threads=a.threads,
                           n_threads_batch=a.threads, verbose=False)
    prompt = ours.model.apply_chat_template([{"role": "user", "content": PROMPT}])
    rates = {"localspec": [], "llama-cpp-python": []}
    for r in range(a.rounds):
        ours.reset()
        gen = ours.generate(prompt, max_tokens=a.tokens)
        gen.complete()
        rates["localspec"].append(gen.stats.decode_tokens_per_s)
        peer.reset()
        first, n = None, 0
        for chunk in peer.create_completion(prompt, max_tokens=a.tokens, temperature=0.0,
                                            repeat_penalty=1.0, stream=True):
            n += 1
            first = first or time.perf_counter()
        rates["llama-cpp-python"].append((n - 1) / (time.perf_counter() - first))
        print(f"round {r + 1}: localspec {rates['localspec'][-1]:.2f} tok/s, "
              f"llama-cpp-python {rates['llama-cpp-python'][-1]:.2f} tok/s", flush=True)
    ours_med = statistics.median(rates["localspec"])
    peer_med = statistics.median(rates["llama-cpp-python"])
    print(f"median decode tok/s: localspec {ours_med:.2f}, llama-cpp-python {peer_med:.2f}, "
          f"ratio {ours_med / peer_med:.3f}x")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB "
          "(both models' contexts in one process; weights are mmapped once per loader)")
    peer.close()
    ours.close()


if __name__ == "__main__":
    main()
