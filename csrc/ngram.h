/* ngram.h: incremental n-gram matcher for prompt-lookup speculative decoding.
 *
 * It owns one job: given a token history that grows and shrinks one step at a time, answer "the
 * longest recent suffix that occurred before: which tokens followed it?" in time that does not
 * depend on how long the history is. It does not allocate, sample, or know about llama.cpp.
 *
 * MEMORY. The caller owns all memory. Ask lsng_index_bytes() for the size of an index that holds
 * up to `capacity` tokens, hand lsng_index_init() a block of that size (8-byte aligned), and free
 * the block when done; there is nothing else to release. The index points into its own block, so
 * never move or copy a block: to grow, init a bigger one and append the old tokens to it
 * (lsng_tokens()), O(n), amortised by the caller doubling the capacity.
 *
 * DEFINITIONS (every function below uses these words).
 *   history     the tokens h[0..n) appended so far, minus those truncated.
 *   document    an optional second index (same ngram_min/ngram_max) searched read-only, e.g. the
 *               file being edited; it is an lsng_index like the history, built once by appending.
 *   suffix(L)   h[n-L..n), the last L tokens of the history.
 *   occurrence  of an L-gram g in a source s[0..m): an end position e with s[e-L..e) == g and
 *               e < m, i.e. at least one token follows it. The suffix itself (e == n) is never an
 *               occurrence in the history; earlier, overlapping ones are ("a a a": suffix(2) = "a a"
 *               occurs at e = 2).
 *   continuation of occurrence e with budget k: s[e .. min(e + k, m)). From the history it is
 *               simply what followed the earlier occurrence, and may run into the current suffix;
 *               it stops at the end of the history (never wraps around or repeats itself).
 *
 * PROPOSE. For L from min(ngram_max, n) down to ngram_min: if suffix(L) occurs in the history,
 * answer from the history; else if it occurs in the document, answer from the document; else try
 * L - 1. So the longer match wins, and on equal length the history (the model's own recent text)
 * beats the document. Within the chosen source the tie policy picks one occurrence:
 *   LSNG_TIE_RECENT    the largest e;
 *   LSNG_TIE_EARLIEST  the smallest e (what llama-cpp-python's prompt lookup scans for);
 *   LSNG_TIE_LONGEST   among the LSNG_MAX_CHAIN most recent occurrences (newest first), the first
 *                      whose continuation is not cut short (m - e >= k); if none is, the oldest of
 *                      them, whose continuation is then the longest one.
 * No match: n_tokens = 0, ngram_len = 0, source = LSNG_SOURCE_HISTORY, pos = -1.
 *
 * Worked example, ngram_min = 1, ngram_max = 3, k = 4, history "x a b c y a b" (n = 7):
 *   suffix(3) = "y a b" occurs nowhere earlier; suffix(2) = "a b" occurs at e = 3;
 *   continuation h[3..7) = "c y a b", ngram_len = 2, source = history, pos = 3.
 *   With document "a b d e" the history still wins (both match "a b": equal length, history
 *   first); with document "y a b z" the document wins: its match is longer (3), continuation "z".
 *
 * CANDIDATES. Up to n_max distinct continuations (compared token by token); none when there is
 * no match. The first one is exactly what lsng_propose returns. Then, for L from longest to
 * shortest, history before document: the tie-policy pick, followed by the LSNG_MAX_CHAIN most
 * recent occurrences, newest first; a continuation equal to one already listed is skipped.
 *
 * SUPPORT. How many earlier occurrences back a proposal m (what lsng_propose returned for this
 * history and document; tokens = its continuation): the LSNG_MAX_CHAIN newest occurrences of
 * suffix(m->ngram_len) in m's source are visited, *n_occ = how many; agree[i] (i < m->n_tokens) =
 * how many of them continue with exactly tokens[0..i] (a continuation cut short by the end of its
 * source does not agree past its end). agree[] never increases with i. Drafts whose occurrences
 * all continue alike are accepted more often than those where one occurrence of several says so.
 * m->ngram_len == 0 (no match): *n_occ = 0 and agree[] is not written.
 *
 * COMPLEXITY (G = ngram_max - ngram_min + 1 tables, one per length, open addressing with linear
 * probing at load <= 1/2; each table entry keeps the newest and oldest end position of its n-gram,
 * and prev[L][e] chains each occurrence to the previous one of the same n-gram):
 *   append       O(ngram_max) expected per token;
 *   truncate     O(ngram_max) expected per token removed (prev[] chains undo the appends exactly);
 *   propose      O(ngram_max + k) expected, + O(LSNG_MAX_CHAIN) for TIE_LONGEST;
 *   candidates   O(G * LSNG_MAX_CHAIN * n_max * k) worst case;
 *   support      O(ngram_max + LSNG_MAX_CHAIN * k);
 * none of them depends on the history length. Memory: about (4 + 4G + 24G) bytes per token of
 * capacity (tokens, prev chains, hash slots).
 *
 * ERRORS (the draft store, store.h, follows the same convention). Functions that act return
 * LSNG_OK (0) or a negative LSNG_ERR_* code (lsng_strerror names it) and change nothing on
 * error: an append with a negative token id appends none of the tokens. Getters of a count
 * (lsng_len, lsng_capacity) return it, or LSNG_ERR_HANDLE (negative) for a handle that is not an
 * initialised index; getters of a pointer (lsng_tokens) return NULL for one; lsng_index_bytes
 * returns 0 for invalid params. Token ids are int32_t like llama_token; any id in [0, INT32_MAX]
 * is valid.
 *
 * DEFAULTS. The params struct has none in C: the caller sets every field. localspec's defaults
 * (ngram_min 1, ngram_max 8, LSNG_TIE_EARLIEST) live once, in localspec/speculative/ngram.py.
 *
 * The block between the CDEF markers below is plain declarations (no preprocessor lines): the
 * cffi build script feeds it to cdef() as is.
 */
