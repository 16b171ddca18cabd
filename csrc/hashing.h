/* Hashing shared by the n-gram matcher (ngram.c) and the draft store (store.c): the n-gram
 * hash (table sizes and probing are table.h's), built from an n-gram's last token backwards,
 * step(...step(SEED, g[L-1])..., g[0]), so that extending by one more token to the left gives
 * the hash of the (L+1)-gram ending at the same place: all lengths at one end position cost
 * O(ngram_max) together. */
#ifndef LOCALSPEC_HASHING_H
#define LOCALSPEC_HASHING_H

#include <stdint.h>

static inline uint64_t hash_step(uint64_t h, int32_t token)
{
    h = (h ^ (uint32_t)token) * 0x9e3779b97f4a7c15ull;
    return h ^ (h >> 29);
}

static inline uint32_t hash_final(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return (uint32_t)(h >> 32);
}

#endif
