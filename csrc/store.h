/* store.h: the draft store, a bounded suffix index over past outputs with continuation counts.
 *
 * It owns one job: given many past outputs (documents, separated by LSST_BREAK) and the current
 * request's last few tokens, answer "what has followed this context before, how often, and how
 * sure is each next token?" in time that does not depend on how many tokens are stored. It does
 * not allocate, persist, or know about llama.cpp; the Python wrapper (localspec/speculative/store.py)
 * owns memory, growth, eviction and files.
 *
 * MEMORY. As the n-gram matcher (ngram.h): the caller hands lsst_init() a block of
 * lsst_bytes(params, capacity) bytes, 8-byte aligned, and frees it when done. The index points
 * into its own block: never move or copy it. `capacity` is always the tokens a block holds; how
 * many tokens a store may keep in all (a RAM budget) is the caller's (store.py: max_tokens),
 * reached by growing into larger blocks.
 *
 * DEFINITIONS.
 *   corpus      the tokens t[0..n) appended so far: token ids >= 0 and LSST_BREAK (-1), which
 *               ends one past output. No n-gram and no continuation crosses a BREAK.
 *   occurrence  of an L-gram g: an end position e with t[e-L..e) == g, no BREAK in it, and
 *               t[e] a token (not BREAK, e < n): at least one token followed g there.
 *   count(s)    for a string s = g + d (d: a draft continuation): how many of the visited
 *               occurrences e of g continue with d, i.e. t[e..e+|d|) == d. It is the count of
 *               the node s of a suffix tree over the corpus restricted to those occurrences.
 *
 * PROPOSE (context c[0..m), budget k). For L from min(ngram_max, m) down to ngram_min: if
 * suffix(L) of c has occurrences, the newest max_chain of them are visited (newest first) and
 * the draft grows greedily down the implicit suffix tree: at depth i the next token is the one
 * most of the still-agreeing occurrences continue with (a tie goes to the newest), and its
 * ratio is count(g + d[0..i]) / count(g + d[0..i-1]) (count(g) = n_occ). score(i) is the
 * product of the ratios of tokens 0..i; the draft stops before the first token whose score
 * falls below `floor`, at k tokens, or when no occurrence continues. agree[i] = count(g +
 * d[0..i]). Longer contexts win: a shorter L is tried only when the longer has no occurrence.
 * Worked example, ngram 2..2, corpus "1 2 3 | 1 2 3 | 1 2 4" (| = BREAK), context "0 1 2":
 *   suffix(2) = "1 2" occurs 3 times (n_occ = 3); 2 of them continue with 3: d = [3],
 *   agree = [2], score = 2/3; all three outputs end after that, so the draft is one token.
 *
 * COMPLEXITY (G = ngram_max - ngram_min + 1 tables, open addressing at load <= 1/2, each slot
 * the newest end position of its n-gram, prev[L][e] chains older occurrences):
 *   append      O(G) expected per token;  propose  O(G * ngram_max + max_chain * k * d) where d
 *   (<= max_chain) is the number of distinct next tokens at a depth (1-3 typically);
 *   drop_oldest O(n): the corpus moves down and the tables are rebuilt.
 * Memory: 4 + 4G bytes per token of capacity + G * 4 * (slots per table) (load <= 1/2).
 *
 * ERRORS, as in ngram.h. Functions that act return LSST_OK (0) or a negative LSST_ERR_* code
 * (lsst_strerror names it) and change nothing on error. Getters of a count (lsst_len,
 * lsst_capacity) return it, or LSST_ERR_HANDLE (negative) for a handle that is not an
 * initialised store; lsst_tokens returns NULL for one; lsst_bytes returns 0 for invalid params.
 *
 * DEFAULTS. None in C: the caller sets every field of lsst_params. localspec's (contexts 2..6,
 * 64 occurrences counted, floor 0.1) live once, in localspec/speculative/store.py.
 *
 * The block between the CDEF markers is plain declarations for cffi's cdef().
 */
#ifndef LSST_STORE_H
#define LSST_STORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* LSST_CDEF_BEGIN */
enum {
    LSST_OK = 0,
    LSST_ERR_PARAMS = -1,       /* bad ngram_min/ngram_max/max_chain/floor/capacity/k */
    LSST_ERR_MEMORY = -2,       /* block too small or misaligned */
    LSST_ERR_FULL = -3,         /* append would exceed the capacity: drop_oldest first */
    LSST_ERR_TOKEN = -4,        /* token id < -1 */
    LSST_ERR_RANGE = -5,        /* drop_oldest of more tokens than held */
    LSST_ERR_HANDLE = -6        /* not an initialised store */
};

enum {
    LSST_BREAK = -1,            /* ends one past output in the corpus */
    LSST_NGRAM_LIMIT = 16,      /* largest ngram_max */
    LSST_CHAIN_LIMIT = 256,     /* largest max_chain */
    LSST_MAX_CAPACITY = 268435456   /* 2^28 tokens */
};

typedef struct lsst_params {
    int32_t ngram_min;          /* shortest context tried, >= 1 */
    int32_t ngram_max;          /* longest context tried, <= LSST_NGRAM_LIMIT */
    int32_t max_chain;          /* newest occurrences counted, 1..LSST_CHAIN_LIMIT */
    float floor;                /* least score (product of count ratios) a token may have, 0..1 */
} lsst_params;

typedef struct lsst_match {
    int32_t n_tokens;           /* draft length written, 0..k */
    int32_t ngram_len;          /* L of the matched context; 0 when nothing matched */
    int32_t n_occ;              /* occurrences of the context visited (count of the root) */
    float score;                /* product of the count ratios of the drafted tokens */
} lsst_match;

typedef struct lsst_store lsst_store;   /* opaque; lives inside the caller's block */

/* Bytes needed for a store of `capacity` tokens; 0 if the params or capacity are invalid. */
size_t lsst_bytes(const lsst_params *params, int32_t capacity);
int lsst_init(void *mem, size_t n_bytes, const lsst_params *params, int32_t capacity,
              lsst_store **out);

/* Appends n tokens (ids >= 0 or LSST_BREAK); all or nothing (LSST_ERR_FULL if they do not fit). */
int lsst_append(lsst_store *store, const int32_t *tokens, int32_t n);

/* Forgets the oldest n_drop tokens (eviction): O(tokens held). */
int lsst_drop_oldest(lsst_store *store, int32_t n_drop);

/* Tokens held, and the most the block holds; LSST_ERR_HANDLE for a bad handle. */
int32_t lsst_len(const lsst_store *store);
int32_t lsst_capacity(const lsst_store *store);
/* [lsst_len] int32, a read-only view; NULL for a bad handle. */
const int32_t *lsst_tokens(const lsst_store *store);

/* The draft for context[0..m): out_tokens [k], out_agree [k] (both NULL if k == 0). */
int lsst_propose(const lsst_store *store, const int32_t *context, int32_t m, int32_t k,
                 int32_t *out_tokens, int32_t *out_agree, lsst_match *out);

const char *lsst_strerror(int code);
/* LSST_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* LSST_STORE_H */
