/* bench/pull_floor.py's fused floor kernel, compiled by that script with the system C compiler (cc -O3) and
   called through ctypes (which releases the GIL). See pull_floor.py for what it measures.

   Segment s: lens[s] int16 elements at ptr[s], counts[s] positions from byte i0 of the LEB128 gap stream and
   value steps from column e0 of the planes (row stride `stride`, npl rows); positions are decoded AHEAD items
   ahead into a ring (their cache lines fetched meanwhile), as the library's kernel; with `hashed`, sums[s]
   gains the checksum change. Returns the first segment that is off, or -1. */
#include <stdint.h>

#define AHEAD 32
#define RING 63

static inline uint64_t fmix(uint64_t x) {
    x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ULL; x ^= x >> 27; x *= 0x94D049BB133111EBULL; x ^= x >> 31;
    return x;
}

static inline int64_t ordered(int64_t x, int64_t fmag) { return x ^ ((x >> 63) & fmag); }

static inline int64_t applied(int64_t z, int64_t x, int64_t fmag) {
    uint64_t u = (uint64_t)z + 1;
    return (int64_t)((uint64_t)ordered(x, fmag) + (uint64_t)((int64_t)(u >> 1) ^ -(int64_t)(u & 1)));
}

static inline int64_t plane_step(const uint8_t *p, int64_t stride, int64_t npl, int64_t i) {
    if (npl == 1) return p[i];
    if (npl == 2) return (int64_t)p[i] | ((int64_t)p[stride + i] << 8);
    uint64_t u = 0;
    for (int64_t j = 0; j < npl; j++) u |= (uint64_t)p[j * stride + i] << (8 * j);
    return (int64_t)u;
}

static inline int64_t leb128(const uint8_t *b, int64_t i, int64_t n, uint64_t *x, int *st) {
    *st = 0;
    if (i < n && b[i] < 0x80) { *x = b[i]; return i + 1; }
    uint64_t v = 0;
    for (int j = 0;; j++) {
        if (i >= n) { *st = 1; *x = v; return i; }
        if (j >= 10) { *st = 2; *x = v; return i; }
        uint64_t byte = b[i++];
        v |= (byte & 0x7F) << (7 * j);
        if (byte < 0x80) { *x = v; return i; }
    }
}

int64_t fused(const int64_t *ptr, const int64_t *lens, const int64_t *counts, const uint64_t *keys, int64_t s0,
              int64_t s1, const uint8_t *gaps, int64_t n, int64_t i0, int64_t e0, const uint8_t *planes,
              int64_t stride, int64_t npl, int64_t fmag, int64_t lo, int64_t hi, int hashed, uint64_t *sums) {
    int64_t ring[RING + 1], i = i0, e = e0;
    for (int64_t s = s0; s < s1; s++) {
        int16_t *a = (int16_t *)(uintptr_t)ptr[s];
        int64_t lim = lens[s], m = counts[s], q = -1, got = 0;
        uint64_t key = keys[s], total = 0, x;
        int st;
        for (int64_t c = 0; c < m; c++) {
            while (got < m && got <= c + AHEAD) {
                i = leb128(gaps, i, n, &x, &st);
                q += (int64_t)x + 1;
                if (st || q >= lim) return s;
                ring[got & RING] = q;
                __builtin_prefetch(a + q, 1, 3);
                got++;
            }
            int64_t p = ring[c & RING], old = a[p];
            int64_t o = applied(plane_step(planes, stride, npl, e), old, fmag);
            if (o < lo || o > hi) return s;
            int64_t y = ordered(o, fmag);
            a[p] = (int16_t)y;
            if (hashed) {
                uint64_t h = (uint64_t)p * 0x9E3779B97F4A7C15ULL;
                total += fmix((h ^ ((uint64_t)y & 0xFFFF)) + key) - fmix((h ^ ((uint64_t)old & 0xFFFF)) + key);
            }
            e++;
        }
        sums[s] += total;
    }
    return -1;
}
