"""Prompt-lookup proposer: a typed wrapper over the C n-gram matcher (csrc/ngram.h).

One of the two modules that import localspec._ngram_c (store.py, the draft store, is the other).
It owns argument checking, capacity growth and the native memory's lifetime (close() /
with-block); the matching rules live in csrc/ngram.h.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from localspec._ngram_c import ffi, lib

SOURCE_HISTORY = lib.LSNG_SOURCE_HISTORY    # 0: matched in the history (prompt + generated)
SOURCE_DOCUMENT = lib.LSNG_SOURCE_DOCUMENT  # 1: matched in the lookup document
TIE_RECENT = "recent"        # newest earlier occurrence
TIE_EARLIEST = "earliest"    # oldest occurrence, like llama-cpp-python's prompt lookup (default)
TIE_LONGEST = "longest"      # newest occurrence whose continuation is not cut short
_TIES = {TIE_RECENT: lib.LSNG_TIE_RECENT, TIE_EARLIEST: lib.LSNG_TIE_EARLIEST,
         TIE_LONGEST: lib.LSNG_TIE_LONGEST}
NGRAM_LIMIT = lib.LSNG_NGRAM_LIMIT     # largest ngram_max
MAX_VISITED = lib.LSNG_MAX_CHAIN       # occurrences of one n-gram visited: TIE_LONGEST,
                                       # candidates(), support()
MAX_CAPACITY = lib.LSNG_MAX_CAPACITY   # most tokens one index holds (2**30)
# The proposer's defaults, here only (the C params struct has none of its own): NGRAM_MAX, the
# longest suffix prompt lookup matches (the draft store matches contexts of its own lengths,
# store.CONTEXT_MIN..CONTEXT_MAX), and the tie rule, chosen by replaying the workloads' plain
# outputs through the matcher (scripts/bench/policy_replay.py): suffixes up to 8 tokens and the
# earliest occurrence (the quoted source rather than the model's own recent echo of it) predict
# code edits best: 2.84x vs 2.55x in decode-step units for up to 4 tokens and the most recent
# occurrence.
NGRAM_MAX = 8
NGRAM_TIE = TIE_EARLIEST
_TOKEN_MAX = 2**31 - 1
_SMALL_K = 64  # k up to this is used as is: no length look-ups in the per-step path
_ERR_FULL = lib.LSNG_ERR_FULL
_alloc = ffi.new_allocator(should_clear_after_alloc=False)  # lsng_index_init lays it out


@dataclass(frozen=True)
class Match:
    """One proposed continuation."""
    tokens: np.ndarray  # [n] int32, n <= k; empty when there is no match (or k == 0)
    source: int         # SOURCE_HISTORY or SOURCE_DOCUMENT
    ngram_len: int      # length of the matched suffix; 0 when there is no match


def _check(rc: int, what: str) -> None:
    """Turn an LSNG_ERR_* code into an exception (LSNG_OK == 0 passes)."""
    if not rc:
        return
    reason = ffi.string(lib.lsng_strerror(rc)).decode()
    if rc == lib.LSNG_ERR_TOKEN:  # same words as _as_tokens uses for ids it converts itself
        reason = "token ids must be in [0, 2**31 - 1], got a negative id"
    if rc in (lib.LSNG_ERR_PARAMS, lib.LSNG_ERR_TOKEN, lib.LSNG_ERR_RANGE):
        raise ValueError(f"{what}: {reason}")
    raise RuntimeError(f"n-gram matcher {what} failed: {reason} (a bug in localspec.speculative.ngram)")


def _as_tokens(tokens, what: str) -> np.ndarray:
    """Token ids as a 1-D C-contiguous int32 array; an int32 array passes through without a copy.

    >>> _as_tokens([0, 2**31 - 1], "append").tolist()
    [0, 2147483647]
    """
    arr = np.asarray(tokens)
    if arr.dtype == np.int32 and arr.ndim == 1 and arr.flags.c_contiguous:
        return arr  # the per-step path: checked for negative ids by the C code
    if arr.ndim != 1:
        raise TypeError(f"{what}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int32)
    if arr.dtype != np.int32:
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _TOKEN_MAX:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{what}: token ids must be in [0, 2**31 - 1], got {bad}")
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr)


def _small_int_list(tokens):
    """The per-step path of append(): a short list of ints straight into a C array (numpy's
    conversion and checks cost more than the append itself, ~10x measured); None: anything
    else, for _as_tokens. Negative ids are left to the C code's check, as for int32 arrays."""
    if type(tokens) is not list or len(tokens) > 64 or \
            not all(type(t) is int for t in tokens):
        return None
    try:
        return ffi.new("int32_t[]", tokens)
    except OverflowError:           # > 2**31 - 1: _as_tokens says so in its words
        return None


