"""The timing rules every benchmark mode shares: what one run produced, when its first token
counts as produced, and decode tokens/s measured the same way for our engine and the peer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..speculative.stats import GenerationStats


@dataclass
class Outcome:
    """What one (case, mode) run produced, timed by wall clock from the request to its end."""

    text: str
    tokens: Optional[list]            # the peer's: all but its last token (not observable)
    generated_tokens: int
    ttft_ms: float                    # request -> first token (tokenize + prefill + first draw)
    total_ms: float
    stop_reason: str
    stats: Optional[GenerationStats] = None
    timed_tokens: Optional[int] = None    # the tokens total_ms covers, when not all of them
                                          # (llama.cpp's tool runs past the cap: llamacpp.py)

    @property
    def decode_tps(self) -> float:
        """Tokens after the first, per second after the first: the same rule for every mode."""
        n = self.generated_tokens if self.timed_tokens is None else self.timed_tokens
        span = (self.total_ms - self.ttft_ms) / 1000.0
        return (n - 1) / span if n > 1 and span > 0 else 0.0


class Ticker:
    """Calls `live(n_tokens, tok/s so far)` about twice a second during a run."""

    def __init__(self, live: Optional[Callable[[int, float], None]]):
        self.live, self.t0, self.last, self.first = live, time.perf_counter(), 0.0, None

    def tick(self, n: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        if self.live is not None and now - self.last > 0.5:
            self.last = now
            span = now - self.first
            self.live(n, (n - 1) / span if n > 1 and span > 0 else 0.0)
