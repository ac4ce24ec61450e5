/* The kernels' loops that gain from wide vectors, in C so that each can carry run-time CPU dispatch.

   A wheel is compiled for its platform's baseline (x86-64: SSE2). On x86-64 Linux with GCC 11 or newer these
   functions are compiled three times (baseline, x86-64-v3 = AVX2, x86-64-v4 = AVX-512) by GCC's
   ``target_clones``, and the dynamic loader picks the best one for the CPU once, when the module loads (an
   ifunc: no per-call cost). Elsewhere (other compilers or platforms, or -DDELTASTORE_NO_CLONES) they are
   compiled once, for the baseline.

   Every function is a plain loop over memory the caller has checked; none allocates, none touches Python
   objects (they run without the GIL). Semantics are stated at each function; the Cython modules that call
   them (``_checksum.pyx``, ``_diff.pyx``, ``_planes.pyx``, ``_ranks.pyx``, ``_bitstream.pyx``) give the
   contract. */

#ifndef DELTASTORE_SIMD_H
#define DELTASTORE_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__) && !defined(DELTASTORE_NO_CLONES) \
    && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define DS_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define DS_CLONES
#endif
#if defined(__GNUC__) || defined(__clang__)
#define DS_UNUSED __attribute__((unused)) /* each module includes every loop and uses a few */
#else
#define DS_UNUSED
#endif
#define DS_FN DS_CLONES DS_UNUSED static

DS_UNUSED static inline uint64_t ds_fmix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

/* --- the checksum's sums: sum(fmix((p * C1 ^ zero_extend(bits)) + key)) mod 2**64 ------------------------ */

#define DS_MIX(T, W)                                                                                          \
    DS_FN uint64_t ds_mix_dense_##W(const T *b, int64_t start, int64_t stop, uint64_t key) {       \
        uint64_t total = 0;                                                                                   \
        for (int64_t i = start; i < stop; i++)                                                                \
            total += ds_fmix((((uint64_t)i * 0x9E3779B97F4A7C15ULL) ^ (uint64_t)b[i]) + key);                \
        return total;                                                                                         \
    }                                                                                                         \
    DS_FN uint64_t ds_mix_sparse_##W(const int64_t *p, const T *b, int64_t start, int64_t stop,    \
                                                uint64_t key) {                                               \
        uint64_t total = 0;                                                                                   \
        for (int64_t i = start; i < stop; i++)                                                                \
            total += ds_fmix((((uint64_t)p[i] * 0x9E3779B97F4A7C15ULL) ^ (uint64_t)b[i]) + key);             \
        return total;                                                                                         \
    }

DS_MIX(uint8_t, 1)
DS_MIX(uint16_t, 2)
DS_MIX(uint32_t, 4)
DS_MIX(uint64_t, 8)

/* --- byte planes (kernels/planes.py): plane j = byte j of the value, floats rotated left by one first ---- */

DS_FN void ds_split_1(const uint8_t *src, int64_t n, uint8_t *p0) {
    memcpy(p0, src, (size_t)n);
}

DS_FN void ds_split_2(const uint16_t *src, int64_t n, int rotate, uint8_t *p0, uint8_t *p1) {
    if (rotate) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = src[i];
            uint32_t r = (v << 1) | (v >> 15);
            p0[i] = (uint8_t)(r & 0xFF);
            p1[i] = (uint8_t)((r >> 8) & 0xFF);
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = src[i];
            p0[i] = (uint8_t)(v & 0xFF);
            p1[i] = (uint8_t)(v >> 8);
        }
    }
}

DS_FN void ds_split_4(const uint32_t *src, int64_t n, int rotate, uint8_t *p0, uint8_t *p1,
                                 uint8_t *p2, uint8_t *p3) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = src[i];
        if (rotate) v = (v << 1) | (v >> 31);
        p0[i] = (uint8_t)v;
        p1[i] = (uint8_t)(v >> 8);
        p2[i] = (uint8_t)(v >> 16);
        p3[i] = (uint8_t)(v >> 24);
    }
}

DS_FN void ds_split_8(const uint64_t *src, int64_t n, int rotate, uint8_t *const *p) {
    uint8_t *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3], *p4 = p[4], *p5 = p[5], *p6 = p[6], *p7 = p[7];
    for (int64_t i = 0; i < n; i++) {
        uint64_t v = src[i];
        if (rotate) v = (v << 1) | (v >> 63);
        p0[i] = (uint8_t)v;
        p1[i] = (uint8_t)(v >> 8);
        p2[i] = (uint8_t)(v >> 16);
        p3[i] = (uint8_t)(v >> 24);
        p4[i] = (uint8_t)(v >> 32);
        p5[i] = (uint8_t)(v >> 40);
        p6[i] = (uint8_t)(v >> 48);
        p7[i] = (uint8_t)(v >> 56);
    }
}

DS_FN void ds_join_1(const uint8_t *p0, int64_t n, uint8_t *out) {
    memcpy(out, p0, (size_t)n);
}

DS_FN void ds_join_2(const uint8_t *p0, const uint8_t *p1, int64_t n, int rotate, uint16_t *out) {
    if (rotate) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t r = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8);
            out[i] = (uint16_t)(((r >> 1) | (r << 15)) & 0xFFFF);
        }
    } else {
        for (int64_t i = 0; i < n; i++)
            out[i] = (uint16_t)((uint32_t)p0[i] | ((uint32_t)p1[i] << 8));
    }
}

