"""The draft store: a bounded index of past outputs that proposes what followed the current
context before, with continuation counts (a typed wrapper over csrc/store.h).

Suffix decoding for one machine: every output a request produces joins the store (one per
model, held by learning_store.py, persisted by store_file.py), and later requests of any kind
ask it, with their last few tokens, "what came next the times this was written before?". The
answer is a draft grown down the implicit suffix tree of the stored outputs, the most frequent
continuation first, with its counts: agree[i] of n_occ earlier occurrences continue with
tokens[0..i]; the product of the child/parent count ratios is its score. The acceptance model
reads the counts (share = the ratio, log_support = the count) exactly as it reads prompt
lookup's occurrence support.

Memory is bounded: at most `max_tokens` tokens, from a budget in MB (max_tokens_for); the C
index's `capacity` (what its block holds now) starts small and doubles as outputs arrive (a new
store costs ~4 MB, not the budget), and once at max_tokens the oldest half is dropped (eviction
by age: old sessions matter least). Not thread-safe.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from localspec._ngram_c import ffi, lib

BREAK = lib.LSST_BREAK          # ends one past output in the corpus
CONTEXT_MIN, CONTEXT_MAX = 2, 6     # context lengths tried; 1-token contexts drawn from a
                                    # million tokens are noise, and prompt lookup covers them
MAX_COUNTED = 64                # newest occurrences counted (a count is at most this)
FLOOR = 0.1                     # least score (product of count ratios) a drafted token may have
MAX_CAPACITY = lib.LSST_MAX_CAPACITY    # the most tokens one C index holds (2**28)
_K = 64                          # output buffers: the policy never asks for more (K_LIMIT)
_START = 1 << 16                 # tokens a new store's index holds before it first doubles
_alloc = ffi.new_allocator(should_clear_after_alloc=False)


@dataclass(frozen=True)
class StoreMatch:
    tokens: list         # [n] the draft, most frequent continuation first
    agree: list          # [n] occurrences that continue with tokens[0..i] (non-increasing)
    n_occ: int           # occurrences of the matched context visited (<= MAX_COUNTED)
    ngram_len: int       # length of the matched context
    score: float         # product of agree[i] / agree[i-1] (agree[-1] = n_occ)


def _params(ngram_min: int, ngram_max: int, max_chain: int, floor: float):
    return ffi.new("lsst_params *", [ngram_min, ngram_max, max_chain, floor])


def bytes_per_token(ngram_min: int = CONTEXT_MIN, ngram_max: int = CONTEXT_MAX) -> float:
    """RAM one token of index capacity costs (tokens, chains, hash slots at their worst load)."""
    cap = 1 << 20
    return lib.lsst_bytes(_params(ngram_min, ngram_max, MAX_COUNTED, FLOOR), cap) / cap


def max_tokens_for(budget_mb: float, ngram_min: int = CONTEXT_MIN,
                   ngram_max: int = CONTEXT_MAX) -> int:
    """The most tokens a store of `budget_mb` MB of RAM holds (its file takes 4 bytes a token,
    a sixteenth of that): the hash tables grow in powers of two, so it is searched for."""
    params, budget = _params(ngram_min, ngram_max, MAX_COUNTED, FLOOR), max(0.0, budget_mb) * 1e6
    lo, hi = 0, MAX_CAPACITY
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if lib.lsst_bytes(params, mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


class DraftStore:
    """The store's tokens and index. append() outputs (a BREAK between them), propose() drafts.

    >>> s = DraftStore(max_tokens=100)
    >>> s.extend([1, 2, 3, BREAK, 1, 2, 3, BREAK, 1, 2, 4, BREAK])
    >>> m = s.propose([0, 1, 2], 8); m.tokens, m.agree, m.n_occ, round(m.score, 3)
    ([3], [2], 3, 0.667)
    """

    def __init__(self, max_tokens: int, ngram_min: int = CONTEXT_MIN,
                 ngram_max: int = CONTEXT_MAX, max_chain: int = MAX_COUNTED, floor: float = FLOOR):
        max_tokens = operator.index(max_tokens)
        if not 1 <= max_tokens <= MAX_CAPACITY:
            raise ValueError(f"max_tokens must be in [1, {MAX_CAPACITY}], got {max_tokens}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.max_tokens = max_tokens       # the budget's; the C index's capacity grows to it
        self._params = _params(ngram_min, ngram_max, max_chain, floor)
        if not lib.lsst_bytes(self._params, max_tokens):
            raise ValueError(f"invalid store parameters: ngram {ngram_min}..{ngram_max}, "
                             f"max_chain {max_chain}, floor {floor}")
        self._mem, self._store = self._new_index(min(max_tokens, _START))
        self._ctx = ffi.new("int32_t[]", ngram_max)
        self._tokens = ffi.new("int32_t[]", _K)
        self._agree = ffi.new("int32_t[]", _K)
        self._match = ffi.new("lsst_match *")
        self.n_evicted = 0

    def _new_index(self, capacity: int) -> tuple:
        n_bytes = lib.lsst_bytes(self._params, capacity)
        mem = _alloc("uint64_t[]", (n_bytes + 7) // 8)
        out = ffi.new("lsst_store **")
        self._check(lib.lsst_init(mem, n_bytes, self._params, capacity, out), "init")
        return mem, out[0]

    def _grow(self, need: int) -> None:
        """Move into an index of twice the capacity (or what `need` tokens take, at most the
        budget's): O(tokens held), amortised by doubling."""
        old = self._store
        capacity = lib.lsst_capacity(old)
        while capacity < need:
            capacity *= 2
        mem, store = self._new_index(min(capacity, self.max_tokens))
        self._check(lib.lsst_append(store, lib.lsst_tokens(old), lib.lsst_len(old)), "grow")
        self._mem, self._store = mem, store

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc:
            reason = ffi.string(lib.lsst_strerror(rc)).decode()
            if rc in (lib.LSST_ERR_TOKEN, lib.LSST_ERR_PARAMS, lib.LSST_ERR_RANGE):
                raise ValueError(f"draft store {what}: {reason}")
            raise RuntimeError(f"draft store {what} failed: {reason} (a bug in localspec)")

    def _live(self):
        if self._store is None:
            raise ValueError("DraftStore is closed")
        return self._store

    def __len__(self) -> int:
        return lib.lsst_len(self._live())

    def tokens(self) -> np.ndarray:
        """[len] int32 copy of the corpus (BREAK between outputs), oldest first."""
        n = len(self)
        return np.frombuffer(ffi.buffer(lib.lsst_tokens(self._store), 4 * n), np.int32).copy()

    def extend(self, tokens: Sequence[int]) -> None:
        """Append token ids (>= 0) and BREAKs; when full, the oldest half is evicted first (the
        newest tokens of a batch larger than the store are kept)."""
        store = self._live()
        limit = self.max_tokens
        if type(tokens) is list and len(tokens) <= min(64, limit):     # the per-step path
            buf = ffi.new("int32_t[]", tokens)
        else:
            arr = np.ascontiguousarray(tokens, dtype=np.int32)[-limit:]
            buf = ffi.from_buffer("int32_t[]", arr)
        n = len(buf)
        rc = lib.lsst_append(store, buf, n)
        if rc == lib.LSST_ERR_FULL and lib.lsst_capacity(store) < limit:
            self._grow(lib.lsst_len(store) + n)
            store = self._store
            rc = lib.lsst_append(store, buf, n)
        if rc == lib.LSST_ERR_FULL:
            held = lib.lsst_len(store)
            drop = max(held // 2, held + n - limit)
            self._check(lib.lsst_drop_oldest(store, drop), "evict")
            self.n_evicted += drop
            rc = lib.lsst_append(store, buf, n)
        self._check(rc, "append")

    def clear(self) -> None:
        """Forget every stored token."""
        self._check(lib.lsst_drop_oldest(self._live(), len(self)), "clear")

    def propose(self, context: Sequence[int], k: int) -> Optional[StoreMatch]:
        """The draft (up to k <= 64 tokens) for the last ngram_max tokens of `context`; None
        when no stored context matches or no continuation clears the floor."""
        store = self._live()
        m_len = min(len(context), self.ngram_max)
        ctx = self._ctx
        for i in range(m_len):
            ctx[i] = context[len(context) - m_len + i]
        match = self._match
        self._check(lib.lsst_propose(store, ctx, m_len, min(k, _K), self._tokens, self._agree,
                                     match), "propose")
        n = match.n_tokens
        if not n:
            return None
        return StoreMatch(ffi.unpack(self._tokens, n), ffi.unpack(self._agree, n),
                          match.n_occ, match.ngram_len, match.score)

    def close(self) -> None:
        self._store = self._mem = None

    def __enter__(self) -> "DraftStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
