/* The kernels' loops that gain from wide vectors, in C so that each can carry run-time CPU dispatch.

   A wheel is compiled for its platform's baseline (x86-64: SSE2). On x86-64 Linux these functions are
   compiled three times (baseline, x86-64-v3 = AVX2, x86-64-v4 = AVX-512) by GCC's or clang's
   ``target_clones``, and the dynamic loader picks the best one for the CPU once, when the module loads
   (an ifunc: no per-call cost). Elsewhere they are compiled once, for the baseline.

   Every function is a plain loop over memory the caller has checked; none allocates, none touches Python
   objects (they run without the GIL). Semantics are stated at each function; the Cython modules that call
   them (``_checksum.pyx``, ``_diff.pyx``, ``_planes.pyx``, ``_ranks.pyx``) give the contract. */

#ifndef DELTASTORE_SIMD_H
#define DELTASTORE_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__) && !defined(DELTASTORE_NO_CLONES) \
    && ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 14))
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

/* --- ranks (kernels/ranks.py): elements of bits[0:n] whose magnitude (bits & mask) is >= t1, t2, t3 --------
   Lanes are int32 for 8- and 16-bit elements (mask and thresholds then fit in 31 bits), else int64. Masks
   are below 2**width, so zero- and sign-extension of the element give the same magnitude. */

#define DS_COUNT3(T, W, L)                                                                                    \
    DS_FN void ds_count3_##W(const T *b, int64_t n, L mask, L t1, L t2, L t3, int64_t *out) {      \
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
        out[0] = a1;                                                                                          \
        out[1] = a2;                                                                                          \
        out[2] = a3;                                                                                          \
    }

DS_COUNT3(uint8_t, 1, int32_t)
DS_COUNT3(uint16_t, 2, int32_t)
DS_COUNT3(uint32_t, 4, int64_t)
DS_COUNT3(uint64_t, 8, int64_t)

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

#endif