DS_FN void ds_join_4(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3,
                                int64_t n, int rotate, uint32_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t r = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24);
        if (rotate) r = (r >> 1) | (r << 31);
        out[i] = r;
    }
}

DS_FN void ds_join_8(const uint8_t *const *p, int64_t n, int rotate, uint64_t *out) {
    const uint8_t *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3], *p4 = p[4], *p5 = p[5], *p6 = p[6],
                  *p7 = p[7];
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = (uint64_t)p0[i] | ((uint64_t)p1[i] << 8) | ((uint64_t)p2[i] << 16) | ((uint64_t)p3[i] << 24)
                     | ((uint64_t)p4[i] << 32) | ((uint64_t)p5[i] << 40) | ((uint64_t)p6[i] << 48)
                     | ((uint64_t)p7[i] << 56);
        if (rotate) r = (r >> 1) | (r << 63);
        out[i] = r;
    }
}

/* --- ranks (kernels/ranks.py) ----------------------------------------------------------------------------
   A magnitude is bits & mask. Lanes are int32 for 8- and 16-bit elements (mask and thresholds then fit in 31
   bits), else int64. Masks are below 2**width, so zero- and sign-extension of an element give the same
   magnitude. count3: elements of b[0:n] whose magnitude is >= t1, t2, t3 (32-bit sums per block of 2**20).
   ranks3 / select3: the kernels of ranks.py's four-bucket path, with count3 inlined (short spans between
   positions). g_k: elements before the scan point whose magnitude is >= t_k, so bucket b holds G_b - G_(b+1)
   of them, with G_0 = the scan point and G_4 = 0. */

DS_UNUSED static inline int64_t ds_rank3(int64_t b, int64_t p, int64_t g1, int64_t g2, int64_t g3) {
    return b == 0 ? p - g1 : b == 1 ? g1 - g2 : b == 2 ? g2 - g3 : g3;
}

#define DS_RANKS(T, W, L)                                                                                     \
    static inline void ds_count3_in_##W(const T *b, int64_t n, L mask, L t1, L t2, L t3, int64_t *a) {        \
        int64_t a1 = 0, a2 = 0, a3 = 0;                                                                       \
        for (int64_t i = 0; i < n;) {                                                                         \
            int64_t end = n - i > (1 << 20) ? i + (1 << 20) : n;                                              \
            int32_t s1 = 0, s2 = 0, s3 = 0;                                                                   \
            for (int64_t j = i; j < end; j++) {                                                               \
                L m = (L)b[j] & mask;                                                                         \
                s1 += (int32_t)(m >= t1);                                                                     \
                s2 += (int32_t)(m >= t2);                                                                     \
                s3 += (int32_t)(m >= t3);                                                                     \
            }                                                                                                 \
            a1 += s1;                                                                                         \
            a2 += s2;                                                                                         \
            a3 += s3;                                                                                         \
            i = end;                                                                                          \
        }                                                                                                     \
        a[0] = a1;                                                                                            \
        a[1] = a2;                                                                                            \
        a[2] = a3;                                                                                            \
    }                                                                                                         \
    DS_FN void ds_count3_##W(const T *b, int64_t n, L mask, L t1, L t2, L t3, int64_t *out) {                 \
        ds_count3_in_##W(b, n, mask, t1, t2, t3, out);                                                        \
    }                                                                                                         \
    DS_FN void ds_ranks3_##W(const T *bits, L mask, L t1, L t2, L t3, const int64_t *pos, int64_t i0,        \
                             int64_t i1, int64_t start, int64_t g1, int64_t g2, int64_t g3, int64_t *rank,    \
                             int64_t *bucket) {                                                               \
        int64_t cur = start, a[3];                                                                            \
        for (int64_t j = i0; j < i1; j++) {                                                                   \
            int64_t p = pos[j];                                                                               \
            ds_count3_in_##W(bits + cur, p - cur, mask, t1, t2, t3, a);                                       \
            g1 += a[0];                                                                                       \
            g2 += a[1];                                                                                       \
            g3 += a[2];                                                                                       \
            L m = (L)bits[p] & mask;                                                                          \
            int64_t e1 = m >= t1, e2 = m >= t2, e3 = m >= t3, b = e1 + e2 + e3;                               \
            rank[j] = ds_rank3(b, p, g1, g2, g3);                                                             \
            bucket[j] = b;                                                                                    \
            g1 += e1;                                                                                         \
            g2 += e2;                                                                                         \
            g3 += e3;                                                                                         \
            cur = p + 1;                                                                                      \
        }                                                                                                     \
    }                                                                                                         \
    /* positions of the wanted ranks (ranks[off[b] + lo[b] .. off[b] + hi[b]), per bucket b < 4) in [start,  \
       stop), written from outpos[base], with their index into ranks in src; returns the ranks not found.     \
       Blocks of 32 are counted first; a block that holds none of the wanted ranks is skipped. */             \
    DS_FN int64_t ds_select3_##W(const T *bits, L mask, L t1, L t2, L t3, int64_t start, int64_t stop,       \
                                 const int64_t *ranks, const int64_t *off, const int64_t *lo,                 \
                                 const int64_t *hi, int64_t g1, int64_t g2, int64_t g3, int64_t base,         \
                                 int64_t *outpos, int64_t *src) {                                             \
        int64_t ptr[4], want[4], a[3], remaining = 0, o = base, idx = start;                                  \
        for (int b = 0; b < 4; b++) {                                                                         \
            ptr[b] = lo[b];                                                                                   \
            want[b] = ptr[b] < hi[b] ? ranks[off[b] + ptr[b]] : -1; /* next wanted rank (-1: none left) */    \
            remaining += hi[b] - ptr[b];                                                                      \
        }                                                                                                     \
        while (remaining > 0 && idx < stop) {                                                                 \
            int64_t end = idx + 32 < stop ? idx + 32 : stop;                                                  \
            ds_count3_in_##W(bits + idx, end - idx, mask, t1, t2, t3, a);                                     \
            if ((want[0] < 0 || end - g1 - a[0] <= want[0]) && (want[1] < 0 || g1 + a[0] - g2 - a[1] <= want[1]) \
                && (want[2] < 0 || g2 + a[1] - g3 - a[2] <= want[2]) && (want[3] < 0 || g3 + a[2] <= want[3])) { \
                g1 += a[0];                                                                                   \
                g2 += a[1];                                                                                   \
                g3 += a[2];                                                                                   \
                idx = end;                                                                                    \
                continue;                                                                                     \
            }                                                                                                 \
            for (int64_t i = idx; i < end; i++) {                                                             \
                L m = (L)bits[i] & mask;                                                                      \
                int64_t e1 = m >= t1, e2 = m >= t2, e3 = m >= t3, b = e1 + e2 + e3;                           \
                if (ds_rank3(b, i, g1, g2, g3) == want[b]) {                                                  \
                    outpos[o] = i;                                                                            \
                    src[o] = off[b] + ptr[b];                                                                 \
                    o++;                                                                                      \
                    ptr[b]++;                                                                                 \
                    remaining--;                                                                              \
                    want[b] = ptr[b] < hi[b] ? ranks[off[b] + ptr[b]] : -1;                                   \
                }                                                                                             \
                g1 += e1;                                                                                     \
                g2 += e2;                                                                                     \
                g3 += e3;                                                                                     \
            }                                                                                                 \
            idx = end;                                                                                        \
        }                                                                                                     \
        return remaining;                                                                                     \
    }

