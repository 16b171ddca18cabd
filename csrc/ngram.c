/* ngram.c: the incremental n-gram matcher declared in ngram.h (definitions and complexity there).
 *
 * Layout of one index inside the caller's block (table.h, shared with the draft store):
 *   struct lsng_index | tokens [capacity] | prev [G, capacity] | slots [G, n_slots]
 * where G = ngram_max - ngram_min + 1 and table g holds the (ngram_min + g)-grams.
 * An L-gram enters its table when the token after it is appended (so the current suffix is never
 * its own match) and leaves when that token is truncated.
 */
#include "ngram.h"
#include "hashing.h"
#include "table.h"

#include <string.h>

#define LSNG_MAGIC 0x6c736e67u     /* "lsng" */
#define LSNG_NONE LS_NONE          /* no position: free slot / end of a prev chain */
#define LSNG_SEED 0x243f6a8885a308d3ull

typedef struct lsng_slot {
    uint32_t hash;    /* the n-gram's 32-bit hash; hash & mask is its home slot */
    int32_t last;     /* newest occurrence (end position); LSNG_NONE marks a free slot: the
                       * position ls_find reads (table.h) */
    int32_t first;    /* oldest occurrence */
} lsng_slot;

struct lsng_index {
    uint32_t magic;
    lsng_params params;
    int32_t capacity;
    int32_t n;             /* tokens held */
    uint32_t mask;         /* slots per table - 1 (a power of two minus one) */
    int32_t *tokens;       /* [capacity] */
    int32_t *prev;         /* [G, capacity]: previous occurrence of the same n-gram, or LSNG_NONE */
    lsng_slot *slots;      /* [G, mask + 1] */
};

static int params_ok(const lsng_params *p)
{
    return p && ls_ngram_range_ok(p->ngram_min, p->ngram_max, LSNG_NGRAM_LIMIT) &&
           p->tie >= LSNG_TIE_RECENT && p->tie <= LSNG_TIE_LONGEST;
}

static int index_ok(const lsng_index *x) { return x && x->magic == LSNG_MAGIC; }

/* hashes[L] for L in [ngram_min, lmax]: the L-grams of s ending at position e. */
static void hashes_at(const lsng_index *x, const int32_t *s, int32_t e, int32_t lmax,
                      uint32_t *hashes)
{
    uint64_t h = LSNG_SEED;
    for (int32_t L = 1; L <= lmax; L++) {
        h = hash_step(h, s[e - L]);
        if (L >= x->params.ngram_min) hashes[L] = hash_final(h);
    }
}

static int32_t *prev_of(const lsng_index *x, int32_t L)
{
    return ls_prev_of(x->prev, x->params.ngram_min, x->capacity, L);
}

/* The slot holding key[0..L) in x's L-table, or the free slot where it would go. */
static lsng_slot *find(const lsng_index *x, int32_t L, uint32_t hash, const int32_t *key)
{
    lsng_slot *tab = (lsng_slot *)ls_table(x->slots, sizeof(lsng_slot), x->params.ngram_min,
                                           x->mask, L);
    return &tab[ls_find((const char *)tab, sizeof(lsng_slot), offsetof(lsng_slot, last),
                        offsetof(lsng_slot, hash), x->mask, x->tokens, L, hash, key)];
}

/* Appends one token: the n-grams ending at e = n now have a follower, so they become occurrences. */
static void push(lsng_index *x, int32_t token)
{
    uint32_t hashes[LSNG_NGRAM_LIMIT + 1];
    int32_t e = x->n;
    int32_t lmax = e < x->params.ngram_max ? e : x->params.ngram_max;
    x->tokens[e] = token;
    hashes_at(x, x->tokens, e, lmax, hashes);
    for (int32_t L = x->params.ngram_min; L <= lmax; L++) {
        lsng_slot *s = find(x, L, hashes[L], x->tokens + e - L);
        if (s->last == LSNG_NONE) {
            s->hash = hashes[L];
            s->first = e;
        }
        prev_of(x, L)[e] = s->last;   /* LSNG_NONE for a new n-gram */
        s->last = e;
    }
    x->n = e + 1;
}