#ifndef LSNG_NGRAM_H
#define LSNG_NGRAM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* LSNG_CDEF_BEGIN */
enum {
    LSNG_OK = 0,
    LSNG_ERR_PARAMS = -1,       /* bad ngram_min/ngram_max/tie/capacity/k/n_max */
    LSNG_ERR_MEMORY = -2,       /* block too small or misaligned for the requested capacity */
    LSNG_ERR_FULL = -3,         /* append would exceed the capacity: grow first */
    LSNG_ERR_TOKEN = -4,        /* negative token id */
    LSNG_ERR_RANGE = -5,        /* truncate to n_keep < 0 or n_keep > length */
    LSNG_ERR_INCOMPATIBLE = -6, /* document index has different ngram_min/ngram_max */
    LSNG_ERR_HANDLE = -7        /* not an initialised index */
};

enum { LSNG_TIE_RECENT = 0, LSNG_TIE_EARLIEST = 1, LSNG_TIE_LONGEST = 2 };
enum { LSNG_SOURCE_HISTORY = 0, LSNG_SOURCE_DOCUMENT = 1 };
enum {
    LSNG_NGRAM_LIMIT = 32,      /* largest allowed ngram_max */
    LSNG_MAX_CHAIN = 64,        /* occurrences visited per n-gram by TIE_LONGEST and candidates */
    LSNG_MAX_CAPACITY = 1073741824  /* 2^30 tokens */
};

typedef struct lsng_params {
    int32_t ngram_min;          /* shortest suffix tried, >= 1 */
    int32_t ngram_max;          /* longest suffix tried, <= LSNG_NGRAM_LIMIT */
    int32_t tie;                /* LSNG_TIE_* */
} lsng_params;

typedef struct lsng_match {
    int32_t n_tokens;           /* continuation length written to out_tokens, 0..k */
    int32_t source;             /* LSNG_SOURCE_HISTORY or LSNG_SOURCE_DOCUMENT */
    int32_t ngram_len;          /* L of the matched suffix; 0 when there is no match */
    int32_t pos;                /* e: where the continuation starts in its source; -1 if none */
} lsng_match;

typedef struct lsng_index lsng_index;   /* opaque; lives inside the caller's block */

/* Bytes needed for an index of `capacity` tokens; 0 if the params or capacity are invalid. */
size_t lsng_index_bytes(const lsng_params *params, int32_t capacity);

/* Lays an empty index out in `mem` (n_bytes >= lsng_index_bytes(), 8-byte aligned): O(capacity). */
int lsng_index_init(void *mem, size_t n_bytes, const lsng_params *params, int32_t capacity,
                    lsng_index **out);

/* Appends n tokens (all >= 0) in O(n * ngram_max); all or nothing. */
int lsng_append(lsng_index *index, const int32_t *tokens, int32_t n);

/* Keeps the first n_keep tokens, exactly undoing the later appends. */
int lsng_truncate(lsng_index *index, int32_t n_keep);

/* Tokens held, and the most the block holds; LSNG_ERR_HANDLE for a bad handle. */
int32_t lsng_len(const lsng_index *index);
int32_t lsng_capacity(const lsng_index *index);
/* [lsng_len] int32, a read-only view; NULL for a bad handle. */
const int32_t *lsng_tokens(const lsng_index *index);

/* The proposal for the next k tokens; document may be NULL. out_tokens: [k] (NULL if k == 0). */
int lsng_propose(const lsng_index *history, const lsng_index *document, int32_t k,
                 int32_t *out_tokens, lsng_match *out);

/* Up to n_max distinct continuations; *n_out = how many. out_tokens: [n_max, k], row i holds
 * out[i].n_tokens tokens; out: [n_max]. */
int lsng_candidates(const lsng_index *history, const lsng_index *document, int32_t k,
                    int32_t n_max, int32_t *out_tokens, lsng_match *out, int32_t *n_out);

/* Occurrence support of proposal m (see SUPPORT); agree: [m->n_tokens] (NULL if 0 tokens). */
int lsng_support(const lsng_index *history, const lsng_index *document, const lsng_match *m,
                 const int32_t *tokens, int32_t *agree, int32_t *n_occ);

const char *lsng_strerror(int code);
/* LSNG_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* LSNG_NGRAM_H */
