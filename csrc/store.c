/* store.c: the draft store declared in store.h (definitions, complexity, a worked example there).
 *
 * Layout of one store inside the caller's block (table.h, shared with the n-gram matcher):
 *   struct lsst_store | tokens [capacity] | prev [G, capacity] | slots [G, n_slots]
 * A slot holds the newest end position of its n-gram (or LSST_NONE); the key is not stored: the
 * n-gram is read back from the corpus at that position and compared, which keeps a slot at 4
 * bytes (the store is meant to hold a million tokens). prev[L][e] is the previous occurrence.
 */
#include "store.h"
#include "hashing.h"
#include "table.h"

#include <string.h>

#define LSST_MAGIC 0x6c737374u     /* "lsst" */
#define LSST_NONE LS_NONE
#define LSST_SEED 0x13198a2e03707344ull

struct lsst_store {
    uint32_t magic;
    lsst_params params;
    int32_t capacity;
    int32_t n;
    uint32_t mask;         /* slots per table - 1 */
    int32_t *tokens;       /* [capacity] */
    int32_t *prev;         /* [G, capacity] */
    int32_t *slots;        /* [G, mask + 1] */
};

static int params_ok(const lsst_params *p)
{
    return p && ls_ngram_range_ok(p->ngram_min, p->ngram_max, LSST_NGRAM_LIMIT) &&
           p->max_chain >= 1 && p->max_chain <= LSST_CHAIN_LIMIT && p->floor >= 0.0f &&
           p->floor <= 1.0f;
}

static int store_ok(const lsst_store *s) { return s && s->magic == LSST_MAGIC; }

static int32_t *prev_of(const lsst_store *x, int32_t L)
{
    return ls_prev_of(x->prev, x->params.ngram_min, x->capacity, L);
}

/* The slot of key[0..L) in the L-table, or the free slot where it would go. */
static int32_t *find(const lsst_store *x, int32_t L, uint32_t hash, const int32_t *key)
{
    int32_t *tab = (int32_t *)ls_table(x->slots, sizeof(int32_t), x->params.ngram_min, x->mask,
                                       L);
    return &tab[ls_find((const char *)tab, sizeof(int32_t), 0, LS_NO_HASH, x->mask, x->tokens,
                        L, hash, key)];
}

/* Appends one token; the n-grams ending at e (none across a BREAK) gain an occurrence when the
 * token after them is a real token. */
static void push(lsst_store *x, int32_t token)
{
    int32_t e = x->n;
    x->tokens[e] = token;
    x->n = e + 1;
    if (token == LSST_BREAK) return;
    int32_t lmax = e < x->params.ngram_max ? e : x->params.ngram_max;
    uint64_t h = LSST_SEED;
    for (int32_t L = 1; L <= lmax; L++) {
        int32_t t = x->tokens[e - L];
        if (t == LSST_BREAK) break;
        h = hash_step(h, t);
        if (L < x->params.ngram_min) continue;
        int32_t *slot = find(x, L, hash_final(h), x->tokens + e - L);
        prev_of(x, L)[e] = *slot;
        *slot = e;
    }
}

static void clear_tables(lsst_store *x)
{
    size_t total = (size_t)(x->params.ngram_max - x->params.ngram_min + 1) * ((size_t)x->mask + 1);
    memset(x->slots, 0xff, total * sizeof(int32_t));     /* every slot LSST_NONE (-1) */
}

static ls_layout layout(const lsst_params *params, int32_t capacity)
{
    return ls_layout_of(sizeof(struct lsst_store), params->ngram_max - params->ngram_min + 1,
                        capacity, sizeof(int32_t));
}

size_t lsst_bytes(const lsst_params *params, int32_t capacity)
{
    if (!params_ok(params) || capacity < 1 || capacity > LSST_MAX_CAPACITY) return 0;
    return (size_t)layout(params, capacity).total;
}

int lsst_init(void *mem, size_t n_bytes, const lsst_params *params, int32_t capacity,
              lsst_store **out)
{
    size_t need = lsst_bytes(params, capacity);
    if (!out || need == 0) return LSST_ERR_PARAMS;
    if (!ls_block_ok(mem, n_bytes, need)) return LSST_ERR_MEMORY;
    lsst_store *x = (lsst_store *)mem;
    void *slots_at;
    ls_carve(mem, layout(params, capacity), &x->tokens, &x->prev, &slots_at);
    x->slots = (int32_t *)slots_at;
    x->params = *params;
    x->capacity = capacity;
    x->n = 0;
    x->mask = (uint32_t)(ls_n_slots(capacity) - 1);
    clear_tables(x);
    x->magic = LSST_MAGIC;
    *out = x;
    return LSST_OK;
}

int lsst_append(lsst_store *store, const int32_t *tokens, int32_t n)
{
    if (!store_ok(store)) return LSST_ERR_HANDLE;
    if (n < 0 || (n > 0 && !tokens)) return LSST_ERR_PARAMS;
    if (n > store->capacity - store->n) return LSST_ERR_FULL;
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < LSST_BREAK) return LSST_ERR_TOKEN;
    for (int32_t i = 0; i < n; i++) push(store, tokens[i]);
    return LSST_OK;
}