DS_RANKS(uint8_t, 1, int32_t)
DS_RANKS(uint16_t, 2, int32_t)
DS_RANKS(uint32_t, 4, int64_t)
DS_RANKS(uint64_t, 8, int64_t)

/* --- ulp steps (kernels/bitstream.py): zigzag(ordered(new) - ordered(old)) - 1, elements sign-extended by
   their dtype; ordered(x) = x ^ ((x >> 63) & fmag). max_step: the largest; step_planes: byte j of each step
   into out[j * row_stride + i] for j < npl. */

DS_UNUSED static inline int64_t ds_ordered(int64_t x, int64_t fmag) {
    return x ^ ((x >> 63) & fmag);
}

DS_UNUSED static inline uint64_t ds_step(int64_t a, int64_t b, int64_t fmag) {
    int64_t d = (int64_t)((uint64_t)ds_ordered(a, fmag) - (uint64_t)ds_ordered(b, fmag));
    return (((uint64_t)d << 1) ^ (uint64_t)(d >> 63)) - 1;
}

#define DS_STEPS(T, N)                                                                                        \
    DS_FN uint64_t ds_max_step_##N(const T *new_, const T *old, int64_t n, int64_t fmag) {                    \
        uint64_t m = 0;                                                                                       \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            uint64_t x = ds_step((int64_t)new_[i], (int64_t)old[i], fmag);                                    \
            m = x > m ? x : m;                                                                                \
        }                                                                                                     \
        return m;                                                                                             \
    }                                                                                                         \
    DS_FN void ds_step_planes_##N(const T *new_, const T *old, int64_t n, int64_t fmag, uint8_t *out,         \
                                  int64_t row_stride, int64_t npl) {                                          \
        if (npl == 1) {                                                                                       \
            for (int64_t i = 0; i < n; i++)                                                                   \
                out[i] = (uint8_t)ds_step((int64_t)new_[i], (int64_t)old[i], fmag);                           \
        } else if (npl == 2) {                                                                                \
            uint8_t *out1 = out + row_stride;                                                                 \
            for (int64_t i = 0; i < n; i++) {                                                                 \
                uint64_t x = ds_step((int64_t)new_[i], (int64_t)old[i], fmag);                                \
                out[i] = (uint8_t)x;                                                                          \
                out1[i] = (uint8_t)(x >> 8);                                                                  \
            }                                                                                                 \
        } else {                                                                                              \
            for (int64_t i = 0; i < n; i++) {                                                                 \
                uint64_t x = ds_step((int64_t)new_[i], (int64_t)old[i], fmag);                                \
                for (int64_t j = 0; j < npl; j++, x >>= 8)                                                    \
                    out[j * row_stride + i] = (uint8_t)x;                                                     \
            }                                                                                                 \
        }                                                                                                     \
    }

DS_STEPS(uint8_t, u8)
DS_STEPS(int8_t, i8)
DS_STEPS(int16_t, i16)
DS_STEPS(uint16_t, u16)
DS_STEPS(int32_t, i32)
DS_STEPS(uint32_t, u32)
DS_STEPS(int64_t, i64)
DS_STEPS(uint64_t, u64)

/* --- whether n 8-byte words are all zero (an OR over blocks, checked every 4096 words) --------------------- */

