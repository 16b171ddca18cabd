"""The peer being measured: llama-cpp-python's own speculative path (`Llama` with
`LlamaPromptLookupDecoding`). The one named exception to "one door to llama.cpp": it imports
llama_cpp's high-level API because that API is the thing under test, not a door localspec uses.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..speculative.sampling import SamplingParams
from .timing import Outcome, Ticker

PEER_K = 10                       # LlamaPromptLookupDecoding's num_pred_tokens, as users run it


class Peer:
    """`Llama(draft_model=LlamaPromptLookupDecoding)` fed the same rendered chat prompt through
    create_completion(stream=True)."""

    def __init__(self, model_path: Path, n_ctx: int, n_threads: int, n_gpu_layers: int,
                 num_pred_tokens: int = PEER_K):
        from llama_cpp.llama import Llama, StoppingCriteriaList
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self._criteria = StoppingCriteriaList

        self.llm = Llama(str(model_path), n_ctx=n_ctx, n_threads=n_threads,
                         n_threads_batch=n_threads, n_gpu_layers=n_gpu_layers,
                         logits_all=True,   # what draft_model implies; passing it sizes the
                         # logits buffer for prompts longer than n_batch (else a ValueError)
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens),
                         verbose=False)

    def run(self, prompt: str, sampling: SamplingParams, max_tokens: int, live=None) -> Outcome:
        calls = []                    # (perf_counter(), ids) per stopping-criteria call
        self.llm.reset()              # cold: no prompt-prefix reuse from the previous request
        ticker = Ticker(live)
        chunks = self.llm.create_completion(
            prompt, max_tokens=max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
            top_p=sampling.top_p, min_p=sampling.min_p, repeat_penalty=sampling.repeat_penalty,
            seed=sampling.seed, stream=True,
            stopping_criteria=self._criteria([lambda ids, logits: calls.append(
                (time.perf_counter(), ids)) or False]))
        text, reason = [], "length"
        for chunk in chunks:
            choice = chunk["choices"][0]
            text.append(choice["text"])
            reason = choice.get("finish_reason") or reason
            ticker.tick(len(calls))
        end = time.perf_counter()
        # create_completion calls the criteria right after sampling output token j with
        # ids = prompt + tokens[:j] (final: rows before j never change), and once more after its
        # loop. So every output token but the last is observable; the EOS token is not output.
        sampled = calls[:-1]
        n = max(0, len(sampled) - (reason == "stop"))
        tokens = None
        if sampled:
            n_prompt = len(sampled[0][1])
            tokens = [int(t) for t in sampled[-1][1][n_prompt:]][:n]   # [n - 1] (or n at EOS)
        # First token = first sample, not first chunk: the peer holds text back while it could
        # be an incomplete UTF-8 sequence, which is not decoding time.
        first = sampled[0][0] if sampled else end
        return Outcome("".join(text), tokens, n, 1000 * (first - ticker.t0),
                       1000 * (end - ticker.t0), "eos" if reason == "stop" else reason)

    def close(self) -> None:
        self.llm.close()
