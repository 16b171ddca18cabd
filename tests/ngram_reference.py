"""Pure-Python reference for the n-gram matcher: the rules of csrc/ngram.h by brute force.

Slow on purpose (every query rescans the history and the document) and free of the C code's
tricks (hash tables, prev chains, incremental updates), so agreement means something.
"""
from __future__ import annotations

HISTORY, DOCUMENT = 0, 1


class ReferenceMatcher:
    def __init__(self, ngram_min: int, ngram_max: int, tie: str, max_chain: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tie, self.max_chain = tie, max_chain
        self.history: list[int] = []
        self.document: list[int] = []

    def append(self, tokens) -> None:
        self.history.extend(int(t) for t in tokens)

    def truncate(self, n_keep: int) -> None:
        del self.history[n_keep:]

    def set_document(self, tokens) -> None:
        self.document = [int(t) for t in tokens] if tokens is not None else []

    @staticmethod
    def occurrences(source: list[int], key: list[int]) -> list[int]:
        """End positions e (newest first) with source[e-L:e] == key and a token after (e < m)."""
        L = len(key)
        return [e for e in range(len(source) - 1, L - 1, -1) if source[e - L:e] == key]

    def pick(self, occs: list[int], m: int, k: int) -> int:
        if self.tie == "recent":
            return occs[0]
        if self.tie == "earliest":
            return occs[-1]
        visited = occs[:self.max_chain]
        for e in visited:
            if m - e >= k:
                return e
        return visited[-1]

    def _matches(self):
        """(source id, tokens, L, occurrences) for every suffix length and source that match,
        in priority order: longer L first, history before document."""
        n = len(self.history)
        for L in range(min(self.ngram_max, n), self.ngram_min - 1, -1):
            key = self.history[n - L:]
            for src, tokens in ((HISTORY, self.history), (DOCUMENT, self.document)):
                occs = self.occurrences(tokens, key)
                if occs:
                    yield src, tokens, L, occs

    def propose(self, k: int) -> tuple[list[int], int, int, int]:
        """(continuation, source, ngram_len, pos) as lsng_propose defines them."""
        for src, tokens, L, occs in self._matches():
            e = self.pick(occs, len(tokens), k)
            return tokens[e:e + k], src, L, e
        return [], HISTORY, 0, -1

    def candidates(self, k: int, n_max: int) -> list[tuple[list[int], int, int, int]]:
        out: list[tuple[list[int], int, int, int]] = []
        seen: set[tuple[int, ...]] = set()
        for src, tokens, L, occs in self._matches():
            for e in [self.pick(occs, len(tokens), k)] + occs[:self.max_chain]:
                if len(out) == n_max:
                    return out
                cont = tokens[e:e + k]
                if tuple(cont) not in seen:
                    seen.add(tuple(cont))
                    out.append((cont, src, L, e))
        return out

    def support(self, tokens: list[int], source: int, ngram_len: int) -> tuple[int, list[int]]:
        """(n_occ, agree) as lsng_support defines them, for a proposal of `tokens`."""
        if ngram_len == 0:
            return 0, [0] * len(tokens)
        src = self.document if source == DOCUMENT else self.history
        occs = self.occurrences(src, self.history[len(self.history) - ngram_len:])
        occs = occs[:self.max_chain]
        agree = [sum(src[e:e + i + 1] == tokens[:i + 1] for e in occs) for i in range(len(tokens))]
        return len(occs), agree