DS_FN int ds_words_zero(const unsigned char *p, int64_t nw) {
    uint64_t acc = 0;
    for (int64_t i = 0; i < nw;) {
        int64_t end = nw - i > 4096 ? i + 4096 : nw;
        for (int64_t j = i; j < end; j++) {
            uint64_t v;
            memcpy(&v, p + 8 * j, 8);
            acc |= v;
        }
        if (acc != 0) return 0;
        i = end;
    }
    return 1;
}

/* --- the compare (kernels/diff.py diff_items): changed elements of o[a:b] against n[a:b] ---------------------
   Blocks of 64 bytes are compared whole and give a mask of the changed elements (AVX-512BW: one compare into
   a mask register; AVX2 / SSE2: byte compares and movemask, folded to one bit per element); the changes are
   then taken bit by bit (count trailing zeros), so an unchanged block costs a compare and a test, a change a
   few stores. The ISA is picked once, at the first call, from what the CPU supports (target_clones cannot
   select intrinsics per clone). Each call writes at most cap changes: pos (element index), new and old bits;
   with advance != 0 it also writes n's bits over o's in every block that changed (the mirror moves to the new
   version in the same pass). Returns the changes written; *next is where the scan stopped (b: the end). */

#define DS_DIFF_SCALAR(T)                                                                                     \
    for (; j < b; j++) {                                                                                      \
        if (o[j] != n[j]) {                                                                                   \
            if (c == cap) break;                                                                              \
            pos[c] = j;                                                                                       \
            nw[c] = n[j];                                                                                     \
            od[c] = o[j];                                                                                     \
            if (advance) o[j] = n[j];                                                                         \
            c++;                                                                                              \
        }                                                                                                     \
    }

DS_UNUSED static inline int ds_ctz64(uint64_t m) { /* m != 0 */
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_ctzll(m);
#else
    int k = 0;
    while (!(m & 1)) { m >>= 1; k++; }
    return k;
#endif
}

/* one element bit per element of a 64-byte-block byte mask (bit k: byte k differs), for W-byte elements */
DS_UNUSED static inline uint64_t ds_fold_mask(uint64_t m, int w) {
    if (w == 1) return m;
    if (w == 2) { m |= m >> 1; return m & 0x5555555555555555ULL; }
    if (w == 4) { m |= m >> 1; m |= m >> 2; return m & 0x1111111111111111ULL; }
    m |= m >> 1; m |= m >> 2; m |= m >> 4; return m & 0x0101010101010101ULL;
}

#define DS_DIFF_FN(NAME, ATTR, T, W, SHIFT, MASK)                                                             \
    ATTR DS_UNUSED static int64_t NAME(T *o, const T *n, int64_t a, int64_t b, int64_t *pos, T *nw, T *od,    \
                                       int64_t cap, int advance, int64_t *next) {                             \
        const int64_t per = 64 / W;                                                                           \
        int64_t c = 0, j = a;                                                                                 \
        for (; j + per <= b && c + per <= cap; j += per) {                                                    \
            uint64_t m = MASK;                                                                                \
            if (!m) continue;                                                                                 \
            do {                                                                                              \
                int64_t q = j + (int64_t)(ds_ctz64(m) >> SHIFT);                                              \
                pos[c] = q;                                                                                   \
                nw[c] = n[q];                                                                                 \
                od[c] = o[q];                                                                                 \
                c++;                                                                                          \
                m &= m - 1;                                                                                   \
            } while (m);                                                                                      \
            if (advance) memcpy(o + j, n + j, 64);                                                            \
        }                                                                                                     \
        DS_DIFF_SCALAR(T)                                                                                     \
        *next = j;                                                                                            \
        return c;                                                                                             \
    }

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(DELTASTORE_NO_CLONES)
#include <immintrin.h>
#define DS_X86_DISPATCH 1
#define DS_AVX512 __attribute__((target("avx512f,avx512bw,bmi,popcnt")))
#define DS_AVX2 __attribute__((target("avx2,bmi,popcnt")))
/* AVX-512BW: one compare of the right width gives the element mask itself */
#define DS_M512(F) (uint64_t)F(_mm512_loadu_si512((const void *)(o + j)), _mm512_loadu_si512((const void *)(n + j)))
/* AVX2 / SSE2: equal-byte masks, inverted, folded to one bit per element */
#define DS_M256                                                                                               \
    ds_fold_mask(~((uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(                               \
                       _mm256_loadu_si256((const __m256i *)(const void *)(o + j)),                            \
                       _mm256_loadu_si256((const __m256i *)(const void *)(n + j))))                           \
                   | ((uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(                             \
                       _mm256_loadu_si256((const __m256i *)((const char *)(o + j) + 32)),                     \
                       _mm256_loadu_si256((const __m256i *)((const char *)(n + j) + 32)))) << 32)),          \
                 (int)sizeof(*o))
#define DS_SSE_Q(k)                                                                                           \
    ((uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(                                                    \
         _mm_loadu_si128((const __m128i *)((const char *)(o + j) + 16 * k)),                                  \
         _mm_loadu_si128((const __m128i *)((const char *)(n + j) + 16 * k)))) << (16 * k))