/* Undoes push() of the token at e = n - 1. */
static void pop(lsng_index *x)
{
    uint32_t hashes[LSNG_NGRAM_LIMIT + 1];
    int32_t e = x->n - 1;
    int32_t lmax = e < x->params.ngram_max ? e : x->params.ngram_max;
    hashes_at(x, x->tokens, e, lmax, hashes);
    for (int32_t L = x->params.ngram_min; L <= lmax; L++) {
        lsng_slot *s = find(x, L, hashes[L], x->tokens + e - L);
        /* s->last == e: later ends were popped first. If e was the n-gram's only occurrence,
         * its slot was the newest one taken in this table (pops undo pushes in reverse), so
         * freeing it restores the table exactly: no tombstones, no shifting needed. */
        s->last = prev_of(x, L)[e];
    }
    x->n = e;
}

static ls_layout layout(const lsng_params *params, int32_t capacity)
{
    return ls_layout_of(sizeof(struct lsng_index), params->ngram_max - params->ngram_min + 1,
                        capacity, sizeof(lsng_slot));
}

size_t lsng_index_bytes(const lsng_params *params, int32_t capacity)
{
    if (!params_ok(params) || capacity < 1 || capacity > LSNG_MAX_CAPACITY) return 0;
    return (size_t)layout(params, capacity).total;
}

int lsng_index_init(void *mem, size_t n_bytes, const lsng_params *params, int32_t capacity,
                    lsng_index **out)
{
    size_t need = lsng_index_bytes(params, capacity);
    if (!out || need == 0) return LSNG_ERR_PARAMS;
    if (!ls_block_ok(mem, n_bytes, need)) return LSNG_ERR_MEMORY;
    uint64_t slots = ls_n_slots(capacity);
    int32_t g = params->ngram_max - params->ngram_min + 1;
    lsng_index *x = (lsng_index *)mem;
    void *slots_at;
    ls_carve(mem, layout(params, capacity), &x->tokens, &x->prev, &slots_at);
    x->slots = (lsng_slot *)slots_at;
    for (size_t i = 0; i < (size_t)g * (size_t)slots; i++) {
        x->slots[i].hash = 0;
        x->slots[i].last = LSNG_NONE;
        x->slots[i].first = LSNG_NONE;
    }
    x->params = *params;
    x->capacity = capacity;
    x->n = 0;
    x->mask = (uint32_t)(slots - 1);
    x->magic = LSNG_MAGIC;
    *out = x;
    return LSNG_OK;
}

int lsng_append(lsng_index *index, const int32_t *tokens, int32_t n)
{
    if (!index_ok(index)) return LSNG_ERR_HANDLE;
    if (n < 0 || (n > 0 && !tokens)) return LSNG_ERR_PARAMS;
    if (n > index->capacity - index->n) return LSNG_ERR_FULL;
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0) return LSNG_ERR_TOKEN;   /* checked first: all or nothing */
    for (int32_t i = 0; i < n; i++) push(index, tokens[i]);
    return LSNG_OK;
}

int lsng_truncate(lsng_index *index, int32_t n_keep)
{
    if (!index_ok(index)) return LSNG_ERR_HANDLE;
    if (n_keep < 0 || n_keep > index->n) return LSNG_ERR_RANGE;
    while (index->n > n_keep) pop(index);
    return LSNG_OK;
}

int32_t lsng_len(const lsng_index *index) { return index_ok(index) ? index->n : LSNG_ERR_HANDLE; }

int32_t lsng_capacity(const lsng_index *index)
{
    return index_ok(index) ? index->capacity : LSNG_ERR_HANDLE;
}

const int32_t *lsng_tokens(const lsng_index *index) { return index_ok(index) ? index->tokens : 0; }

/* ---- lookups ---------------------------------------------------------------------------- */

/* One query: the history's suffixes, hashed once, looked up in the history and the document. */
typedef struct query {
    const lsng_index *history;
    const lsng_index *document;   /* NULL: none */
    int32_t k;
    int32_t lmax;                 /* longest suffix length to try: min(ngram_max, n) */
    uint32_t hashes[LSNG_NGRAM_LIMIT + 1];
} query;

