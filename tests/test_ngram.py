"""The C n-gram matcher (localspec.speculative.ngram): worked examples, edge cases, and agreement with the
pure-Python reference (tests/ngram_reference.py) on >= 100,000 seeded random cases."""
import doctest

import numpy as np
import pytest

import localspec.speculative.ngram as ngram
from localspec.speculative.ngram import (SOURCE_DOCUMENT, SOURCE_HISTORY, TIE_EARLIEST, TIE_LONGEST,
                             TIE_RECENT, Match, NgramIndex)

try:
    from .ngram_reference import ReferenceMatcher
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from ngram_reference import ReferenceMatcher

TOKEN_MAX = 2**31 - 1
TIES = [TIE_RECENT, TIE_EARLIEST, TIE_LONGEST]


def proposal(index: NgramIndex, k: int):
    m = index.propose(k)
    assert m.tokens.dtype == np.int32
    return m.tokens.tolist(), m.source, m.ngram_len


def test_docstring_examples():
    assert doctest.testmod(ngram).failed == 0


# ---- worked examples: priorities and tie policies ----------------------------------------------

def test_longest_suffix_wins_and_continuation_runs_to_end_of_history():
    with NgramIndex(ngram_min=1, ngram_max=3) as idx:
        idx.append([7, 1, 2, 3, 8, 1, 2])                 # x a b c y a b
        # "y a b" occurs nowhere earlier; "a b" ends at 3; the continuation runs up to the end
        assert proposal(idx, 10) == ([3, 8, 1, 2], SOURCE_HISTORY, 2)
        assert proposal(idx, 2) == ([3, 8], SOURCE_HISTORY, 2)


def test_history_beats_document_on_equal_length_longer_document_match_wins():
    with NgramIndex(ngram_min=1, ngram_max=3) as idx:
        idx.append([7, 1, 2, 3, 8, 1, 2])
        idx.set_document([1, 2, 4, 5])                    # also matches "a b": history wins
        assert proposal(idx, 4) == ([3, 8, 1, 2], SOURCE_HISTORY, 2)
        idx.set_document([8, 1, 2, 9])                    # matches "y a b": longer, wins
        assert proposal(idx, 4) == ([9], SOURCE_DOCUMENT, 3)
        idx.set_document(None)
        assert proposal(idx, 4) == ([3, 8, 1, 2], SOURCE_HISTORY, 2)


def test_document_only_match_and_suffix_as_long_as_history():
    with NgramIndex(ngram_min=2, ngram_max=4) as idx:
        idx.append([5, 6])
        assert proposal(idx, 3) == ([], SOURCE_HISTORY, 0)
        idx.set_document([9, 5, 6, 7, 8, 5, 6])           # the final "5 6" has no follower
        assert proposal(idx, 3) == ([7, 8, 5], SOURCE_DOCUMENT, 2)


def test_tie_policies():
    # "1" occurs with ends 1, 3, 5 (followers 5, 6, 7); suffix is the final "1"
    history = [1, 5, 1, 6, 1, 7, 1]
    expected = {TIE_RECENT: [7, 1], TIE_EARLIEST: [5, 1, 6], TIE_LONGEST: [6, 1, 7]}
    for tie, tokens in expected.items():
        with NgramIndex(ngram_min=1, ngram_max=1, tie=tie) as idx:
            idx.append(history)
            assert proposal(idx, 3) == (tokens, SOURCE_HISTORY, 1), tie
    with NgramIndex(ngram_min=1, ngram_max=1, tie=TIE_LONGEST) as idx:
        idx.append(history)                               # k=2: newest uncut is the newest
        assert proposal(idx, 2) == ([7, 1], SOURCE_HISTORY, 1)
        # k=9: every continuation is cut short, so the oldest (longest) one
        assert proposal(idx, 9) == ([5, 1, 6, 1, 7, 1], SOURCE_HISTORY, 1)


def test_overlapping_occurrence_counts():
    with NgramIndex(ngram_min=2, ngram_max=2) as idx:
        idx.append([3, 3, 3])                             # "3 3" also ends at 2
        assert proposal(idx, 4) == ([3], SOURCE_HISTORY, 2)


def test_candidates_are_distinct_and_start_with_the_proposal():
    with NgramIndex(ngram_min=1, ngram_max=2) as idx:
        idx.append([1, 5, 1, 6, 1, 5, 1])
        got = [(c.tokens.tolist(), c.source, c.ngram_len) for c in idx.candidates(2, 10)]
        assert got == [([6, 1], SOURCE_HISTORY, 2), ([5, 1], SOURCE_HISTORY, 1)]
        assert got[0] == proposal(idx, 2)
        assert idx.candidates(2, 1)[0].tokens.tolist() == [6, 1]
        assert idx.candidates(2, 0) == []
        assert [c.tokens.tolist() for c in idx.candidates(0, 5)] == [[]]


