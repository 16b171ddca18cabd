"""Timed runs of our engine modes: one request at a time, or several modes of one case in
lockstep, each decoding in turn and timed only while it runs.

Lockstep is what a shared machine needs for small differences: run one after the other, two
modes of a 20-second case see different minutes of a box whose speed drifts by 10% in a minute;
in lockstep they take turns every step or so (the one with fewer tokens goes next, so both are
at the same position of the same text when they run) and see the same drift. A mode's time is
the sum of its own turns; the other's turns are not in it.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from ..speculative.engine import Engine
from ..speculative.sampling import SamplingParams
from .timing import Outcome, Ticker
from .workloads import Case


class EngineRun:
    """One request of `case` on `engine`, advanced a piece of text at a time by `turn()`, with
    the time spent inside its own calls summed. Cold: the previous request's KV rows are
    forgotten so the whole prompt is prefilled (the engine would otherwise reuse the shared
    chat-template prefix); warm: a repeat round, which keeps the prompt's rows the way every
    request does (whole prefill chunks only, so its output is the cold round's bit for bit)."""

    def __init__(self, engine: Engine, case: Case, sampling: SamplingParams, max_tokens: int,
                 cold: bool = True):
        if cold:
            engine.reset()
        self.case, self.cold = case, cold
        t0 = time.perf_counter()
        self.gen = engine.generate(case.messages(), sampling, max_tokens=max_tokens)
        self._pieces = iter(self.gen)
        self.setup_ms = self.active_ms = 1000 * (time.perf_counter() - t0)
        self.done = False

    @property
    def n_tokens(self) -> int:
        return len(self.gen.tokens)

    def turn(self) -> bool:
        """Decode until the next piece of text (one step, or a few where text is held back);
        False once the request has ended."""
        t0 = time.perf_counter()
        try:
            next(self._pieces)
        except StopIteration:
            self.done = True
        self.active_ms += 1000 * (time.perf_counter() - t0)
        return not self.done

    def outcome(self) -> Outcome:
        st = self.gen.stats
        if self.cold and st.prefill_tokens != st.prompt_tokens:
            raise RuntimeError(f"{self.case.id}: the request reused "
                               f"{st.prompt_tokens - st.prefill_tokens} KV rows; timings would "
                               "not be cold.")
        # First token = end of prefill, not first piece: text is held back while it could be an
        # incomplete UTF-8 sequence or the start of a stop string, which is not decoding time.
        ttft = min(self.active_ms, self.setup_ms + st.prefill_ms)
        st.total_ms = self.active_ms - self.setup_ms     # its own time, not the wall clock's
        return Outcome(self.gen.text, list(self.gen.tokens), len(self.gen.tokens), ttft,
                       self.active_ms, st.stop_reason, st)


def run_engine(engine: Engine, case: Case, sampling: SamplingParams, max_tokens: int,
               live: Optional[Callable[[int, float], None]] = None,
               cold: bool = True) -> Outcome:
    """The request alone, start to end."""
    run = EngineRun(engine, case, sampling, max_tokens, cold)
    ticker = Ticker(live)
    while run.turn():
        ticker.tick(run.n_tokens)
    return run.outcome()


def run_lockstep(engines: dict, case: Case, sampling: SamplingParams, max_tokens: int,
                 cold: bool = True) -> dict:
    """{mode name: Engine} -> {mode name: Outcome}: each prefills in turn, then the one with
    the fewest tokens so far decodes next (ties: the earlier in `engines`) until all have
    ended. The engines must not share a context (they share the model)."""
    runs = {}
    try:
        for name, e in engines.items():
            runs[name] = EngineRun(e, case, sampling, max_tokens, cold)
        going = [r for r in runs.values() if r.turn()]
        while going:
            run = min(going, key=lambda r: r.n_tokens)
            if not run.turn():
                going.remove(run)
    finally:   # Ctrl-C or an error in one: end the others now, while their contexts are open
        for r in runs.values():
            r.gen.close()
    return {name: r.outcome() for name, r in runs.items()}
