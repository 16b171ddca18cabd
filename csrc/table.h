/* table.h: the scaffolding the n-gram matcher (ngram.c) and the draft store (store.c) share:
 * one block per index, laid out as
 *     struct | tokens [capacity] | prev [G, capacity] | slots [G, n_slots]
 * with G = ngram_max - ngram_min + 1 hash tables, one per n-gram length L, open addressing with
 * linear probing at load <= 1/2. A slot holds the newest end position e of its n-gram (or
 * LS_NONE) and the key is read back from the tokens at [e - L, e); prev[L][e] chains each
 * occurrence to the previous one of the same n-gram. What a slot holds besides the position is
 * each index's own (the matcher's also keeps the hash and the oldest occurrence).
 *
 * Everything here is static inline: no symbol is exported, each .c keeps its own prefix (lsng_,
 * lsst_) and nothing here allocates. Internal: not part of either API, not fed to cffi. */
#ifndef LOCALSPEC_TABLE_H
#define LOCALSPEC_TABLE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define LS_NONE (-1)                 /* no position: a free slot, the end of a prev chain */
#define LS_NO_HASH ((size_t)-1)      /* ls_find: the slots keep no hash */

static inline size_t ls_align8(size_t x) { return (x + 7u) & ~(size_t)7u; }

/* Slots per table: a power of two >= 2 * capacity, so the load stays <= 1/2 and probes end. */
static inline uint64_t ls_n_slots(int32_t capacity)
{
    uint64_t s = 2;
    while (s < 2u * (uint64_t)capacity) s <<= 1;
    return s;
}

/* The part of a params check both indexes share: 1 <= ngram_min <= ngram_max <= limit. */
static inline int ls_ngram_range_ok(int32_t ngram_min, int32_t ngram_max, int32_t limit)
{
    return ngram_min >= 1 && ngram_min <= ngram_max && ngram_max <= limit;
}

/* Byte offsets of the parts of one block (see the layout above). */
typedef struct ls_layout {
    uint64_t tokens, prev, slots, total;
} ls_layout;

/* The layout of an index of `capacity` tokens whose struct takes `head` bytes and whose slots
 * `slot_bytes` each; total == 0 when it does not fit a size_t. Example: head 48, G = 1,
 * capacity 4, 4-byte slots: tokens at 48, prev at 64, slots at 80, total 112 (8 slots). */
static inline ls_layout ls_layout_of(size_t head, int32_t g, int32_t capacity, size_t slot_bytes)
{
    ls_layout l;
    uint64_t cap = (uint64_t)capacity;
    l.tokens = ls_align8(head);
    l.prev = l.tokens + ls_align8(cap * 4u);
    l.slots = l.prev + ls_align8((uint64_t)g * cap * 4u);
    l.total = l.slots + (uint64_t)g * ls_n_slots(capacity) * slot_bytes;
    if (l.total > (uint64_t)SIZE_MAX) l.total = 0;
    return l;
}

/* The parts of the block at `mem` (laid out as `at`): its tokens, prev chains and slots. */
static inline void ls_carve(void *mem, ls_layout at, int32_t **tokens, int32_t **prev,
                            void **slots)
{
    *tokens = (int32_t *)((char *)mem + at.tokens);
    *prev = (int32_t *)((char *)mem + at.prev);
    *slots = (char *)mem + at.slots;
}

/* Whether a caller's block can hold `need` bytes: large enough and 8-byte aligned. */
static inline int ls_block_ok(const void *mem, size_t n_bytes, size_t need)
{
    return mem && n_bytes >= need && ((uintptr_t)mem & 7u) == 0;
}

/* Table L's first slot, in slots of `slot_bytes` bytes, mask + 1 per table. */
static inline char *ls_table(const void *slots, size_t slot_bytes, int32_t ngram_min,
                             uint32_t mask, int32_t L)
{
    return (char *)slots + (size_t)(L - ngram_min) * ((size_t)mask + 1) * slot_bytes;
}

/* prev[L]: the chain of L-gram occurrences, one int32 per token of capacity. */
static inline int32_t *ls_prev_of(const int32_t *prev, int32_t ngram_min, int32_t capacity,
                                  int32_t L)
{
    return (int32_t *)prev + (size_t)(L - ngram_min) * (size_t)capacity;
}

/* Linear probing in one table: the index of the slot holding key[0..L) (compared against
 * tokens[e - L, e) at the slot's position e), or of the free slot where it would go. A slot is
 * `slot_bytes` bytes with its int32 position at byte `pos_at` and, unless hash_at ==
 * LS_NO_HASH, the n-gram's 32-bit hash at `hash_at` (compared first: cheaper than the tokens).
 * The load <= 1/2 guarantees a free slot, so the probe ends. Inlined with constant offsets, the
 * memcpy reads compile to plain loads. */
static inline uint32_t ls_find(const char *table, size_t slot_bytes, size_t pos_at,
                               size_t hash_at, uint32_t mask, const int32_t *tokens, int32_t L,
                               uint32_t hash, const int32_t *key)
{
    uint32_t i = hash & mask;
    for (;;) {
        const char *slot = table + (size_t)i * slot_bytes;
        int32_t e;
        uint32_t h = hash;
        memcpy(&e, slot + pos_at, sizeof e);
        if (e == LS_NONE) return i;
        if (hash_at != LS_NO_HASH) memcpy(&h, slot + hash_at, sizeof h);
        if (h == hash && memcmp(tokens + e - L, key, (size_t)L * sizeof(int32_t)) == 0) return i;
        i = (i + 1) & mask;
    }
}

#endif