# ---- edge cases ---------------------------------------------------------------------------------

def test_support_counts_occurrences_and_agreeing_continuations():
    idx = NgramIndex(ngram_min=1, ngram_max=2, tie=TIE_EARLIEST)
    idx.append([9, 1, 5, 6, 2, 1, 5, 6, 3, 1, 5, 7, 4, 1])   # "1" continues "5 6" twice, "5 7" once
    m = idx.propose(3)
    assert (m.tokens.tolist(), m.ngram_len) == ([5, 6, 2], 1)
    n_occ, agree = idx.support(m)
    assert (n_occ, agree.tolist()) == (3, [3, 2, 1])
    idx.append([8])                                           # "1 8": no match at all
    m = idx.propose(3)
    assert m.ngram_len == 0 and idx.support(m)[0] == 0
    doc_idx = NgramIndex(ngram_min=1, ngram_max=2, tie=TIE_RECENT)
    doc_idx.append([4, 4])
    doc_idx.set_document([7, 4, 4, 1, 4, 4, 1, 4, 4, 2])     # "4 4" in the document: 3 times
    m = doc_idx.propose(2)
    assert (m.source, m.ngram_len) == (SOURCE_DOCUMENT, 2)
    n_occ, agree = doc_idx.support(m)
    assert n_occ == 3 and agree.tolist()[0] == 1              # newest: "2"; others "1 4"


def test_empty_history():
    with NgramIndex() as idx:
        assert len(idx) == 0
        assert proposal(idx, 5) == ([], SOURCE_HISTORY, 0)
        assert idx.candidates(5, 3) == []
        idx.append([])
        idx.append(np.zeros(0, np.int32))
        idx.set_document([])
        assert len(idx) == 0
        idx.set_document([1, 2, 3])                       # no suffix to look up
        assert proposal(idx, 5) == ([], SOURCE_HISTORY, 0)


def test_history_shorter_than_ngram_min():
    with NgramIndex(ngram_min=3, ngram_max=4) as idx:
        idx.append([1, 1])
        idx.set_document([1, 1, 2])
        assert proposal(idx, 2) == ([], SOURCE_HISTORY, 0)
        idx.append([1])                                   # "1 1 1": no earlier occurrence
        assert proposal(idx, 2) == ([], SOURCE_HISTORY, 0)
        idx.append([1])                                   # "1 1 1" ends at 3 in the history
        assert proposal(idx, 2) == ([1], SOURCE_HISTORY, 3)


def test_k_zero_reports_the_match_without_tokens():
    with NgramIndex() as idx:
        idx.append([4, 2, 4])
        assert proposal(idx, 0) == ([], SOURCE_HISTORY, 1)
        with pytest.raises(ValueError, match="k must be >= 0"):
            idx.propose(-1)


def test_extreme_token_ids():
    with NgramIndex(ngram_min=1, ngram_max=2) as idx:
        idx.append([TOKEN_MAX, 0, TOKEN_MAX])
        assert proposal(idx, 3) == ([0, TOKEN_MAX], SOURCE_HISTORY, 1)
        idx.append(np.array([0], dtype=np.int64))
        assert proposal(idx, 3) == ([TOKEN_MAX, 0], SOURCE_HISTORY, 2)
        for bad in ([TOKEN_MAX + 1], np.array([2**31], dtype=np.int64)):
            with pytest.raises(ValueError, match=r"\[0, 2\*\*31 - 1\]"):
                idx.append(bad)
        assert len(idx) == 4


@pytest.mark.parametrize("bad", [[-1], [1, 2, -3], np.array([5, -2**31], dtype=np.int32),
                                 np.array([-7], dtype=np.int64)])
def test_negative_ids_rejected_all_or_nothing(bad):
    with NgramIndex() as idx:
        idx.append([1, 2])
        with pytest.raises(ValueError, match="token ids must be in"):
            idx.append(bad)
        with pytest.raises(ValueError, match="token ids must be in"):
            idx.set_document(bad)
        assert len(idx) == 2
        assert proposal(idx, 2) == ([], SOURCE_HISTORY, 0)


def test_bad_inputs_are_type_errors():
    with NgramIndex() as idx:
        for bad in (5, [1.5], np.zeros((2, 2), np.int32), ["a"]):
            with pytest.raises(TypeError):
                idx.append(bad)