int lsst_drop_oldest(lsst_store *store, int32_t n_drop)
{
    if (!store_ok(store)) return LSST_ERR_HANDLE;
    if (n_drop < 0 || n_drop > store->n) return LSST_ERR_RANGE;
    int32_t keep = store->n - n_drop;
    memmove(store->tokens, store->tokens + n_drop, (size_t)keep * sizeof(int32_t));
    clear_tables(store);
    store->n = 0;
    for (int32_t i = 0; i < keep; i++) push(store, store->tokens[i]);
    return LSST_OK;
}

int32_t lsst_len(const lsst_store *store) { return store_ok(store) ? store->n : LSST_ERR_HANDLE; }

int32_t lsst_capacity(const lsst_store *store)
{
    return store_ok(store) ? store->capacity : LSST_ERR_HANDLE;
}
const int32_t *lsst_tokens(const lsst_store *store) { return store_ok(store) ? store->tokens : 0; }

/* The token occurrence e continues with at depth i, or LSST_BREAK where its output ended. */
static int32_t next_of(const lsst_store *x, int32_t e, int32_t i)
{
    return e + i < x->n ? x->tokens[e + i] : LSST_BREAK;
}

/* Grows the draft down the implicit suffix tree from the occurrences alive[0..n_alive)
 * (newest first): at each depth the token most of them continue with (first seen on a tie). */
static void grow(const lsst_store *x, int32_t *alive, int32_t n_alive, int32_t k,
                 int32_t *out_tokens, int32_t *out_agree, lsst_match *out)
{
    int32_t seen[LSST_CHAIN_LIMIT], count[LSST_CHAIN_LIMIT];
    int32_t parent = n_alive;
    float score = 1.0f;
    int32_t i = 0;
    for (; i < k && n_alive > 0; i++) {
        int32_t nd = 0, best = -1;
        for (int32_t j = 0; j < n_alive; j++) {
            int32_t t = next_of(x, alive[j], i), d = 0;
            if (t == LSST_BREAK) continue;
            while (d < nd && seen[d] != t) d++;
            if (d == nd) {
                seen[nd] = t;
                count[nd++] = 0;
            }
            count[d]++;
        }
        for (int32_t d = 0; d < nd; d++)            /* a tie: the first seen, the newest */
            if (best < 0 || count[d] > count[best]) best = d;
        if (best < 0) break;
        float next = score * (float)count[best] / (float)parent;
        if (next < x->params.floor) break;
        score = next;
        out_tokens[i] = seen[best];
        out_agree[i] = count[best];
        parent = count[best];
        int32_t kept = 0;
        for (int32_t j = 0; j < n_alive; j++)
            if (next_of(x, alive[j], i) == seen[best]) alive[kept++] = alive[j];
        n_alive = kept;
    }
    out->n_tokens = i;
    out->score = i ? score : 0.0f;
}

int lsst_propose(const lsst_store *store, const int32_t *context, int32_t m, int32_t k,
                 int32_t *out_tokens, int32_t *out_agree, lsst_match *out)
{
    if (!store_ok(store)) return LSST_ERR_HANDLE;
    if (!out || m < 0 || k < 0 || (m > 0 && !context) || (k > 0 && (!out_tokens || !out_agree)))
        return LSST_ERR_PARAMS;
    const lsst_params *p = &store->params;
    int32_t lmax = m < p->ngram_max ? m : p->ngram_max;
    for (int32_t i = m - lmax; i < m; i++)
        if (context[i] < 0) return LSST_ERR_TOKEN;
    uint32_t hashes[LSST_NGRAM_LIMIT + 1];
    uint64_t h = LSST_SEED;
    for (int32_t L = 1; L <= lmax; L++) {
        h = hash_step(h, context[m - L]);
        hashes[L] = hash_final(h);
    }
    out->n_tokens = out->ngram_len = out->n_occ = 0;
    out->score = 0.0f;
    for (int32_t L = lmax; L >= p->ngram_min; L--) {
        int32_t e = *find(store, L, hashes[L], context + m - L);
        if (e == LSST_NONE) continue;
        int32_t alive[LSST_CHAIN_LIMIT], n_alive = 0;
        const int32_t *prev = prev_of(store, L);
        while (e != LSST_NONE && n_alive < p->max_chain) {
            alive[n_alive++] = e;
            e = prev[e];
        }
        out->ngram_len = L;
        out->n_occ = n_alive;
        grow(store, alive, n_alive, k, out_tokens, out_agree, out);
        return LSST_OK;
    }
    return LSST_OK;
}

const char *lsst_strerror(int code)
{
    switch (code) {
    case LSST_OK: return "ok";
    case LSST_ERR_PARAMS: return "invalid parameters";
    case LSST_ERR_MEMORY: return "memory block too small or misaligned";
    case LSST_ERR_FULL: return "store full";
    case LSST_ERR_TOKEN: return "invalid token id";
    case LSST_ERR_RANGE: return "out of range";
    case LSST_ERR_HANDLE: return "not an initialised store";
    default: return "unknown error";
    }
}