static int query_init(query *q, const lsng_index *history, const lsng_index *document, int32_t k)
{
    if (!index_ok(history) || (document && !index_ok(document))) return LSNG_ERR_HANDLE;
    if (k < 0) return LSNG_ERR_PARAMS;
    if (document && (document->params.ngram_min != history->params.ngram_min ||
                     document->params.ngram_max != history->params.ngram_max))
        return LSNG_ERR_INCOMPATIBLE;
    q->history = history;
    q->document = document;
    q->k = k;
    q->lmax = history->n < history->params.ngram_max ? history->n : history->params.ngram_max;
    hashes_at(history, history->tokens, history->n, q->lmax, q->hashes);
    return LSNG_OK;
}

/* The slot of suffix(L) in src, or NULL when suffix(L) has no occurrence there. */
static const lsng_slot *lookup(const query *q, const lsng_index *src, int32_t L)
{
    const lsng_index *h = q->history;
    const lsng_slot *s = find(src, L, q->hashes[L], h->tokens + h->n - L);
    return s->last == LSNG_NONE ? 0 : s;
}

/* The occurrence the tie policy (the history's) picks among those of slot s in src. */
static int32_t pick(const query *q, const lsng_index *src, int32_t L, const lsng_slot *s)
{
    int32_t tie = q->history->params.tie;
    if (tie == LSNG_TIE_RECENT) return s->last;
    if (tie == LSNG_TIE_EARLIEST) return s->first;
    const int32_t *prev = prev_of(src, L);
    int32_t e = s->last, oldest = s->last;
    for (int32_t v = 0; v < LSNG_MAX_CHAIN && e != LSNG_NONE; v++, e = prev[e]) {
        if (src->n - e >= q->k) return e;   /* newest with an uncut continuation */
        oldest = e;
    }
    return oldest;                           /* all cut short: the oldest visited is longest */
}

static int32_t cont_len(const query *q, const lsng_index *src, int32_t e)
{
    int32_t avail = src->n - e;
    return avail < q->k ? avail : q->k;
}

int lsng_propose(const lsng_index *history, const lsng_index *document, int32_t k,
                 int32_t *out_tokens, lsng_match *out)
{
    query q;
    int rc = query_init(&q, history, document, k);
    if (rc != LSNG_OK) return rc;
    if (!out || (k > 0 && !out_tokens)) return LSNG_ERR_PARAMS;
    for (int32_t L = q.lmax; L >= history->params.ngram_min; L--) {
        for (int32_t source = LSNG_SOURCE_HISTORY; source <= LSNG_SOURCE_DOCUMENT; source++) {
            const lsng_index *src = source == LSNG_SOURCE_HISTORY ? history : document;
            const lsng_slot *s = src ? lookup(&q, src, L) : 0;
            if (!s) continue;
            int32_t e = pick(&q, src, L, s);
            out->n_tokens = cont_len(&q, src, e);
            out->source = source;
            out->ngram_len = L;
            out->pos = e;
            if (out->n_tokens > 0)
                memcpy(out_tokens, src->tokens + e, (size_t)out->n_tokens * sizeof(int32_t));
            return LSNG_OK;
        }
    }
    out->n_tokens = 0;
    out->source = LSNG_SOURCE_HISTORY;
    out->ngram_len = 0;
    out->pos = LSNG_NONE;
    return LSNG_OK;
}

/* Candidate list under construction: rows of out_tokens [n_max, k] and their matches. */
typedef struct cand_list {
    int32_t *tokens;
    lsng_match *matches;
    int32_t n_max;
    int32_t count;
} cand_list;

/* Adds occurrence e of suffix(L) in src unless its continuation is already listed. */
static void cand_add(cand_list *c, const query *q, const lsng_index *src, int32_t source,
                     int32_t L, int32_t e)
{
    int32_t len = cont_len(q, src, e);
    const int32_t *cont = src->tokens + e;
    for (int32_t i = 0; i < c->count; i++) {
        if (c->matches[i].n_tokens != len) continue;
        if (len == 0 ||
            memcmp(c->tokens + (size_t)i * (size_t)q->k, cont, (size_t)len * sizeof(int32_t)) == 0)
            return;
    }
    if (len > 0)
        memcpy(c->tokens + (size_t)c->count * (size_t)q->k, cont, (size_t)len * sizeof(int32_t));
    lsng_match m = {len, source, L, e};
    c->matches[c->count++] = m;
}