def test_truncation_bounds():
    with NgramIndex() as idx:
        idx.append([1, 2, 1])
        with pytest.raises(ValueError, match=r"n_keep must be in \[0, 3\]"):
            idx.truncate(-1)
        with pytest.raises(ValueError, match=r"n_keep must be in \[0, 3\]"):
            idx.truncate(4)
        idx.truncate(3)
        assert proposal(idx, 2) == ([2, 1], SOURCE_HISTORY, 1)
        idx.truncate(0)
        assert len(idx) == 0 and proposal(idx, 2) == ([], SOURCE_HISTORY, 0)
        idx.append([1, 2, 1])
        assert proposal(idx, 2) == ([2, 1], SOURCE_HISTORY, 1)


def test_bad_parameters():
    for kwargs in ({"tie": "newest"}, {"ngram_min": 0}, {"ngram_min": 3, "ngram_max": 2},
                   {"ngram_max": ngram.NGRAM_LIMIT + 1}, {"capacity": 0}):
        with pytest.raises(ValueError):
            NgramIndex(**kwargs)


def test_close_is_explicit_and_final():
    idx = NgramIndex()
    idx.append([1, 2])
    idx.close()
    idx.close()
    for call in (lambda: idx.propose(1), lambda: idx.append([1]), lambda: len(idx)):
        with pytest.raises(ValueError, match="closed"):
            call()
    with NgramIndex() as idx2:
        pass
    with pytest.raises(ValueError, match="closed"):
        idx2.truncate(0)


def test_match_is_frozen():
    m = Match(np.zeros(0, np.int32), SOURCE_HISTORY, 0)
    with pytest.raises(AttributeError):
        m.source = 1  # type: ignore[misc]


def test_int32_arrays_pass_without_copy_and_strided_ones_work():
    tokens = np.arange(20, dtype=np.int32) % 4
    with NgramIndex(capacity=1, tie=TIE_RECENT) as idx:  # grows 1 -> 32
        idx.append(tokens[::2])                           # strided: 0 2 0 2 ...
        idx.append(tokens[:3])                            # 0 1 2
        assert len(idx) == 13
        assert proposal(idx, 3) == ([0, 1, 2], SOURCE_HISTORY, 1)


def test_table_survives_truncate_append_churn():
    # distinct ids fill the 1-gram table to its maximum load (1/2), so deletions shift entries;
    # afterwards every token must still be found: appending a copy of h[j] proposes h[j + 1]
    rng = np.random.default_rng(2)
    fresh = iter(rng.permutation(10**7).astype(np.int32))
    history: list[int] = []
    with NgramIndex(ngram_min=1, ngram_max=1, capacity=1024) as idx:
        for _ in range(30):
            n_keep = int(rng.integers(0, len(history) + 1))
            idx.truncate(n_keep)
            del history[n_keep:]
            tokens = [int(next(fresh)) for _ in range(1023 - n_keep)]
            idx.append(tokens)
            history += tokens
            for j in rng.choice(len(history) - 1, 200, replace=False):
                idx.append([history[j]])
                assert proposal(idx, 1) == ([history[j + 1]], SOURCE_HISTORY, 1)
                idx.truncate(len(history))


def test_million_token_history():
    rng = np.random.default_rng(1)
    n = 1_000_000
    history = rng.integers(0, 50_000, n, dtype=np.int32)
    history[500_000:500_004] = [50_001, 50_002, 50_003, 50_004]   # ids no random token uses
    history[500_004:500_010] = [7, 8, 9, 10, 11, 12]
    history[-4:] = [50_001, 50_002, 50_003, 50_004]
    with NgramIndex(ngram_min=1, ngram_max=4) as idx:
        for chunk in np.array_split(history, 7):
            idx.append(chunk)
        assert len(idx) == n
        assert proposal(idx, 6) == ([7, 8, 9, 10, 11, 12], SOURCE_HISTORY, 4)
        idx.truncate(500_002)                             # "50001 50002" now ends at 500_002
        idx.append([50_001, 50_002])
        assert proposal(idx, 3) == ([50_001, 50_002], SOURCE_HISTORY, 2)
        idx.truncate(10)
        assert len(idx) == 10
        ref = ReferenceMatcher(1, 4, TIE_RECENT, ngram.MAX_VISITED)
        ref.append(history[:10])
        assert idx.propose(4).tokens.tolist() == ref.propose(4)[0]


