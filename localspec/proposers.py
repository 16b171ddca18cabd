"""Proposers: where draft tokens come from. Each has the same small lifecycle:

    begin(history)          the prompt tokens (and, for n-gram, an optional lookup document)
    propose(k) -> Proposal  up to k draft tokens, with p_draft (None for point-mass drafts)
    accept(tokens)          the tokens the verifier emitted this step, in order
    close()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .ngram import SOURCE_DOCUMENT, NgramIndex
from .sampling import Dist


@dataclass(frozen=True)
class Proposal:
    tokens: list                      # [n] draft token ids, n <= k
    p_draft: Optional[list]           # [n] Dist, or None: point masses (n-gram, greedy drafts)
    source: str                       # "history" | "document" | "draft"


EMPTY = Proposal([], None, "none")


class NgramProposer:
    """Prompt lookup: continue the longest recent suffix that occurred earlier in the prompt,
    the generated text, or the lookup document (C matcher, incremental, no rescans)."""

    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, min_match: int = 1):
        self._index = NgramIndex(ngram_min=ngram_min, ngram_max=ngram_max)
        self.min_match = min_match

    def begin(self, history: Sequence[int], document: Optional[Sequence[int]] = None) -> None:
        self._index.truncate(0)
        self._index.append(list(history))
        self._index.set_document(list(document) if document else None)

    def propose(self, k: int) -> Proposal:
        if k <= 0:
            return EMPTY
        m = self._index.propose(k)
        if len(m.tokens) == 0 or m.ngram_len < self.min_match:
            return EMPTY
        source = "document" if m.source == SOURCE_DOCUMENT else "history"
        return Proposal([int(t) for t in m.tokens], None, source)

    def accept(self, tokens: Sequence[int]) -> None:
        self._index.append(list(tokens))

    def close(self) -> None:
        self._index.close()