#define DS_M128 ds_fold_mask(~(DS_SSE_Q(0) | DS_SSE_Q(1) | DS_SSE_Q(2) | DS_SSE_Q(3)), (int)sizeof(*o))
#define DS_DIFF_ISAS(T, W, SHIFT, CMP512)                                                                     \
    DS_DIFF_FN(ds_diff_avx512_##W, DS_AVX512, T, W, 0, DS_M512(CMP512))                                       \
    DS_DIFF_FN(ds_diff_avx2_##W, DS_AVX2, T, W, SHIFT, DS_M256)                                               \
    DS_DIFF_FN(ds_diff_sse2_##W, , T, W, SHIFT, DS_M128)
DS_DIFF_ISAS(uint8_t, 1, 0, _mm512_cmpneq_epi8_mask)
DS_DIFF_ISAS(uint16_t, 2, 1, _mm512_cmpneq_epi16_mask)
DS_DIFF_ISAS(uint32_t, 4, 2, _mm512_cmpneq_epi32_mask)
DS_DIFF_ISAS(uint64_t, 8, 3, _mm512_cmpneq_epi64_mask)
/* AVX-512 with VBMI2 (16-bit elements): each block's changes are compressed into place (vpcompressw for the
   bits and for the lane numbers, which are widened to positions), with no branch per change: the outputs get
   32 slots written per block (c + 32 <= cap keeps them inside) and c moves by the changes. Runs of 64 blocks
   where few blocks change skip the unchanged ones (a predictable branch); where many do, every block goes
   through the same instructions (a branch on it would be mispredicted about every other block). */
#define DS_AVX512V __attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt")))
#define DS_VBMI2_BLOCK(SKIP)                                                                                  \
    {                                                                                                         \
        __m512i vo = _mm512_loadu_si512((const void *)(o + j)), vn = _mm512_loadu_si512((const void *)(n + j)); \
        __mmask32 m = _mm512_cmpneq_epi16_mask(vo, vn);                                                       \
        if (SKIP && !m) continue;                                                                             \
        __m512i lanes = _mm512_maskz_compress_epi16(m, iota), base = _mm512_set1_epi64(j);                    \
        _mm512_storeu_si512((void *)(nw + c), _mm512_maskz_compress_epi16(m, vn));                            \
        _mm512_storeu_si512((void *)(od + c), _mm512_maskz_compress_epi16(m, vo));                            \
        _mm512_storeu_si512((void *)(pos + c),                                                                \
                            _mm512_add_epi64(base, _mm512_cvtepu16_epi64(_mm512_castsi512_si128(lanes))));    \
        _mm512_storeu_si512((void *)(pos + c + 8),                                                            \
                            _mm512_add_epi64(base, _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(lanes, 1)))); \
        _mm512_storeu_si512((void *)(pos + c + 16),                                                           \
                            _mm512_add_epi64(base, _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(lanes, 2)))); \
        _mm512_storeu_si512((void *)(pos + c + 24),                                                           \
                            _mm512_add_epi64(base, _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(lanes, 3)))); \
        if (advance) _mm512_mask_storeu_epi16((void *)(o + j), m, vn);                                        \
        c += __builtin_popcount((unsigned)m);                                                                 \
        hit += m != 0;                                                                                        \
    }
DS_AVX512V DS_UNUSED static int64_t ds_diff_vbmi2_2(uint16_t *o, const uint16_t *n, int64_t a, int64_t b,
                                                   int64_t *pos, uint16_t *nw, uint16_t *od, int64_t cap,
                                                   int advance, int64_t *next) {
    const __m512i iota = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15,
                                          14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    int64_t c = 0, j = a, hit = 0;
    int dense = 0;
    while (j + 32 <= b && c + 32 <= cap) {
        int64_t end = j + 64 * 32 < b ? j + 64 * 32 : b;
        hit = 0;
        if (dense) {
            for (; j + 32 <= end && c + 32 <= cap; j += 32) DS_VBMI2_BLOCK(0)
        } else {
            for (; j + 32 <= end && c + 32 <= cap; j += 32) DS_VBMI2_BLOCK(1)
        }
        dense = hit >= 16; /* a quarter of this run's blocks changed: the next run takes every block */
    }
    DS_DIFF_SCALAR(uint16_t)
    *next = j;
    return c;
}
/* other widths: the plain AVX-512 loop */
#define ds_diff_vbmi2_1 ds_diff_avx512_1
#define ds_diff_vbmi2_4 ds_diff_avx512_4
#define ds_diff_vbmi2_8 ds_diff_avx512_8
/* the best ISA this CPU has: 2: AVX-512BW, 1: AVX2, 0: SSE2 (every x86-64 CPU) */
DS_UNUSED static int ds_diff_isa(void) {
    static int isa = -1;
    if (isa < 0) {
        __builtin_cpu_init();
        isa = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
                  ? (__builtin_cpu_supports("avx512vbmi2") ? 3 : 2)
                  : __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return isa;
}
/* ds_diff_on_W: with a given ISA (at most the CPU's; tests run every one); ds_diff_W: with the best */
#define DS_DIFF_DISPATCH(T, W)                                                                                \
    DS_UNUSED static int64_t ds_diff_on_##W(int isa, T *o, const T *n, int64_t a, int64_t b, int64_t *pos,   \
                                            T *nw, T *od, int64_t cap, int advance, int64_t *next) {          \
        if (isa < 0 || isa > ds_diff_isa()) isa = ds_diff_isa();                                              \
        if (isa == 3) return ds_diff_vbmi2_##W(o, n, a, b, pos, nw, od, cap, advance, next);                 \
        return isa == 2 ? ds_diff_avx512_##W(o, n, a, b, pos, nw, od, cap, advance, next)                    \
               : isa == 1 ? ds_diff_avx2_##W(o, n, a, b, pos, nw, od, cap, advance, next)                    \
                          : ds_diff_sse2_##W(o, n, a, b, pos, nw, od, cap, advance, next);                   \
    }                                                                                                         \
    DS_UNUSED static int64_t ds_diff_##W(T *o, const T *n, int64_t a, int64_t b, int64_t *pos, T *nw, T *od,  \
                                         int64_t cap, int advance, int64_t *next) {                           \
        return ds_diff_on_##W(-1, o, n, a, b, pos, nw, od, cap, advance, next);                               \
    }
