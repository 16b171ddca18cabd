"""One generate() call: its mutable state (Request) and the handle its caller iterates for text
(Generation), whose `.text`, `.tokens` and `.stats` hold the result afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

from ..policy.adaptive import AdaptivePolicy
from .sampling import PositionStream, SamplingParams
from .stats import GenerationStats
from .textstream import TextStream


@dataclass
class Request:
    """Mutable state of one generate() call."""

    sampling: SamplingParams
    stream: PositionStream
    policy: Optional[AdaptivePolicy]
    history: list                 # prompt + emitted tokens (what penalties and n-gram see)
    tie_margin: float             # the near-tie guard for this request (0: off)
    out: list = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    recheck: bool = False         # the next step decodes one token: a near-tie is re-decided


class Generation:
    """Iterate for text pieces as they are ready; afterwards `.text`, `.tokens`, `.stats`."""

    def __init__(self, run: Iterator[str], request: Request, texts: TextStream):
        self._run, self._request, self._texts = run, request, texts

    def __iter__(self) -> Iterator[str]:
        return self._run              # the loop itself: no wrapper frame per piece

    def close(self) -> None:
        """End the request where it is, now rather than whenever Python collects it: the engine's
        cleanup runs at once (its KV keeps the prompt and the tokens emitted so far). No-op once
        the request has ended."""
        self._run.close()

    def complete(self) -> str:
        for _ in self:
            pass
        return self.text

    def complete_tokens(self) -> list:
        self.complete()
        return list(self.tokens)

    @property
    def text(self) -> str:
        return self._texts.text

    @property
    def tokens(self) -> list:
        return self._request.out

    @property
    def stats(self) -> GenerationStats:
        return self._request.stats