class NgramIndex:
    """Incremental prompt-lookup index over a token history plus an optional lookup document.

    Per-step cost does not depend on the history length (see csrc/ngram.h for the complexity).
    Not thread-safe. Free it with close() or a with-block; memory grows by doubling on append.

    tie picks among earlier occurrences of the matched suffix: "recent" the newest, "earliest"
    the oldest, "longest" the newest whose continuation is not cut short by the end of its
    source (k tokens follow it), else the oldest of the MAX_VISITED newest.
    """

    def __init__(self, ngram_min: int = 1, ngram_max: int = NGRAM_MAX, tie: str = NGRAM_TIE,
                 capacity: int = 4096):
        if tie not in _TIES:
            raise ValueError(f"tie must be one of {sorted(_TIES)}, got {tie!r}")
        ngram_min, ngram_max = operator.index(ngram_min), operator.index(ngram_max)
        if not 1 <= ngram_min <= ngram_max <= NGRAM_LIMIT:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max <= {NGRAM_LIMIT}, "
                             f"got ngram_min={ngram_min}, ngram_max={ngram_max}")
        capacity = operator.index(capacity)
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be in [1, 2**30], got {capacity}")
        self.ngram_min, self.ngram_max, self.tie = ngram_min, ngram_max, tie
        self._params = ffi.new("lsng_params *", [ngram_min, ngram_max, _TIES[tie]])
        self._match = ffi.new("lsng_match *")  # the last propose()'s result (tests read .pos)
        self._query = ffi.new("lsng_match *")  # support()'s argument, reused
        self._n_occ = ffi.new("int32_t *")
        self._tokens_out = ffi.new("int32_t[]", _SMALL_K)   # propose_supported()'s, reused
        self._agree_out = ffi.new("int32_t[]", _SMALL_K)
        self._mem, self._history = self._new_index(capacity)
        self._doc_mem, self._document, self._doc_len = None, ffi.NULL, 0
        self._closed = False

    def _new_index(self, capacity: int):
        n_bytes = lib.lsng_index_bytes(self._params, capacity)
        mem = _alloc("uint64_t[]", (n_bytes + 7) // 8)  # uint64_t: the 8-byte alignment C needs
        out = ffi.new("lsng_index **")
        _check(lib.lsng_index_init(mem, n_bytes, self._params, capacity, out), "init")
        return mem, out[0]

    def _live(self):
        if self._closed:
            raise ValueError("NgramIndex is closed")
        return self._history

    def __len__(self) -> int:
        return lib.lsng_len(self._live())

    def append(self, tokens) -> None:
        """Append accepted tokens (ints >= 0); all or nothing. Grows the capacity if needed."""
        history = self._live()
        buf = _small_int_list(tokens)
        if buf is None:
            arr = _as_tokens(tokens, "append")
            buf = ffi.from_buffer("int32_t[]", arr)
        n = len(buf)
        rc = lib.lsng_append(history, buf, n)      # the per-step path: one call
        if rc == _ERR_FULL:
            need = lib.lsng_len(history) + n
            if need > MAX_CAPACITY:
                raise ValueError(f"append: the history would hold {need} tokens, "
                                 f"more than the limit of 2**30")
            capacity = lib.lsng_capacity(history)
            while capacity < need:
                capacity = min(2 * capacity, MAX_CAPACITY)
            self._grow(capacity)
            rc = lib.lsng_append(self._history, buf, n)
        if rc:
            _check(rc, "append")

    def _grow(self, capacity: int) -> None:
        """Move the history into a block of `capacity` tokens: O(n), amortised by doubling."""
        mem, history = self._new_index(capacity)
        n = len(self)
        if n:
            _check(lib.lsng_append(history, lib.lsng_tokens(self._history), n), "grow")
        self._mem, self._history = mem, history

    def truncate(self, n_keep: int) -> None:
        """Roll back to the first n_keep tokens (rejected drafts); O(tokens removed)."""
        history = self._live()
        n_keep, n = operator.index(n_keep), lib.lsng_len(history)
        if not 0 <= n_keep <= n:
            raise ValueError(f"truncate: n_keep must be in [0, {n}] (the history length), "
                             f"got {n_keep}")
        _check(lib.lsng_truncate(history, n_keep), "truncate")

    def set_document(self, tokens) -> None:
        """Replace the lookup document (e.g. the file being edited); None or empty clears it."""
        self._live()
        arr = _as_tokens([] if tokens is None else tokens, "set_document")
        if len(arr) == 0:
            self._doc_mem, self._document, self._doc_len = None, ffi.NULL, 0
            return
        if len(arr) > MAX_CAPACITY:
            raise ValueError("set_document: documents are limited to 2**30 tokens")
        mem, document = self._new_index(len(arr))
        _check(lib.lsng_append(document, ffi.from_buffer("int32_t[]", arr), len(arr)),
               "set_document")
        self._doc_mem, self._document, self._doc_len = mem, document, len(arr)

    def _budget(self, history, k) -> int:
        """k capped by the longer source (no continuation is longer): the output buffer size."""
        k = operator.index(k)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k > _SMALL_K:
            k = min(k, max(lib.lsng_len(history), self._doc_len))
        return k

    def propose(self, k: int) -> Match:
        """Up to k draft tokens: what followed the longest suffix (length in [ngram_min,
        ngram_max]) that occurred earlier in the history or anywhere in the document.

        The longer match wins; on equal length the history beats the document; within a source
        the tie policy picks the occurrence. A history continuation is what followed the earlier
        occurrence, up to the end of the history (it may run into the current suffix).

        >>> idx = NgramIndex(ngram_min=1, ngram_max=3)
        >>> idx.append([7, 1, 2, 3, 8, 1, 2])        # x a b c y a b
        >>> m = idx.propose(4); m.tokens.tolist(), m.source, m.ngram_len
        ([3, 8, 1, 2], 0, 2)
        >>> idx.set_document([8, 1, 2, 9])           # y a b z: a longer (3) match
        >>> m = idx.propose(4); m.tokens.tolist(), m.source, m.ngram_len
        ([9], 1, 3)
        >>> idx.propose(0).tokens.tolist(), idx.propose(0).ngram_len
        ([], 3)
        """
        history = self._live()
        size = self._budget(history, k)
        out = np.empty(size, np.int32)  # [size] int32
        buf = ffi.from_buffer("int32_t[]", out) if size else ffi.NULL
        m = self._match
        _check(lib.lsng_propose(history, self._document, size, buf, m), "propose")
        return Match(out[:m.n_tokens], m.source, m.ngram_len)

    def support(self, m: Match) -> tuple[int, np.ndarray]:
        """(n_occ, agree) for a proposal `m` that propose() just returned: n_occ = how many of
        the MAX_VISITED newest earlier occurrences of its matched suffix were visited (in m's
        source), agree[i] = how many of them continue with m.tokens[0..i] (csrc/ngram.h,
        SUPPORT). Call it before the index changes.

        >>> idx = NgramIndex(ngram_min=1, ngram_max=1, tie="earliest")
        >>> idx.append([1, 5, 6, 1, 5, 7, 1])            # "1" occurred twice: "5 6", "5 7"
        >>> m = idx.propose(2); n_occ, agree = idx.support(m)
        >>> m.tokens.tolist(), n_occ, agree.tolist()
        ([5, 6], 2, [2, 1])
        """
        history = self._live()
        n = len(m.tokens)
        agree = np.zeros(n, np.int32)  # [n] int32
        q = self._query
        q.n_tokens, q.source, q.ngram_len, q.pos = n, m.source, m.ngram_len, -1
        tokens = _as_tokens(m.tokens, "support")
        n_occ = self._n_occ
        _check(lib.lsng_support(history, self._document, q,
                                ffi.from_buffer("int32_t[]", tokens) if n else ffi.NULL,
                                ffi.from_buffer("int32_t[]", agree) if n else ffi.NULL, n_occ),
               "support")
        return int(n_occ[0]), agree

    def propose_supported(self, k: int):
        """propose(k) and support() of what it found, in one call and as plain Python values:
        (tokens, source, ngram_len, n_occ, agree) with tokens and agree lists, or None when
        nothing follows a match. The per-step path of the n-gram proposer: for k <= 64 it
        writes into buffers kept for it, with no numpy arrays made per step.

        >>> idx = NgramIndex(ngram_min=1, ngram_max=1, tie="earliest")
        >>> idx.append([1, 5, 6, 1, 5, 7, 1])
        >>> idx.propose_supported(2)
        ([5, 6], 0, 1, 2, [2, 1])
        """
        if type(k) is not int or not 0 <= k <= _SMALL_K:
            m = self.propose(k)
            if not len(m.tokens):
                return None
            n_occ, agree = self.support(m)
            return m.tokens.tolist(), m.source, m.ngram_len, n_occ, agree.tolist()
        history, m, out = self._live(), self._match, self._tokens_out
        rc = lib.lsng_propose(history, self._document, k, out, m)
        if rc:
            _check(rc, "propose")
        n = m.n_tokens
        if not n:
            return None
        agree = self._agree_out
        rc = lib.lsng_support(history, self._document, m, out, agree, self._n_occ)
        if rc:
            _check(rc, "support")
        return ffi.unpack(out, n), m.source, m.ngram_len, self._n_occ[0], ffi.unpack(agree, n)

    def candidates(self, k: int, n: int) -> list[Match]:
        """Up to n distinct continuations: propose(k)'s first, then for each suffix length
        (longest first; history before document) the tie pick and the MAX_VISITED most recent
        occurrences. Duplicates (equal token lists) are skipped.

        >>> idx = NgramIndex(ngram_min=1, ngram_max=2)
        >>> idx.append([1, 5, 1, 6, 1, 5, 1])
        >>> [c.tokens.tolist() for c in idx.candidates(2, 4)]
        [[6, 1], [5, 1]]
        """
        history = self._live()
        size = self._budget(history, k)
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        n = min(n, 2 * (self.ngram_max - self.ngram_min + 1) * (MAX_VISITED + 1))
        if n == 0:
            return []
        out = np.empty((n, size), np.int32)  # [n, size] int32, row i holds candidate i
        buf = ffi.from_buffer("int32_t[]", out) if size else ffi.NULL
        matches = ffi.new("lsng_match[]", n)
        count = ffi.new("int32_t *")
        _check(lib.lsng_candidates(history, self._document, size, n, buf, matches, count),
               "candidates")
        return [Match(out[i, :matches[i].n_tokens], matches[i].source, matches[i].ngram_len)
                for i in range(count[0])]

    def close(self) -> None:
        """Release the native memory; later calls raise ValueError. Safe to call twice."""
        self._closed = True
        self._mem = self._history = self._doc_mem = None
        self._document, self._doc_len = ffi.NULL, 0

    def __enter__(self) -> "NgramIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} tokens"
        return (f"NgramIndex(ngram_min={self.ngram_min}, ngram_max={self.ngram_max}, "
                f"tie={self.tie!r}, {state})")