#else
/* elsewhere: the same blocks, their element mask built by plain compares */
#define DS_MASK_PLAIN(T, W)                                                                                   \
    DS_UNUSED static inline uint64_t ds_mask_plain_##W(const T *o, const T *n) {                              \
        uint64_t m = 0;                                                                                       \
        for (int e = 0; e < 64 / W; e++) m |= (uint64_t)(o[e] != n[e]) << e;                                  \
        return m;                                                                                             \
    }
DS_MASK_PLAIN(uint8_t, 1)
DS_MASK_PLAIN(uint16_t, 2)
DS_MASK_PLAIN(uint32_t, 4)
DS_MASK_PLAIN(uint64_t, 8)
DS_UNUSED static int ds_diff_isa(void) { return 0; }
#define DS_DIFF_DISPATCH(T, W)                                                                                \
    DS_DIFF_FN(ds_diff_##W, , T, W, 0, ds_mask_plain_##W(o + j, n + j))                                      \
    DS_UNUSED static int64_t ds_diff_on_##W(int isa, T *o, const T *n, int64_t a, int64_t b, int64_t *pos,   \
                                            T *nw, T *od, int64_t cap, int advance, int64_t *next) {          \
        (void)isa;                                                                                            \
        return ds_diff_##W(o, n, a, b, pos, nw, od, cap, advance, next);                                      \
    }
#endif
DS_DIFF_DISPATCH(uint8_t, 1)
DS_DIFF_DISPATCH(uint16_t, 2)
DS_DIFF_DISPATCH(uint32_t, 4)
DS_DIFF_DISPATCH(uint64_t, 8)

/* --- ranks by 64-element blocks (16-bit elements: bf16, fp16) -------------------------------------------------
   masks3: for the elements x[0..n) (n <= 64) whose magnitude (x & mask) is >= t1, t2, t3, one bit each (bit e:
   element e; lanes at or past n are 0). ranks3b / select3b: ds_ranks3 / ds_select3 by whole blocks of 64: a block's
   three masks give every element's bucket (the masks set at it) and, by a popcount below it, its rank, so an
   element costs a few instructions whatever the changes' density. The ISA is picked at the first call, as for
   the compare. */
#define DS_MASKS3_PLAIN                                                                                       \
    {                                                                                                         \
        uint64_t a1 = 0, a2 = 0, a3 = 0;                                                                      \
        for (int e = 0; e < n; e++) {                                                                         \
            int32_t m = (int32_t)(x[e] & (uint16_t)mask);                                                     \
            a1 |= (uint64_t)(m >= t1) << e;                                                                   \
            a2 |= (uint64_t)(m >= t2) << e;                                                                   \
            a3 |= (uint64_t)(m >= t3) << e;                                                                   \
        }                                                                                                     \
        *m1 = a1;                                                                                             \
        *m2 = a2;                                                                                             \
        *m3 = a3;                                                                                             \
    }
DS_UNUSED static inline void ds_masks3_plain(const uint16_t *x, int n, int32_t mask, int32_t t1, int32_t t2,
                                             int32_t t3, uint64_t *m1, uint64_t *m2, uint64_t *m3)
    DS_MASKS3_PLAIN
#ifdef DS_X86_DISPATCH
/* AVX-512BW: masked loads (lanes past n are never read) and unsigned compares into mask registers.
   Thresholds above 0xFFFF cannot be met by a 16-bit magnitude: they give an empty mask. */
DS_AVX512 DS_UNUSED static inline uint32_t ds_mask32_ge(__m512i v, __mmask32 valid, int32_t t) {
    return t > 0xFFFF ? 0 : (uint32_t)_mm512_mask_cmpge_epu16_mask(valid, v, _mm512_set1_epi16((short)t));
}
DS_AVX512 DS_UNUSED static inline void ds_masks3_avx512(const uint16_t *x, int n, int32_t mask, int32_t t1,
                                                        int32_t t2, int32_t t3, uint64_t *m1, uint64_t *m2,
                                                        uint64_t *m3) {
    int n0 = n < 32 ? n : 32, n1 = n - n0;
    __mmask32 v0 = n0 >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n0) - 1);
    __mmask32 v1 = n1 >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n1) - 1);
    __m512i k = _mm512_set1_epi16((short)mask);
    __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi16(v0, (const void *)x), k);
    __m512i b = _mm512_and_si512(_mm512_maskz_loadu_epi16(v1, (const void *)(x + 32)), k);
    *m1 = ds_mask32_ge(a, v0, t1) | (uint64_t)ds_mask32_ge(b, v1, t1) << 32;
    *m2 = ds_mask32_ge(a, v0, t2) | (uint64_t)ds_mask32_ge(b, v1, t2) << 32;
    *m3 = ds_mask32_ge(a, v0, t3) | (uint64_t)ds_mask32_ge(b, v1, t3) << 32;
}
#endif