# ---- agreement with the reference on random cases ------------------------------------------------

CASES_PER_TEST = 20_000   # x 6 tests = 120,000 random cases


def random_tokens(rng, vocab, n):
    if vocab is None:   # large vocabulary, with the int32 extremes mixed in
        t = rng.integers(0, TOKEN_MAX, n, dtype=np.int64, endpoint=True)
        t[rng.random(n) < 0.05] = 0
        t[rng.random(n) < 0.05] = TOKEN_MAX
        return t.astype(np.int32)
    return rng.integers(0, vocab, n, dtype=np.int32)


def chunk(rng, vocab, history, document):
    """Random tokens, or (usually, for large vocabularies) a span copied from a source."""
    n = int(rng.integers(1, 9))
    source = history if rng.random() < 0.7 else document
    if len(source) and rng.random() < (0.6 if vocab is None else 0.2):
        start = int(rng.integers(0, len(source)))
        return np.asarray(source[start:start + n], dtype=np.int32)
    return random_tokens(rng, vocab, n)


def check(idx, ref, rng):
    """One random query (propose or candidates) compared with the reference."""
    k = int(rng.integers(0, 13)) if rng.random() < 0.9 else int(rng.integers(13, 300))
    if rng.random() < 0.8:
        m = idx.propose(k)
        assert (m.tokens.tolist(), m.source, m.ngram_len, idx._match.pos) == ref.propose(k)
        n_occ, agree = idx.support(m)
        assert (n_occ, agree.tolist()) == ref.support(m.tokens.tolist(), m.source, m.ngram_len)
        both = (m.tokens.tolist(), m.source, m.ngram_len, n_occ, agree.tolist())
        assert idx.propose_supported(k) == (both if len(m.tokens) else None)   # the fast path
    else:
        n = int(rng.integers(0, 9)) if rng.random() < 0.8 else int(rng.integers(9, 300))
        got = [(c.tokens.tolist(), c.source, c.ngram_len) for c in idx.candidates(k, n)]
        assert got == [c[:3] for c in ref.candidates(k, n)]


def run_session(rng, tie, vocab, n_ops):
    ngram_min = int(rng.integers(1, 4))
    ngram_max = ngram_min + int(rng.integers(0, 4))
    max_len = int(rng.integers(8, 200))
    if vocab is not None and rng.random() < 0.15:   # long runs of 2 symbols: > MAX_VISITED occurrences
        vocab, ngram_min, ngram_max, max_len = 2, 1, int(rng.integers(1, 3)), 600
    idx = NgramIndex(ngram_min, ngram_max, tie, capacity=int(rng.integers(1, 40)))
    ref = ReferenceMatcher(ngram_min, ngram_max, tie, ngram.MAX_VISITED)
    with idx:
        for _ in range(n_ops):
            r = rng.random()
            if r < 0.55:
                tokens = chunk(rng, vocab, ref.history, ref.document)
                idx.append(tokens if rng.random() < 0.5 else tokens.tolist())
                ref.append(tokens)
            elif r < 0.75 or len(ref.history) > max_len:
                n_keep = len(ref.history) - int(rng.integers(0, min(len(ref.history), 12) + 1))
                idx.truncate(n_keep)
                ref.truncate(n_keep)
            elif r < 0.80:
                doc = None if rng.random() < 0.2 else chunk_document(rng, vocab, ref.history)
                idx.set_document(doc)
                ref.set_document(doc)
            assert len(idx) == len(ref.history)
            check(idx, ref, rng)
    return n_ops


def chunk_document(rng, vocab, history):
    doc = random_tokens(rng, vocab, int(rng.integers(0, 60)))
    if len(history) and len(doc) and rng.random() < 0.7:   # plant a piece of the history
        start = int(rng.integers(0, len(history)))
        piece = history[start:start + int(rng.integers(1, 10))]
        at = int(rng.integers(0, len(doc)))
        doc = np.concatenate([doc[:at], np.asarray(piece, np.int32), doc[at:]])
    return doc


@pytest.mark.parametrize("tie", TIES)
@pytest.mark.parametrize("regime", ["small-vocab", "large-vocab"])
def test_agrees_with_reference_on_random_cases(tie, regime):
    rng = np.random.default_rng([TIES.index(tie), regime == "large-vocab"])
    cases = 0
    while cases < CASES_PER_TEST:
        vocab = int(rng.integers(2, 9)) if regime == "small-vocab" else None
        cases += run_session(rng, tie, vocab, n_ops=int(rng.integers(1, 400)))
    assert cases >= CASES_PER_TEST
