/* ngram_fuzz.c: random-case driver for the n-gram matcher, built with ASan + UBSan by
 * scripts/ci/ngram_sanitize.sh. It replays random interleavings of append / truncate / set_document
 * / propose / candidates under all three tie policies and compares every answer (tokens, source,
 * ngram_len, pos) with a brute-force C transcription of the rules in ngram.h (the same rules as
 * tests/ngram_reference.py). Index blocks are malloc'd at their exact size, so any overrun of a
 * block is a heap-buffer-overflow report. Exit status: 0 when every case agrees.
 *
 * usage: ngram_fuzz [n_cases] [seed]
 */
#include "ngram.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HIST 700
#define MAX_DOC 80
#define MAX_K 300
#define MAX_CANDS 300

static uint64_t rng_state;

static uint64_t rnd(void)   /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int32_t below(int32_t n) { return (int32_t)(rnd() % (uint64_t)n); }   /* [0, n) */
static int chance(int percent) { return below(100) < percent; }

#define FAIL(...) do { fprintf(stderr, "ngram_fuzz: case %ld: ", n_done); \
                       fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } while (0)
#define CHECK_RC(call) do { int rc_ = (call); if (rc_ != LSNG_OK) \
                                FAIL("%s -> %s", #call, lsng_strerror(rc_)); } while (0)

static long n_done;

/* ---- the model: plain arrays and brute force ------------------------------------------------ */

typedef struct model {
    lsng_params params;
    int32_t hist[MAX_HIST + MAX_K];
    int32_t n;
    int32_t doc[MAX_DOC];
    int32_t m;
} model;

typedef struct ref_match { const int32_t *tokens; int32_t len, source, ngram_len, pos; } ref_match;

/* End positions e (newest first) of key[0..L) in s[0..m) with a token after them. */
static int32_t occurrences(const int32_t *s, int32_t m, const int32_t *key, int32_t L, int32_t *occ)
{
    int32_t count = 0;
    for (int32_t e = m - 1; e >= L; e--)
        if (memcmp(s + e - L, key, (size_t)L * sizeof(int32_t)) == 0) occ[count++] = e;
    return count;
}

static int32_t ref_pick(const model *md, const int32_t *occ, int32_t count, int32_t m, int32_t k)
{
    if (md->params.tie == LSNG_TIE_RECENT) return occ[0];
    if (md->params.tie == LSNG_TIE_EARLIEST) return occ[count - 1];
    int32_t visited = count < LSNG_MAX_CHAIN ? count : LSNG_MAX_CHAIN;
    for (int32_t i = 0; i < visited; i++)
        if (m - occ[i] >= k) return occ[i];
    return occ[visited - 1];
}

static ref_match ref_make(const int32_t *s, int32_t m, int32_t source, int32_t L, int32_t e,
                          int32_t k)
{
    ref_match r = {s + e, m - e < k ? m - e : k, source, L, e};
    return r;
}

/* Up to n_max distinct answers in the order lsng_candidates defines; the first is the proposal. */
static int32_t ref_answers(const model *md, int32_t k, int32_t n_max, ref_match *out)
{
    static int32_t occ[MAX_HIST + MAX_K];
    int32_t count = 0;
    int32_t lmax = md->n < md->params.ngram_max ? md->n : md->params.ngram_max;
    for (int32_t L = lmax; L >= md->params.ngram_min; L--) {
        for (int32_t source = 0; source < 2; source++) {
            const int32_t *s = source ? md->doc : md->hist;
            int32_t m = source ? md->m : md->n;
            int32_t c = occurrences(s, m, md->hist + md->n - L, L, occ);
            if (c == 0) continue;
            int32_t chain = c < LSNG_MAX_CHAIN ? c : LSNG_MAX_CHAIN;
            for (int32_t i = -1; i < chain; i++) {
                if (count == n_max) return count;
                int32_t e = i < 0 ? ref_pick(md, occ, c, m, k) : occ[i];
                ref_match r = ref_make(s, m, source, L, e, k);
                int dup = 0;
                for (int32_t j = 0; j < count && !dup; j++)
                    dup = out[j].len == r.len &&
                          (r.len == 0 ||
                           memcmp(out[j].tokens, r.tokens, (size_t)r.len * sizeof(int32_t)) == 0);
                if (!dup) out[count++] = r;
            }
        }
    }
    return count;
}

/* ---- the index under test -------------------------------------------------------------------- */

typedef struct subject {
    void *hist_mem, *doc_mem;
    lsng_index *hist, *doc;
} subject;

static lsng_index *new_index(const lsng_params *p, int32_t capacity, void **mem)
{
    size_t n_bytes = lsng_index_bytes(p, capacity);
    lsng_index *x = NULL;
    if (n_bytes == 0) FAIL("lsng_index_bytes(capacity %d) == 0", capacity);
    *mem = malloc(n_bytes);   /* exact size: an overrun is an ASan report */
    if (!*mem) FAIL("out of memory");
    CHECK_RC(lsng_index_init(*mem, n_bytes, p, capacity, &x));
    return x;
}

static void subject_append(subject *sj, const model *md, const int32_t *tokens, int32_t n)
{
    int32_t len = lsng_len(sj->hist), cap = lsng_capacity(sj->hist);
    if (len + n > cap) {
        if (lsng_append(sj->hist, tokens, n) != LSNG_ERR_FULL) FAIL("append past capacity not FULL");
        if (lsng_len(sj->hist) != len) FAIL("failed append changed the length");
        while (cap < len + n) cap *= 2;
        void *mem;
        lsng_index *bigger = new_index(&md->params, cap, &mem);
        CHECK_RC(lsng_append(bigger, lsng_tokens(sj->hist), len));
        free(sj->hist_mem);
        sj->hist_mem = mem;
        sj->hist = bigger;
    }
    CHECK_RC(lsng_append(sj->hist, tokens, n));
}

/* lsng_support of a proposal against a brute-force count over the same occurrences. */
static void check_support(const subject *sj, const model *md, const lsng_match *m,
                          const int32_t *tokens)
{
    static int32_t occ[MAX_HIST + MAX_K], agree[MAX_K];
    const int32_t *s = m->source ? md->doc : md->hist;
    int32_t len = m->source ? md->m : md->n, n_occ = -1;
    CHECK_RC(lsng_support(sj->hist, sj->doc, m, tokens, agree, &n_occ));
    int32_t c = occurrences(s, len, md->hist + md->n - m->ngram_len, m->ngram_len, occ);
    int32_t chain = c < LSNG_MAX_CHAIN ? c : LSNG_MAX_CHAIN;
    if (n_occ != chain) FAIL("support: %d occurrences, reference has %d", n_occ, chain);
    for (int32_t i = 0; i < m->n_tokens; i++) {
        int32_t want = 0;
        for (int32_t j = 0; j < chain; j++) {
            int32_t e = occ[j], ok = 1;
            for (int32_t d = 0; d <= i && ok; d++) ok = e + d < len && s[e + d] == tokens[d];
            want += ok;
        }
        if (agree[i] != want) FAIL("support: agree[%d] = %d, reference %d", i, agree[i], want);
    }
}

static void compare(const subject *sj, const model *md)
{
    static int32_t got_tokens[MAX_CANDS * MAX_K];
    static lsng_match got[MAX_CANDS];
    static ref_match want[MAX_CANDS];
    int32_t k = chance(90) ? below(13) : 13 + below(MAX_K - 13);
    int32_t n_max = chance(80) ? 1 : chance(70) ? below(9) : below(MAX_CANDS);
    int32_t n_got = 0;
    if (n_max == 1 && chance(60)) {
        CHECK_RC(lsng_propose(sj->hist, sj->doc, k, k ? got_tokens : NULL, got));
        n_got = got[0].ngram_len ? 1 : 0;
        if (!n_got && (got[0].n_tokens || got[0].source || got[0].pos != -1))
            FAIL("no-match result not cleared");
    } else {
        CHECK_RC(lsng_candidates(sj->hist, sj->doc, k, n_max, got_tokens, got, &n_got));
    }
    if (n_max == 1 && n_got == 1) check_support(sj, md, &got[0], got_tokens);
    int32_t n_want = ref_answers(md, k, n_max, want);
    if (n_got != n_want) FAIL("k=%d n_max=%d: %d answers, reference has %d", k, n_max, n_got, n_want);
    for (int32_t i = 0; i < n_got; i++) {
        const int32_t *row = got_tokens + (size_t)i * (size_t)k;
        if (got[i].n_tokens != want[i].len || got[i].source != want[i].source ||
            got[i].ngram_len != want[i].ngram_len || got[i].pos != want[i].pos ||
            (want[i].len && memcmp(row, want[i].tokens, (size_t)want[i].len * sizeof(int32_t))))
            FAIL("answer %d (k=%d): got len %d src %d L %d pos %d, want len %d src %d L %d pos %d",
                 i, k, got[i].n_tokens, got[i].source, got[i].ngram_len, got[i].pos, want[i].len,
                 want[i].source, want[i].ngram_len, want[i].pos);
    }
}

/* ---- random sessions ------------------------------------------------------------------------- */

static int32_t random_token(int32_t vocab)
{
    if (vocab > 0) return below(vocab);
    if (chance(5)) return 0;
    if (chance(5)) return INT32_MAX;
    return (int32_t)(rnd() >> 33);    /* [0, 2^31) */
}

static void random_chunk(const model *md, int32_t vocab, int32_t *out, int32_t *n)
{
    const int32_t *src = chance(70) ? md->hist : md->doc;
    int32_t m = src == md->hist ? md->n : md->m;
    *n = 1 + below(8);
    if (m > 0 && chance(vocab ? 20 : 60)) {   /* copy a span: matches in large vocabularies */
        int32_t start = below(m);
        if (*n > m - start) *n = m - start;
        memcpy(out, src + start, (size_t)*n * sizeof(int32_t));
        return;
    }
    for (int32_t i = 0; i < *n; i++) out[i] = random_token(vocab);
}

static void error_paths(subject *sj, model *md)
{
    int32_t bad[3] = {1, -1, 2}, n = lsng_len(sj->hist);
    lsng_match m;
    int want = lsng_capacity(sj->hist) - n >= 3 ? LSNG_ERR_TOKEN : LSNG_ERR_FULL;
    if (lsng_append(sj->hist, bad, 3) != want || lsng_len(sj->hist) != n)
        FAIL("negative token not rejected atomically");
    if (lsng_truncate(sj->hist, n + 1) != LSNG_ERR_RANGE ||
        lsng_truncate(sj->hist, -1) != LSNG_ERR_RANGE)
        FAIL("truncate range not checked");
    if (lsng_propose(sj->hist, sj->doc, -1, NULL, &m) != LSNG_ERR_PARAMS) FAIL("k < 0 accepted");
    if (lsng_propose(NULL, NULL, 0, NULL, &m) != LSNG_ERR_HANDLE) FAIL("NULL index accepted");
    size_t need = lsng_index_bytes(&md->params, 8);
    char *mem = malloc(need + 8);
    lsng_index *x;
    if (!mem) FAIL("out of memory");
    if (lsng_index_init(mem, need - 1, &md->params, 8, &x) != LSNG_ERR_MEMORY ||
        lsng_index_init(mem + 4, need, &md->params, 8, &x) != LSNG_ERR_MEMORY)
        FAIL("bad block accepted");
    free(mem);
    lsng_params other = md->params;
    other.ngram_max = other.ngram_min == other.ngram_max ? other.ngram_max + 1 : other.ngram_min;
    void *other_mem;
    lsng_index *other_doc = new_index(&other, 4, &other_mem);
    if (lsng_propose(sj->hist, other_doc, 0, NULL, &m) != LSNG_ERR_INCOMPATIBLE)
        FAIL("document with other ngram sizes accepted");
    free(other_mem);
}

static void session(int32_t tie, int small_vocab, long n_ops)
{
    static model md;
    static int32_t chunk[MAX_HIST];
    subject sj = {0};
    int32_t vocab = small_vocab ? 2 + below(7) : 0, max_len = 8 + below(192);
    md.params.tie = tie;
    md.params.ngram_min = 1 + below(3);
    md.params.ngram_max = md.params.ngram_min + below(4);
    if (small_vocab && chance(15)) {   /* long runs of 2 symbols: > LSNG_MAX_CHAIN occurrences */
        vocab = 2;
        md.params.ngram_min = 1;
        md.params.ngram_max = 1 + below(2);
        max_len = 600;
    }
    md.n = md.m = 0;
    sj.hist = new_index(&md.params, 1 + below(40), &sj.hist_mem);
    for (long op = 0; op < n_ops; op++, n_done++) {
        int32_t r = below(100), n;
        if (r < 55 && md.n < max_len) {
            random_chunk(&md, vocab, chunk, &n);
            subject_append(&sj, &md, chunk, n);
            memcpy(md.hist + md.n, chunk, (size_t)n * sizeof(int32_t));
            md.n += n;
        } else if (r < 80) {
            int32_t back = below((md.n < 12 ? md.n : 12) + 1);
            CHECK_RC(lsng_truncate(sj.hist, md.n - back));
            md.n -= back;
        } else if (r < 85) {
            free(sj.doc_mem);
            sj.doc_mem = NULL;
            sj.doc = NULL;
            md.m = chance(20) ? 0 : below(MAX_DOC);
            for (int32_t i = 0; i < md.m; i++) md.doc[i] = random_token(vocab);
            if (md.n && md.m && chance(70)) {   /* plant a piece of the history */
                int32_t start = below(md.n), len = 1 + below(10), at = below(md.m);
                for (int32_t i = 0; i < len && start + i < md.n && at + i < md.m; i++)
                    md.doc[at + i] = md.hist[start + i];
            }
            if (md.m) {
                sj.doc = new_index(&md.params, md.m, &sj.doc_mem);
                CHECK_RC(lsng_append(sj.doc, md.doc, md.m));
            }
        } else if (r < 86) {
            error_paths(&sj, &md);
        }
        if (lsng_len(sj.hist) != md.n) FAIL("length %d, model %d", lsng_len(sj.hist), md.n);
        compare(&sj, &md);
    }
    free(sj.hist_mem);
    free(sj.doc_mem);
}

int main(int argc, char **argv)
{
    long n_cases = argc > 1 ? atol(argv[1]) : 200000;
    rng_state = argc > 2 ? strtoull(argv[2], NULL, 10) : 1;
    while (n_done < n_cases) session(below(3), chance(50), 1 + below(400));
    printf("ngram_fuzz: %ld random cases agree with the brute-force reference\n", n_done);
    return 0;
}