#define DS_RANKS3B(NAME, ATTR, MASKS)                                                                         \
    ATTR DS_UNUSED static void NAME(const uint16_t *bits, int32_t mask, int32_t t1, int32_t t2, int32_t t3,   \
                                    const int64_t *pos, int64_t i0, int64_t i1, int64_t start, int64_t stop,  \
                                    int64_t g1, int64_t g2, int64_t g3, int64_t *rank, int64_t *bucket,       \
                                    int64_t *gend) {                                                          \
        int64_t cur = start, j = i0;                                                                          \
        uint64_t m1, m2, m3;                                                                                  \
        while (j < i1) {                                                                                      \
            int64_t p = pos[j];                                                                               \
            while (cur + 64 <= p) { /* whole blocks without a change: counted */                              \
                MASKS(bits + cur, 64, mask, t1, t2, t3, &m1, &m2, &m3);                                       \
                g1 += __builtin_popcountll(m1);                                                                 \
                g2 += __builtin_popcountll(m2);                                                                 \
                g3 += __builtin_popcountll(m3);                                                                 \
                cur += 64;                                                                                    \
            }                                                                                                 \
            int64_t end = cur + 64 < stop ? cur + 64 : stop;                                                  \
            MASKS(bits + cur, (int)(end - cur), mask, t1, t2, t3, &m1, &m2, &m3);                             \
            do { /* every change in this block */                                                            \
                int e = (int)(p - cur);                                                                       \
                uint64_t below = (1ull << e) - 1;                                                 \
                int64_t b = ((m1 >> e) & 1) + ((m2 >> e) & 1) + ((m3 >> e) & 1);                              \
                /* G_k before p (G_0 = p, G_4 = 0): the rank in bucket b is G_b - G_(b+1), no branch on b */     \
                int64_t G[5] = {p, g1 + __builtin_popcountll(m1 & below), g2 + __builtin_popcountll(m2 & below),  \
                                g3 + __builtin_popcountll(m3 & below), 0};                                      \
                rank[j] = G[b] - G[b + 1];                                                                    \
                bucket[j] = b;                                                                                \
                j++;                                                                                          \
            } while (j < i1 && (p = pos[j]) < end);                                                           \
            g1 += __builtin_popcountll(m1);                                                                     \
            g2 += __builtin_popcountll(m2);                                                                     \
            g3 += __builtin_popcountll(m3);                                                                     \
            cur = end;                                                                                        \
        }                                                                                                     \
        if (!gend) return;                                                                                    \
        for (; cur < stop; cur += 64) { /* on to the end: the totals */                                       \
            MASKS(bits + cur, (int)(stop - cur < 64 ? stop - cur : 64), mask, t1, t2, t3, &m1, &m2, &m3);     \
            g1 += __builtin_popcountll(m1);                                                                     \
            g2 += __builtin_popcountll(m2);                                                                     \
            g3 += __builtin_popcountll(m3);                                                                     \
        }                                                                                                     \
        gend[0] = g1;                                                                                         \
        gend[1] = g2;                                                                                         \
        gend[2] = g3;                                                                                         \
    }

/* the bit of x holding its r-th set bit (r < popcount(x)) */
DS_UNUSED static inline int ds_select_bit(uint64_t x, int64_t r) {
    while (r-- > 0) x &= x - 1;
    return ds_ctz64(x);
}
#ifdef DS_X86_DISPATCH
__attribute__((target("bmi,bmi2"))) DS_UNUSED static inline int ds_select_bit_bmi2(uint64_t x, int64_t r) {
    return ds_ctz64((uint64_t)_pdep_u64(1ull << r, x));
}
#endif