int lsng_candidates(const lsng_index *history, const lsng_index *document, int32_t k,
                    int32_t n_max, int32_t *out_tokens, lsng_match *out, int32_t *n_out)
{
    query q;
    int rc = query_init(&q, history, document, k);
    if (rc != LSNG_OK) return rc;
    if (!n_out || n_max < 0 || (n_max > 0 && (!out || (k > 0 && !out_tokens))))
        return LSNG_ERR_PARAMS;
    cand_list c = {out_tokens, out, n_max, 0};
    for (int32_t L = q.lmax; L >= history->params.ngram_min && c.count < n_max; L--) {
        for (int32_t source = LSNG_SOURCE_HISTORY; source <= LSNG_SOURCE_DOCUMENT; source++) {
            const lsng_index *src = source == LSNG_SOURCE_HISTORY ? history : document;
            const lsng_slot *s = src ? lookup(&q, src, L) : 0;
            if (!s || c.count == n_max) continue;
            cand_add(&c, &q, src, source, L, pick(&q, src, L, s));
            const int32_t *prev = prev_of(src, L);
            int32_t e = s->last;
            for (int32_t v = 0; v < LSNG_MAX_CHAIN && e != LSNG_NONE && c.count < n_max;
                 v++, e = prev[e])
                cand_add(&c, &q, src, source, L, e);
        }
    }
    *n_out = c.count;
    return LSNG_OK;
}

int lsng_support(const lsng_index *history, const lsng_index *document, const lsng_match *m,
                 const int32_t *tokens, int32_t *agree, int32_t *n_occ)
{
    query q;
    if (!m || !n_occ || m->n_tokens < 0 || (m->n_tokens > 0 && (!tokens || !agree)))
        return LSNG_ERR_PARAMS;
    int rc = query_init(&q, history, document, m->n_tokens);
    if (rc != LSNG_OK) return rc;
    *n_occ = 0;
    if (m->ngram_len == 0) return LSNG_OK;
    const lsng_index *src = m->source == LSNG_SOURCE_DOCUMENT ? document : history;
    if (m->ngram_len < history->params.ngram_min || m->ngram_len > q.lmax || !src ||
        (m->source != LSNG_SOURCE_HISTORY && m->source != LSNG_SOURCE_DOCUMENT))
        return LSNG_ERR_PARAMS;
    for (int32_t i = 0; i < m->n_tokens; i++) agree[i] = 0;
    const lsng_slot *s = lookup(&q, src, m->ngram_len);
    if (!s) return LSNG_OK;
    const int32_t *prev = prev_of(src, m->ngram_len);
    int32_t e = s->last, v = 0;
    for (; v < LSNG_MAX_CHAIN && e != LSNG_NONE; v++, e = prev[e]) {
        int32_t n = cont_len(&q, src, e);     /* the continuation's tokens, at most k */
        for (int32_t i = 0; i < n && src->tokens[e + i] == tokens[i]; i++) agree[i]++;
    }
    *n_occ = v;
    return LSNG_OK;
}

const char *lsng_strerror(int code)
{
    switch (code) {
    case LSNG_OK: return "ok";
    case LSNG_ERR_PARAMS: return "invalid argument (ngram_min/ngram_max/tie/capacity/k/n)";
    case LSNG_ERR_MEMORY: return "memory block too small or not 8-byte aligned";
    case LSNG_ERR_FULL: return "index is full: grow its capacity before appending";
    case LSNG_ERR_TOKEN: return "token ids must be >= 0";
    case LSNG_ERR_RANGE: return "truncation length out of range";
    case LSNG_ERR_INCOMPATIBLE: return "document index has different ngram_min/ngram_max";
    case LSNG_ERR_HANDLE: return "not an initialised index";
    default: return "unknown error";
    }
}
