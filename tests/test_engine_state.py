"""One bad request must never poison the next. After any request (success, error, cancel, an
exception in the caller, Ctrl-C, a proposer that fails mid-step) the engine must behave exactly as
a fresh engine would: a property-based test runs random sequences of requests through one engine
and checks every normal request's output against a fresh engine's, and that the KV cache holds
exactly the rows the engine thinks it holds.

Greedy, batch-invariant kernels (exact mode where the build allows it, and the tiny model's F32
weights), so prefix reuse cannot move a logit and "the same output" is a fair demand.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localspec.speculative.engine import Engine, EngineConfig
from localspec.errors import LocalspecError
from localspec.llama import system_info
from localspec.policy.config import PolicyConfig
from localspec.speculative.proposers import NgramProposer

PROMPTS = ["The capital of France is", "abcabcabcabc", "def f(x):\n    return x\ndef f(x):\n",
           "one two three one two three", "zebra", "The capital of Spain"]
EXACT = "LLAMAFILE" not in system_info()
N_CTX = 256


class FlakyProposer(NgramProposer):
    """n-gram lookup that raises on its `fail_at`-th proposal of a request (None: never)."""

    def __init__(self):
        super().__init__()
        self.fail_at, self._calls = None, 0

    def begin(self, history, document=None, sampling=None, seed=0):
        super().begin(history, document, sampling, seed)
        self._calls = 0

    def offers(self, limit):
        self._calls += 1
        if self.fail_at is not None and self._calls == self.fail_at:
            raise RuntimeError("proposer failed")
        return super().offers(limit)


def config(proposer: str, k) -> EngineConfig:
    return EngineConfig(proposer=proposer, n_ctx=N_CTX, n_threads=1, exact=EXACT,
                        policy=PolicyConfig(fixed_k=k))


_reference: dict = {}


def reference(tiny_model, prompt: str, max_tokens: int) -> list:
    """Plain greedy output of a fresh engine (cold cache, nothing before it)."""
    key = (str(tiny_model.path), tiny_model.n_gpu_layers, prompt, max_tokens)  # CPU or device
    if key not in _reference:
        with Engine(tiny_model, config("none", None)) as fresh:
            _reference[key] = fresh.generate(prompt, max_tokens=max_tokens).complete_tokens()
    return _reference[key]


request = st.one_of(
    st.tuples(st.just("normal"), st.sampled_from(PROMPTS), st.booleans(), st.integers(1, 24)),
    st.tuples(st.just("empty")),
    st.tuples(st.just("too-long")),
    st.tuples(st.just("cancel"), st.sampled_from(PROMPTS), st.integers(0, 6)),
    st.tuples(st.just("caller-raises"), st.sampled_from(PROMPTS), st.integers(0, 6)),
    st.tuples(st.just("ctrl-c"), st.sampled_from(PROMPTS), st.integers(0, 6)),
    st.tuples(st.just("proposer-fails"), st.sampled_from(PROMPTS), st.integers(1, 4)),
)


def run(engine: Engine, proposer: FlakyProposer, req) -> None:
    kind = req[0]
    if kind == "normal":
        _, prompt, speculate, max_tokens = req
        gen = engine.generate(prompt, max_tokens=max_tokens, speculate=speculate)
        out = gen.complete_tokens()
        assert out == reference(engine.model, prompt, max_tokens), (req, gen.stats.summary())
        return
    if kind == "empty":
        with pytest.raises(LocalspecError, match="prompt is empty"):
            engine.generate([])
        return
    if kind == "too-long":
        with pytest.raises(LocalspecError, match="context holds"):
            engine.generate("x" * (4 * N_CTX))
        return
    _, prompt, after = req
    if kind == "proposer-fails":
        proposer.fail_at = after
        try:
            with pytest.raises(RuntimeError, match="proposer failed"):
                engine.generate(prompt, max_tokens=40).complete()
        finally:
            proposer.fail_at = None
        return
    cancel = threading.Event()
    gen = engine.generate(prompt, max_tokens=40, cancel=cancel)
    pieces = iter(gen)
    try:
        for i, _ in enumerate(pieces):
            if i >= after:
                if kind == "cancel":
                    cancel.set()
                elif kind == "caller-raises":
                    raise ValueError("the caller failed")
                else:
                    raise KeyboardInterrupt
    except (ValueError, KeyboardInterrupt):
        pass
    finally:
        pieces.close()        # what a for-loop's exit does to the generator: the engine cleans up


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=2, max_size=7), k=st.sampled_from([None, 1, 4]))
def test_any_request_sequence_leaves_the_engine_as_good_as_new(tiny_model, requests, k):
    proposer = FlakyProposer()
    with Engine(tiny_model, config("ngram", k), proposer=proposer) as engine:
        for req in requests:
            run(engine, proposer, req)
            ctx = engine.ctx
            assert ctx.rows_held() == ctx.n_past, req          # no row the engine forgot
            assert ctx.n_past < N_CTX
        # and one more normal request at the end, whatever came before
        run(engine, proposer, ("normal", PROMPTS[0], True, 16))


class CancelAfter(threading.Event):
    """A cancel flag that reads as set from its n-th look on: a deterministic mid-prefill Ctrl-C."""

    def __init__(self, n: int):
        super().__init__()
        self.looks, self.n = 0, n

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks >= self.n or super().is_set()


@pytest.mark.parametrize("looks", [1, 2, 3])
def test_cancel_during_prefill_stops_between_chunks(tiny_model, looks):
    """Prefill runs in chunks of PREFILL_GRID tokens and looks at the cancel flag before each:
    a long prompt stops within one chunk, and the next request is as good as new."""
    from localspec.llama import PREFILL_GRID

    prompt = "word " * 200                       # ~1400 byte tokens: several chunks
    with Engine(tiny_model, EngineConfig(proposer="none", n_ctx=2048, n_threads=1,
                                         exact=EXACT)) as engine:
        gen = engine.generate(prompt, max_tokens=8, cancel=CancelAfter(looks))
        assert gen.complete_tokens() == [] and gen.stats.stop_reason == "cancelled"
        assert gen.stats.prefill_tokens == (looks - 1) * PREFILL_GRID
        assert engine.ctx.rows_held() == engine.ctx.n_past == (looks - 1) * PREFILL_GRID
        again = engine.generate(PROMPTS[0], max_tokens=12).complete_tokens()
    assert again == reference(tiny_model, PROMPTS[0], 12)