#define DS_SELECT3B(NAME, ATTR, MASKS, SELECT_BIT)                                                            \
    ATTR DS_UNUSED static int64_t NAME(const uint16_t *bits, int32_t mask, int32_t t1, int32_t t2, int32_t t3, \
                                       int64_t start, int64_t stop, const int64_t *ranks, const int64_t *off,  \
                                       const int64_t *lo, const int64_t *hi, int64_t g1, int64_t g2,           \
                                       int64_t g3, int64_t base, int64_t *outpos, int64_t *src,                \
                                       const int64_t *steps, uint16_t *newbits, int *bad) {                    \
        int64_t ptr[4], want[4], remaining = 0, o = base, idx = start;                                        \
        for (int b = 0; b < 4; b++) {                                                                         \
            ptr[b] = lo[b];                                                                                   \
            want[b] = ptr[b] < hi[b] ? ranks[off[b] + ptr[b]] : -1;                                           \
            remaining += hi[b] - ptr[b];                                                                      \
        }                                                                                                     \
        uint64_t m1, m2, m3;                                                                                  \
        int64_t at[64];                                                                                       \
        while (remaining > 0 && idx < stop) {                                                                 \
            int64_t end = idx + 64 < stop ? idx + 64 : stop;                                                  \
            int len = (int)(end - idx);                                                                       \
            MASKS(bits + idx, len, mask, t1, t2, t3, &m1, &m2, &m3);                                          \
            /* thresholds do not decrease, so m3 is within m2 within m1: the buckets' counts need three popcounts */ \
            int p1 = __builtin_popcountll(m1), p2 = __builtin_popcountll(m2), p3 = __builtin_popcountll(m3);        \
            int64_t cnt[4] = {len - p1, p1 - p2, p2 - p3, p3};                                                \
            /* bucket b's elements before this block: G_b - G_(b+1) (G_0: idx, G_4: 0) */                     \
            int64_t before[4] = {idx - g1, g1 - g2, g2 - g3, g3};                                             \
            g1 += p1;                                                                                         \
            g2 += p2;                                                                                         \
            g3 += p3;                                                                                         \
            /* the buckets with a wanted rank in this block (none left: -1, a rank below: huge unsigned) */   \
            uint32_t hit = (uint32_t)((uint64_t)(want[0] - before[0]) < (uint64_t)cnt[0])                     \
                           | (uint32_t)((uint64_t)(want[1] - before[1]) < (uint64_t)cnt[1]) << 1              \
                           | (uint32_t)((uint64_t)(want[2] - before[2]) < (uint64_t)cnt[2]) << 2              \
                           | (uint32_t)((uint64_t)(want[3] - before[3]) < (uint64_t)cnt[3]) << 3;             \
            if (!hit) {                                                                                       \
                idx = end;                                                                                    \
                continue;                                                                                     \
            }                                                                                                 \
            uint64_t valid = len >= 64 ? ~0ull : (1ull << len) - 1;                           \
            uint64_t mb[4] = {valid & ~m1, m1 & ~m2, m2 & ~m3, m3};                                           \
            uint64_t found = 0;                                                                               \
            while (hit) {                                                                                     \
                int b = ds_ctz64((uint64_t)hit);                                                              \
                hit &= hit - 1;                                                                               \
                do {                                                                                          \
                    int e = SELECT_BIT(mb[b], want[b] - before[b]);                                           \
                    found |= 1ull << e;                                                                         \
                    at[e] = off[b] + ptr[b];                                                                  \
                    ptr[b]++;                                                                                 \
                    remaining--;                                                                              \
                    want[b] = ptr[b] < hi[b] ? ranks[off[b] + ptr[b]] : -1;                                   \
                } while ((uint64_t)(want[b] - before[b]) < (uint64_t)cnt[b]);                                 \
            }                                                                                                 \
            while (found) { /* in position order */                                                           \
                int e = ds_ctz64(found);                                                            \
                outpos[o] = idx + e;                                                                          \
                src[o] = at[e];                                                                               \
                if (steps) { /* the element's new bits: its ordered value plus its step (a 16-bit float) */   \
                    int64_t x = (int16_t)bits[idx + e], mag = x & 0x7FFF;                                     \
                    int64_t v = (x < 0 ? ~mag : mag) + steps[at[e]];                                          \
                    *bad |= v < -32768 || v > 32767;                                                          \
                    newbits[o] = (uint16_t)(v < 0 ? ((~v) | 0x8000) : v);                                     \
                }                                                                                             \
                o++;                                                                                          \
                found &= found - 1;                                                                           \
            }                                                                                                 \
            idx = end;                                                                                        \
        }                                                                                                     \
        return remaining;                                                                                     \
    }

DS_RANKS3B(ds_ranks3b_plain, , ds_masks3_plain)
DS_SELECT3B(ds_select3b_plain, , ds_masks3_plain, ds_select_bit)
#ifdef DS_X86_DISPATCH
#define DS_AVX512B2 __attribute__((target("avx512f,avx512bw,bmi,bmi2,popcnt")))
DS_RANKS3B(ds_ranks3b_avx512, DS_AVX512, ds_masks3_avx512)
DS_SELECT3B(ds_select3b_avx512, DS_AVX512B2, ds_masks3_avx512, ds_select_bit_bmi2)
#endif
/* the best for this CPU (isa >= 0: at most that one, for tests; 0 is plain C) */
DS_UNUSED static void ds_ranks3b_2(int isa, const uint16_t *bits, int32_t mask, int32_t t1, int32_t t2, int32_t t3,
                                   const int64_t *pos, int64_t i0, int64_t i1, int64_t start, int64_t stop,
                                   int64_t g1, int64_t g2, int64_t g3, int64_t *rank, int64_t *bucket,
                                   int64_t *gend) {
#ifdef DS_X86_DISPATCH
    if ((isa < 0 || isa >= 2) && ds_diff_isa() >= 2) {
        ds_ranks3b_avx512(bits, mask, t1, t2, t3, pos, i0, i1, start, stop, g1, g2, g3, rank, bucket, gend);
        return;
    }
#endif
    (void)isa;
    ds_ranks3b_plain(bits, mask, t1, t2, t3, pos, i0, i1, start, stop, g1, g2, g3, rank, bucket, gend);
}
/* steps / newbits / bad (NULL for none): the new bits of each found element, its step (indexed like ranks)
   added to its ordered value as a 16-bit float; *bad set when one leaves the dtype's range */
DS_UNUSED static int64_t ds_select3b_2(int isa, const uint16_t *bits, int32_t mask, int32_t t1, int32_t t2,
                                       int32_t t3, int64_t start, int64_t stop, const int64_t *ranks,
                                       const int64_t *off, const int64_t *lo, const int64_t *hi, int64_t g1,
                                       int64_t g2, int64_t g3, int64_t base, int64_t *outpos, int64_t *src,
                                       const int64_t *steps, uint16_t *newbits, int *bad) {
#ifdef DS_X86_DISPATCH
    if ((isa < 0 || isa >= 2) && ds_diff_isa() >= 2)
        return ds_select3b_avx512(bits, mask, t1, t2, t3, start, stop, ranks, off, lo, hi, g1, g2, g3, base,
                                  outpos, src, steps, newbits, bad);
#endif
    (void)isa;
    return ds_select3b_plain(bits, mask, t1, t2, t3, start, stop, ranks, off, lo, hi, g1, g2, g3, base, outpos,
                             src, steps, newbits, bad);
}

#endif
