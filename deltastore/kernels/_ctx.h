/* The ``ctx`` codec's per-tensor coding in C (kernels/ctx.py states the contract; docs/codecs.md the layout).

   Encoder: the bucket thresholds (dynamic programming over the exponent classes, as the numpy encoder before
   it did: tests/test_kernels_ctx.py keeps that formulation as the reference), then per bucket the subsets POS
   (ranks), BIG and NEG and the magnitudes, each sequence with the cheapest RICE / EG kind by exact bit count
   (``_bits.best_kind``: ties to the first kind tried) written into the U (unary) and R (raw) bit streams, MSB
   first. Decoder: the same sequences read back from the streams, every read bounded by the stream's length and
   every value by its universe (a status, never a read or write out of bounds). Memory: the growable bit
   writers and temporaries of a few words per change (malloc, freed before returning; an allocation that fails
   is a status). */

#ifndef DELTASTORE_CTX_H
#define DELTASTORE_CTX_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_simd.h"

#define DSC_RICE 0
#define DSC_EG 1
#define DSC_FIXED 2
#define DSC_NONE 0
#define DSC_DIRECT 1
#define DSC_COMPLEMENT 2
#define DSC_BITMAP 3
#define DSC_SMALL 4096 /* values below this are counted in a histogram first */

static inline int dsc_bitlen(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

/* --- a growable MSB-first bit writer -------------------------------------------------------------------------
   Bits gather in a 64-bit accumulator (right-aligned, fewer than 8 pending between calls) and leave it a byte at
   a time; the buffer grows by doubling. nbits counts every bit written. */
typedef struct {
    uint8_t *buf;
    int64_t cap;   /* bytes */
    int64_t nbits; /* bits written */
    int oom;
    int64_t at;    /* whole bytes written to buf */
    uint64_t acc;  /* pending bits, right-aligned */
    int nacc;      /* how many */
} dsc_writer;

static int dsc_grow(dsc_writer *w, int64_t more_bytes) {
    int64_t need = w->at + more_bytes + 16;
    if (need <= w->cap) return 1;
    if (w->oom) return 0;
    int64_t cap = w->cap ? w->cap : 256;
    while (cap < need) cap *= 2;
    uint8_t *b = (uint8_t *)realloc(w->buf, (size_t)cap);
    if (!b) { w->oom = 1; return 0; }
    w->buf = b;
    w->cap = cap;
    return 1;
}

/* width bits (0..56) of v, MSB first */
static inline void dsc_put56(dsc_writer *w, uint64_t v, int width) {
    if (w->at + 16 > w->cap && !dsc_grow(w, 16)) return;
    w->acc = (w->acc << width) | (v & ((((uint64_t)1) << width) - 1));
    w->nacc += width;
    w->nbits += width;
    while (w->nacc >= 8) {
        w->nacc -= 8;
        w->buf[w->at++] = (uint8_t)(w->acc >> w->nacc);
    }
}

/* width bits (0..64) of v, MSB first */
static inline void dsc_put(dsc_writer *w, uint64_t v, int width) {
    if (width > 56) {
        dsc_put56(w, v >> 32, width - 32);
        width = 32;
    }
    dsc_put56(w, v, width);
}

/* q zero bits then a one bit */
static inline void dsc_unary(dsc_writer *w, uint64_t q) {
    if (q > 48) {
        if (!dsc_grow(w, (int64_t)(q / 8) + 2)) return;
        while (q > 48) {
            dsc_put56(w, 0, 48);
            q -= 48;
        }
    }
    dsc_put56(w, 1, (int)q + 1);
}

/* n zero bits */
static inline void dsc_zeros(dsc_writer *w, int64_t n) {
    if (!dsc_grow(w, n / 8 + 2)) return;
    while (n > 0) {
        int take = n > 48 ? 48 : (int)n;
        dsc_put56(w, 0, take);
        n -= take;
    }
}

/* the pending bits, zero-padded to a byte */
static inline void dsc_flush(dsc_writer *w) {
    if (w->nacc && dsc_grow(w, 2)) {
        w->buf[w->at++] = (uint8_t)(w->acc << (8 - w->nacc));
        w->nacc = 0;
    }
}

/* --- the cheapest kind of a sequence (exactly _bits.best_kind) -------------------------------------------- */
typedef struct {
    int kind, k;
    int64_t cost;
} dsc_kind;

static void dsc_add_costs(uint64_t x, int64_t c, int kr, int ke, uint64_t *rice, double *rice_f, int64_t *eg,
                          int64_t *shorts) {
    int b = dsc_bitlen(x);
    shorts[b] += c;
    for (int k = 0; k < (b < kr + 1 ? b : kr + 1); k++) {
        uint64_t q = x >> k;
        rice[k] += q * (uint64_t)c;
        rice_f[k] += (double)q * (double)c;
    }
    uint64_t top = b < 64 ? (uint64_t)1 << b : 0;
    for (int k = 0; k < (b < ke + 1 ? b : ke + 1); k++) {
        uint64_t s = x + ((uint64_t)1 << k);
        eg[k] += c * (b - 1 + ((b < 64 && s >= top) ? 1 : 0));
    }
}

/* values v[0..n) (or, with idx, v[idx[i]]); hist: DSC_SMALL int64 of scratch */
static dsc_kind dsc_best_kind(const uint64_t *v, int64_t n, int64_t *hist) {
    dsc_kind best = {DSC_RICE, 0, 0};
    if (n == 0) return best;
    uint64_t mx = 0;
    for (int64_t i = 0; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    int maxbits = dsc_bitlen(mx);
    int kr = maxbits < 63 ? maxbits : 63;
    int ke = maxbits < 62 ? (maxbits < 40 ? maxbits : 40) : -1;
    uint64_t rice[64];
    double rice_f[64];
    int64_t eg[41], shorts[66];
    memset(rice, 0, sizeof(rice));
    memset(rice_f, 0, sizeof(rice_f));
    memset(eg, 0, sizeof(eg));
    memset(shorts, 0, sizeof(shorts));
    int64_t lim = mx < DSC_SMALL ? (int64_t)mx + 1 : DSC_SMALL;
    memset(hist, 0, sizeof(int64_t) * (size_t)lim);
    for (int64_t i = 0; i < n; i++) {
        uint64_t x = v[i];
        if (x < DSC_SMALL) hist[x]++;
        else dsc_add_costs(x, 1, kr, ke, rice, rice_f, eg, shorts);
    }
    for (int64_t u = 0; u < lim; u++)
        if (hist[u]) dsc_add_costs((uint64_t)u, hist[u], kr, ke, rice, rice_f, eg, shorts);
    int64_t below = 0; /* values below 2**k: they add exactly k to eg[k] */
    for (int k = 0; k <= ke; k++) {
        below += shorts[k];
        eg[k] += (int64_t)k * below;
    }
    int have = 0;
    for (int k = 0; k <= kr; k++) {
        if (rice_f[k] > 1099511627776.0) continue; /* 2**40: an absurd unary length, never the cheapest */
        int64_t cost = (int64_t)rice[k] + n * (k + 1);
        if (!have || cost < best.cost) { best.kind = DSC_RICE; best.k = k; best.cost = cost; have = 1; }
    }
    for (int k = 0; k <= ke; k++) {
        int64_t cost = 2 * eg[k] - n * (k - 1);
        if (!have || cost < best.cost) { best.kind = DSC_EG; best.k = k; best.cost = cost; have = 1; }
    }
    if (!have) { best.kind = DSC_EG; best.k = 0; best.cost = 0; }
    return best;
}

static void dsc_write_seq(dsc_writer *U, dsc_writer *R, const uint64_t *v, int64_t n, dsc_kind kd) {
    if (kd.kind == DSC_RICE) {
        uint64_t low = kd.k ? (((uint64_t)1 << kd.k) - 1) : 0;
        for (int64_t i = 0; i < n; i++) {
            dsc_unary(U, v[i] >> kd.k);
            dsc_put(R, v[i] & low, kd.k);
        }
    } else if (kd.kind == DSC_EG) {
        for (int64_t i = 0; i < n; i++) {
            uint64_t u = v[i] + ((uint64_t)1 << kd.k);
            int L = dsc_bitlen(u) - 1;
            dsc_unary(U, (uint64_t)(L - kd.k));
            dsc_put(R, u - ((uint64_t)1 << L), L);
        }
    } else {
        for (int64_t i = 0; i < n; i++) dsc_put(R, v[i], kd.k);
    }
}

/* --- one subset of [0, n) ------------------------------------------------------------- */
typedef struct {
    uint64_t *hdr;
    int64_t nh, cap;
} dsc_header;

static inline void dsc_h(dsc_header *h, uint64_t x) {
    if (h->nh < h->cap) h->hdr[h->nh] = x;
    h->nh++; /* counted past the end: the caller sees the overflow and retries with room */
}

/* s: c sorted members; gaps, comp: scratch of c and n - c uint64; hist: DSC_SMALL int64 */
static void dsc_subset(const int64_t *s, int64_t c, int64_t n, dsc_header *h, dsc_writer *U, dsc_writer *R,
                       uint64_t *gaps, uint64_t *comp, int64_t *hist) {
    dsc_h(h, (uint64_t)c);
    if (c == 0) return;
    if (c == n) {
        dsc_h(h, DSC_NONE);
        return;
    }
    int64_t prev = -1;
    for (int64_t i = 0; i < c; i++) {
        gaps[i] = (uint64_t)(s[i] - prev - 1);
        prev = s[i];
    }
    dsc_kind kd = dsc_best_kind(gaps, c, hist);
    int mode = DSC_DIRECT;
    const uint64_t *vals = gaps;
    int64_t nv = c;
    if (2 * c > n) { /* the complement's gaps: members between consecutive non-members */
        int64_t j = 0, run = 0, m = 0;
        for (int64_t x = 0; x < n; x++) {
            if (j < c && s[j] == x) {
                run++;
                j++;
            } else {
                comp[m++] = (uint64_t)run;
                run = 0;
            }
        }
        dsc_kind kc = dsc_best_kind(comp, m, hist);
        if (kc.cost < kd.cost) {
            mode = DSC_COMPLEMENT;
            kd = kc;
            vals = comp;
            nv = m;
        }
    }
    if (n < kd.cost) {
        dsc_h(h, DSC_BITMAP);
        int64_t prev = -1;
        for (int64_t j = 0; j < c; j++) { /* n bits, a one at each member */
            dsc_zeros(R, s[j] - prev - 1);
            dsc_put56(R, 1, 1);
            prev = s[j];
        }
        dsc_zeros(R, n - prev - 1);
        return;
    }
    dsc_h(h, (uint64_t)mode);
    dsc_h(h, (uint64_t)kd.k * 4 + (uint64_t)kd.kind);
    dsc_write_seq(U, R, vals, nv, kd);
}

/* --- one tensor ---------------------------------------------------------------------------------------------
   m changes in position order: bucket[i] (< nb), rank[i] (within the bucket, below sizes[bucket]), d[i] (the
   ordered step, != 0). Appends per bucket POS/BIG/NEG/MAG to the header and the streams (docs/codecs.md).
   scratch: 5 * m + 2 int64-sized slots; hist: DSC_SMALL int64; comp: max(sizes) uint64 (complement gaps).
   Returns 0, or -1 when out of memory. */
static int dsc_code_tensor(int64_t m, const int64_t *bucket, const int64_t *rank, const int64_t *d, int nb,
                           const int64_t *sizes, dsc_header *h, dsc_writer *U, dsc_writer *R, int64_t *scratch,
                           uint64_t *comp, int64_t *hist) {
    int64_t start[17];
    memset(start, 0, sizeof(start));
    for (int64_t i = 0; i < m; i++) start[bucket[i] + 1]++;
    for (int b = 0; b < nb; b++) start[b + 1] += start[b];
    int64_t *r_of = scratch, *d_of = scratch + m, *sel = scratch + 2 * m;
    uint64_t *tmp = (uint64_t *)(scratch + 3 * m); /* 2 * m + 2 */
    int64_t fill[16];
    for (int b = 0; b < nb; b++) fill[b] = start[b];
    for (int64_t i = 0; i < m; i++) { /* stable by bucket: each bucket's changes in position order */
        int64_t b = bucket[i];
        r_of[fill[b]] = rank[i];
        d_of[fill[b]] = d[i];
        fill[b]++;
    }
    for (int b = 0; b < nb; b++) {
        int64_t a0 = start[b], mb = start[b + 1] - start[b];
        if (mb == 0) {
            dsc_h(h, 0);
            continue;
        }
        dsc_subset(r_of + a0, mb, sizes[b], h, U, R, tmp, comp, hist);
        int64_t nbig = 0, nneg = 0;
        for (int64_t i = 0; i < mb; i++) {
            int64_t x = d_of[a0 + i];
            uint64_t a = x < 0 ? (uint64_t)0 - (uint64_t)x : (uint64_t)x;
            if (a >= 2) sel[nbig++] = i;
        }
        dsc_subset(sel, nbig, mb, h, U, R, tmp, comp, hist);
        for (int64_t i = 0; i < mb; i++)
            if (d_of[a0 + i] < 0) sel[nneg++] = i;
        dsc_subset(sel, nneg, mb, h, U, R, tmp, comp, hist);
        if (nbig) {
            int64_t j = 0;
            for (int64_t i = 0; i < mb; i++) {
                int64_t x = d_of[a0 + i];
                uint64_t a = x < 0 ? (uint64_t)0 - (uint64_t)x : (uint64_t)x;
                if (a >= 2) tmp[j++] = a - 2;
            }
            dsc_kind kd = dsc_best_kind(tmp, nbig, hist);
            dsc_h(h, (uint64_t)kd.k * 4 + (uint64_t)kd.kind);
            dsc_write_seq(U, R, tmp, nbig, kd);
        }
    }
    return (U->oom || R->oom) ? -1 : 0;
}

/* --- thresholds ---------------------------------------------------------------------
   counts, hits: per class (nclass of them). Writes up to max_buckets - 1 thresholds (class << shift) to out,
   returns how many. work: (max_buckets + 1) * (m + 1) doubles and as many int64 (m: classes with elements),
   plus 2 * (m + 1) doubles. */
static double dsc_entropy_cost(double n, double k) {
    double p = n > 0 ? k / (n > 1 ? n : 1) : 0.0;
    double a = p * log2(p > 0 ? p : 1.0), b = (1 - p) * log2(p < 1 ? 1 - p : 1.0);
    return n * -(a + b) + 64.0;
}

static int dsc_thresholds(const int64_t *counts, const int64_t *hits, int64_t nclass, int max_buckets, int shift,
                          int64_t *out, int64_t *nz, double *C, double *K, double *best, int64_t *arg) {
    int64_t m = 0, total_hits = 0;
    for (int64_t c = 0; c < nclass; c++) {
        if (counts[c]) nz[m++] = c;
        total_hits += hits[c];
    }
    if (m <= 1 || max_buckets <= 1 || total_hits == 0) return 0;
    C[0] = 0;
    K[0] = 0;
    for (int64_t i = 0; i < m; i++) {
        C[i + 1] = C[i] + (double)counts[nz[i]];
        K[i + 1] = K[i] + (double)hits[nz[i]];
    }
    int64_t W = m + 1;
    for (int64_t i = 0; i < (int64_t)(max_buckets + 1) * W; i++) best[i] = INFINITY;
    best[0] = 0.0;
    for (int g = 1; g <= max_buckets; g++) {
        for (int64_t j = 0; j < W; j++) {
            double bv = 0;
            int64_t bi = 0;
            for (int64_t i = 0; i < W; i++) {
                double cost = i < j ? dsc_entropy_cost(C[j] - C[i], K[j] - K[i]) : INFINITY;
                double t = best[(g - 1) * W + i] + cost;
                if (i == 0 || t < bv) {
                    bv = t;
                    bi = i;
                }
            }
            arg[g * W + j] = bi;
            best[g * W + j] = bv;
        }
    }
    int gbest = 1;
    for (int g = 2; g <= max_buckets; g++)
        if (best[g * W + m] < best[gbest * W + m]) gbest = g;
    int64_t cuts[17], nc = 0, j = m;
    for (int g = gbest; g > 0; g--) {
        int64_t i = arg[g * W + j];
        if (i > 0) cuts[nc++] = i;
        j = i;
    }
    for (int64_t a = 0; a < nc; a++) /* ascending */
        out[a] = nz[cuts[nc - 1 - a]] << shift;
    return (int)nc;
}

/* --- one 16-bit float tensor (bf16: 7 mantissa bits, fp16: 10), everything in one call --------------------------
   old: the n old elements; pos: the m changed positions (sorted); nw: their new bits. As CtxCodec._encode_one:
   class counts of the old tensor (every 16th element above 2**16), the changed elements' classes, thresholds,
   ordered steps, each change's bucket and rank (one pass by 32-element blocks for four buckets or fewer, a class
   table per element for more), then the coded subsets. The header gets nb, the thresholds, the subsets and the
   two stream lengths. Returns 0, -1 out of memory. */
static inline int64_t dsc_ordered16(uint16_t v) {
    int64_t x = (int16_t)v, mag = x & 0x7FFF;
    return x < 0 ? ~mag : mag;
}

static int dsc_encode16(const uint16_t *old, int64_t n, const int64_t *pos, const uint16_t *nw, int64_t m,
                        int shift, int max_buckets, dsc_header *h, dsc_writer *U, dsc_writer *R) {
    const int32_t mask = 0x7FFF;
    const int64_t nclass = ((int64_t)mask >> shift) + 1;
    int status = -1;
    int64_t *counts = (int64_t *)calloc((size_t)(2 * nclass + 1), sizeof(int64_t));
    int64_t *work = (int64_t *)malloc(sizeof(int64_t) * (size_t)(8 * m + 8 + DSC_SMALL));
    uint64_t *comp = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)(m + 1));
    double *dp = (double *)malloc(sizeof(double) * (size_t)((max_buckets + 3) * (nclass + 1)));
    int64_t *dpi = (int64_t *)malloc(sizeof(int64_t) * (size_t)((max_buckets + 2) * (nclass + 1)));
    if (!counts || !work || !comp || !dp || !dpi) goto done;
    {
        int64_t *hits = counts + nclass, *bucket = work, *rank = work + m, *d = work + 2 * m;
        int64_t *scratch = work + 3 * m, *hist = work + 8 * m + 8;
        int64_t th[17], nth = 0, sizes[17];
        for (int64_t i = 0; i < m; i++) {
            uint16_t o = old[pos[i]];
            hits[(o & mask) >> shift]++;
            d[i] = dsc_ordered16(nw[i]) - dsc_ordered16(o);
        }
        if (max_buckets > 1 && m) {
            int64_t stride = n > (1 << 16) ? 16 : 1; /* as ctx._SAMPLE_ABOVE */
            /* four interleaved sub-histograms: elements of one class do not wait on each other's store */
            int64_t *h4 = (int64_t *)calloc((size_t)(4 * nclass), sizeof(int64_t));
            if (!h4) goto done;
            int64_t i = 0;
            for (; i + 3 * stride < n; i += 4 * stride) {
                h4[(old[i] & mask) >> shift]++;
                h4[nclass + ((old[i + stride] & mask) >> shift)]++;
                h4[2 * nclass + ((old[i + 2 * stride] & mask) >> shift)]++;
                h4[3 * nclass + ((old[i + 3 * stride] & mask) >> shift)]++;
            }
            for (; i < n; i += stride) h4[(old[i] & mask) >> shift]++;
            for (int64_t c = 0; c < nclass; c++) {
                counts[c] = (h4[c] + h4[nclass + c] + h4[2 * nclass + c] + h4[3 * nclass + c]) * stride;
                if (hits[c] > counts[c]) counts[c] = hits[c];
            }
            free(h4);
            nth = dsc_thresholds(counts, hits, nclass, max_buckets, shift, th, dpi, dp, dp + nclass + 1,
                                 dp + 2 * (nclass + 1), dpi + nclass + 1);
        }
        int nb = (int)nth + 1;
        if (nth == 0) {
            for (int64_t i = 0; i < m; i++) {
                bucket[i] = 0;
                rank[i] = pos[i];
            }
            sizes[0] = n;
        } else if (nb <= 4) {
            int64_t t[3], g[3];
            for (int k = 0; k < 3; k++) t[k] = k < nth ? th[k] : (int64_t)mask + 1;
            ds_ranks3b_2(-1, old, mask, (int32_t)t[0], (int32_t)t[1], (int32_t)t[2], pos, 0, m, 0, n, 0, 0, 0, rank,
                         bucket, g);
            int64_t G[5] = {n, g[0], g[1], g[2], 0};
            for (int b = 0; b < nb; b++) sizes[b] = G[b] - G[b + 1];
        } else { /* more than four buckets: class -> bucket table, one element at a time */
            int64_t *lut = counts; /* the counts are no longer needed */
            int64_t running[17];
            memset(running, 0, sizeof(running));
            for (int64_t c = 0, b = 0; c < nclass; c++) {
                while (b < nth && (c << shift) >= th[b]) b++;
                lut[c] = b;
            }
            int64_t j = 0;
            for (int64_t i = 0; i < n; i++) {
                int64_t b = lut[(old[i] & mask) >> shift];
                if (j < m && pos[j] == i) {
                    rank[j] = running[b];
                    bucket[j] = b;
                    j++;
                }
                running[b]++;
            }
            for (int b = 0; b < nb; b++) sizes[b] = running[b];
        }
        dsc_h(h, (uint64_t)nb);
        for (int64_t k = 0; k < nth; k++) dsc_h(h, (uint64_t)th[k]);
        if (dsc_code_tensor(m, bucket, rank, d, nb, sizes, h, U, R, scratch, comp, hist)) goto done;
        dsc_flush(U);
        dsc_flush(R);
        dsc_h(h, (uint64_t)U->at);
        dsc_h(h, (uint64_t)R->at);
        status = 0;
    }
done:
    free(counts);
    free(work);
    free(comp);
    free(dp);
    free(dpi);
    return status;
}

/* --- decoding ----------------------------------------------------------------------------------------------
   A bit reader over one stream: MSB first, every read checked against the stream's end. The next bits wait
   left-aligned in a 64-bit cache (`cache`, `have` of them valid, zeros below), refilled a byte at a time. */
typedef struct {
    const uint8_t *buf;
    int64_t nbits; /* bits in the stream */
    int64_t at;    /* bits consumed */
    int64_t next;  /* the next byte to bring into the cache */
    uint64_t cache;
    int have;
} dsc_reader;

static inline void dsc_reader_init(dsc_reader *r, const uint8_t *buf, int64_t nbytes) {
    r->buf = buf;
    r->nbits = nbytes * 8;
    r->at = 0;
    r->next = 0;
    r->cache = 0;
    r->have = 0;
}

/* at least 57 valid bits in the cache, or every bit left */
static inline void dsc_fill(dsc_reader *r) {
    int64_t nbytes = r->nbits >> 3;
    if (r->have <= 56 && r->next + 8 <= nbytes) { /* a whole word at once */
        uint64_t w;
        memcpy(&w, r->buf + r->next, 8);
        w = __builtin_bswap64(w);
        int take = (64 - r->have) >> 3; /* whole bytes that fit */
        r->cache |= (take == 8 ? w : w >> (8 * (8 - take))) << (8 * (8 - take) - r->have);
        r->have += 8 * take;
        r->next += take;
        return;
    }
    while (r->have <= 56 && r->next < nbytes) {
        r->cache |= (uint64_t)r->buf[r->next++] << (56 - r->have);
        r->have += 8;
    }
}

/* width bits (0..64) into *v; 0 when the stream ends first */
static inline int dsc_get(dsc_reader *r, int width, uint64_t *v) {
    if (width < 0 || width > 64 || r->at + width > r->nbits) return 0;
    if (width == 0) {
        *v = 0;
        return 1;
    }
    if (width > 56) { /* in two pieces */
        uint64_t hi = 0, lo = 0; /* both set: the check above covers the two reads */
        dsc_get(r, width - 32, &hi);
        dsc_get(r, 32, &lo);
        *v = (hi << 32) | lo;
        return 1;
    }
    if (r->have < width) dsc_fill(r);
    *v = r->cache >> (64 - width);
    r->cache <<= width;
    r->have -= width;
    r->at += width;
    return 1;
}

/* the zeros before the next one bit, and past it; 0 when the stream ends first */
static inline int dsc_get_unary(dsc_reader *r, uint64_t *q) {
    uint64_t zeros = 0;
    for (;;) {
        if (r->have == 0) {
            dsc_fill(r);
            if (r->have == 0) return 0;
        }
        if (r->cache) {
            int z = __builtin_clzll(r->cache);
            if (z < r->have) {
                if (r->at + z >= r->nbits) return 0;
                zeros += (uint64_t)z;
                r->cache <<= z;
                r->cache <<= 1;
                r->have -= z + 1;
                r->at += z + 1;
                *q = zeros;
                return 1;
            }
        }
        zeros += (uint64_t)r->have; /* every cached bit is a zero */
        r->at += r->have;
        r->cache = 0;
        r->have = 0;
    }
}

/* one value of kind code (k * 4 + kind): 0 on a short stream or a field wider than 64 bits */
static inline int dsc_get_value(dsc_reader *U, dsc_reader *R, int kind, int k, uint64_t *v) {
    uint64_t q, r;
    if (kind == DSC_RICE) {
        if (!dsc_get_unary(U, &q) || !dsc_get(R, k, &r)) return 0;
        *v = (k >= 64 ? 0 : q << k) | r;
        return 1;
    }
    if (kind == DSC_EG) {
        if (!dsc_get_unary(U, &q)) return 0;
        if (q > 64 || (int64_t)q + k > 64) return 0;
        int L = (int)q + k;
        if (!dsc_get(R, L, &r)) return 0;
        *v = ((L >= 64 ? 0 : (uint64_t)1 << L) + r) - (k >= 64 ? 0 : (uint64_t)1 << k);
        return 1;
    }
    return dsc_get(R, k, v);
}

enum {
    DSC_OK = 0,
    DSC_E_STREAM = 1,   /* a stream ends inside a value, or a field is wider than 64 bits */
    DSC_E_UNIVERSE = 2, /* a subset member or gap beyond its universe, or a count above it */
    DSC_E_COUNT = 3,    /* a subset decodes to another count than its header says */
    DSC_E_RANKS = 4,    /* ranks beyond their buckets */
    DSC_E_RANGE = 5,    /* a decoded value out of range for the dtype */
    DSC_E_LENGTH = 6,   /* a stream longer than what it holds */
    DSC_E_MEMORY = 7
};

/* a subset of [0, n) (count c, mode, kind code) read from the streams: its members, increasing, to out (room
   for c); flags (when not NULL, n entries, zeroed by the caller) get a 1 at each member instead. */
static int dsc_read_subset(dsc_reader *U, dsc_reader *R, int64_t c, int64_t mode, int64_t code, int64_t n,
                           int64_t *out, uint8_t *flags) {
    int kind = (int)(code & 3), k = (int)(code >> 2);
    if (c < 0 || c > n) return DSC_E_UNIVERSE;
    if (c == 0) return DSC_OK;
    if (mode == DSC_NONE) {
        if (c != n) return DSC_E_UNIVERSE;
        for (int64_t i = 0; i < n; i++) {
            if (flags) flags[i] = 1;
            else out[i] = i;
        }
        return DSC_OK;
    }
    if (mode == DSC_BITMAP) {
        int64_t got = 0;
        for (int64_t i = 0; i < n; i++) {
            uint64_t bit;
            if (!dsc_get(R, 1, &bit)) return DSC_E_STREAM;
            if (bit) {
                if (got == c) return DSC_E_COUNT;
                if (flags) flags[i] = 1;
                else out[got] = i;
                got++;
            }
        }
        return got == c ? DSC_OK : DSC_E_COUNT;
    }
    if (mode == DSC_DIRECT) {
        int64_t prev = -1;
        for (int64_t i = 0; i < c; i++) {
            uint64_t g;
            if (!dsc_get_value(U, R, kind, k, &g)) return DSC_E_STREAM;
            if (g >= (uint64_t)n || prev + 1 + (int64_t)g >= n) return DSC_E_UNIVERSE;
            prev += 1 + (int64_t)g;
            if (flags) flags[prev] = 1;
            else out[i] = prev;
        }
        return DSC_OK;
    }
    if (mode == DSC_COMPLEMENT) { /* the gaps of the n - c non-members */
        int64_t prev = -1, got = 0;
        for (int64_t i = 0; i < n - c; i++) {
            uint64_t g;
            if (!dsc_get_value(U, R, kind, k, &g)) return DSC_E_STREAM;
            if (g >= (uint64_t)n || prev + 1 + (int64_t)g >= n) return DSC_E_UNIVERSE;
            int64_t x = prev + 1 + (int64_t)g;
            for (int64_t y = prev + 1; y < x; y++) { /* the members between two non-members */
                if (got == c) return DSC_E_COUNT;
                if (flags) flags[y] = 1;
                else out[got] = y;
                got++;
            }
            prev = x;
        }
        for (int64_t y = prev + 1; y < n; y++) {
            if (got == c) return DSC_E_COUNT;
            if (flags) flags[y] = 1;
            else out[got] = y;
            got++;
        }
        return got == c ? DSC_OK : DSC_E_COUNT;
    }
    return DSC_E_UNIVERSE;
}

/* One 16-bit float tensor decoded: old (n elements), shift (7 bf16, 10 fp16), thresholds th[0..nth), plan: per
   bucket 10 integers (POS count, mode, kind; BIG count, mode, kind; NEG count, mode, kind; MAG kind or -1), the
   U and R streams (their exact lengths). Writes the m = sum of POS counts changed positions (increasing) and
   their new bits; returns a DSC_E_* status. */
static int dsc_decode16_read(const uint16_t *old, int64_t n, int shift, int64_t nth, const int64_t *th,
                             const int64_t *plan, const uint8_t *ubuf, int64_t ulen, const uint8_t *rbuf,
                             int64_t rlen, int64_t m, int64_t *out_pos, uint16_t *out_bits);

/* dsc_decode16_read, then, with write_to (the memory of old itself) and out_old, the new bits written there,
   the old ones kept in out_old: only once the whole tensor decoded, so a corrupt one is left untouched */
static int dsc_decode16(const uint16_t *old, int64_t n, int shift, int64_t nth, const int64_t *th,
                        const int64_t *plan, const uint8_t *ubuf, int64_t ulen, const uint8_t *rbuf, int64_t rlen,
                        int64_t m, int64_t *out_pos, uint16_t *out_bits, uint16_t *write_to, uint16_t *out_old) {
    int status = dsc_decode16_read(old, n, shift, nth, th, plan, ubuf, ulen, rbuf, rlen, m, out_pos, out_bits);
    if (status == DSC_OK && write_to) {
        for (int64_t i = 0; i < m; i++) {
            out_old[i] = write_to[out_pos[i]];
            write_to[out_pos[i]] = out_bits[i];
        }
    }
    return status;
}

static int dsc_decode16_read(const uint16_t *old, int64_t n, int shift, int64_t nth, const int64_t *th,
                             const int64_t *plan, const uint8_t *ubuf, int64_t ulen, const uint8_t *rbuf,
                             int64_t rlen, int64_t m, int64_t *out_pos, uint16_t *out_bits) {
    const int32_t mask = 0x7FFF;
    int nb = (int)nth + 1, status = DSC_OK;
    int64_t sizes[17], off[17];
    dsc_reader U, R;
    dsc_reader_init(&U, ubuf, ulen);
    dsc_reader_init(&R, rbuf, rlen);
    int64_t *ranks = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * m + 1));
    int64_t *d = ranks ? ranks + m : NULL;
    int64_t *src = (int64_t *)malloc(sizeof(int64_t) * (size_t)(m + 1));
    uint8_t *flags = (uint8_t *)malloc((size_t)(2 * m + 2));
    int64_t *lut = NULL;
    if (!ranks || !src || !flags) { status = DSC_E_MEMORY; goto done; }
    /* the buckets' sizes: one counting pass */
    if (nth == 0) {
        sizes[0] = n;
    } else if (nb <= 4) {
        int64_t t[3], g[3];
        for (int k = 0; k < 3; k++) t[k] = k < nth ? th[k] : (int64_t)mask + 1;
        ds_ranks3b_2(-1, old, mask, (int32_t)t[0], (int32_t)t[1], (int32_t)t[2], NULL, 0, 0, 0, n, 0, 0, 0, NULL,
                     NULL, g);
        int64_t G[5] = {n, g[0], g[1], g[2], 0};
        for (int b = 0; b < nb; b++) sizes[b] = G[b] - G[b + 1];
    } else {
        int64_t nclass = ((int64_t)mask >> shift) + 1;
        lut = (int64_t *)malloc(sizeof(int64_t) * (size_t)nclass);
        if (!lut) { status = DSC_E_MEMORY; goto done; }
        for (int64_t c = 0, b = 0; c < nclass; c++) {
            while (b < nth && (c << shift) >= th[b]) b++;
            lut[c] = b;
        }
        memset(sizes, 0, sizeof(sizes));
        for (int64_t i = 0; i < n; i++) sizes[lut[(old[i] & mask) >> shift]]++;
    }
    /* every bucket's sequences, in header order: ranks (POS), then each change's step */
    int64_t at = 0;
    for (int b = 0; b < nb; b++) {
        const int64_t *pl = plan + 10 * b;
        int64_t c = pl[0];
        off[b] = at;
        if (c == 0) continue;
        if (c > sizes[b] || at + c > m) { status = DSC_E_UNIVERSE; goto done; }
        if ((status = dsc_read_subset(&U, &R, c, pl[1], pl[2], sizes[b], ranks + at, NULL))) goto done;
        uint8_t *big = flags, *neg = flags + c;
        memset(flags, 0, (size_t)(2 * c));
        if ((status = dsc_read_subset(&U, &R, pl[3], pl[4], pl[5], c, NULL, big))) goto done;
        if ((status = dsc_read_subset(&U, &R, pl[6], pl[7], pl[8], c, NULL, neg))) goto done;
        for (int64_t i = 0; i < c; i++) {
            uint64_t a = 1;
            if (big[i]) {
                if (pl[9] < 0 || !dsc_get_value(&U, &R, (int)(pl[9] & 3), (int)(pl[9] >> 2), &a)) {
                    status = DSC_E_STREAM;
                    goto done;
                }
                if (a > 65536) { status = DSC_E_RANGE; goto done; } /* past any 16-bit step */
                a += 2;
            }
            d[at + i] = neg[i] ? -(int64_t)a : (int64_t)a;
        }
        at += c;
    }
    off[nb] = at;
    if (at != m) { status = DSC_E_COUNT; goto done; }
    if ((U.at + 7) / 8 != ulen || (R.at + 7) / 8 != rlen) { status = DSC_E_LENGTH; goto done; }
    /* ranks to positions: one select pass (or the ranks are the positions) */
    if (nth == 0) {
        for (int64_t i = 0; i < m; i++) {
            out_pos[i] = ranks[i];
            src[i] = i;
        }
    } else if (nb <= 4) {
        int64_t t[3], lo[4] = {0, 0, 0, 0}, hi[4], offs[4];
        for (int k = 0; k < 3; k++) t[k] = k < nth ? th[k] : (int64_t)mask + 1;
        for (int b = 0; b < 4; b++) {
            offs[b] = b < nb ? off[b] : m;
            hi[b] = b < nb ? off[b + 1] - off[b] : 0;
        }
        int bad = 0;
        if (ds_select3b_2(-1, old, mask, (int32_t)t[0], (int32_t)t[1], (int32_t)t[2], 0, n, ranks, offs, lo, hi, 0,
                          0, 0, 0, out_pos, src, d, out_bits, &bad)) {
            status = DSC_E_RANKS;
            goto done;
        }
        status = bad ? DSC_E_RANGE : DSC_OK; /* the new bits were made as each position was found */
        goto done;
    } else {
        int64_t ptr[17], running[17], o = 0;
        memset(running, 0, sizeof(running));
        for (int b = 0; b < nb; b++) ptr[b] = off[b];
        for (int64_t i = 0; i < n && o < m; i++) {
            int64_t b = lut[(old[i] & mask) >> shift];
            if (ptr[b] < off[b + 1] && ranks[ptr[b]] == running[b]) {
                out_pos[o] = i;
                src[o++] = ptr[b]++;
            }
            running[b]++;
        }
        if (o != m) { status = DSC_E_RANKS; goto done; }
    }
    /* the new bits: the ordered old value plus the step, back to bits */
    for (int64_t i = 0; i < m; i++) {
        int64_t o = dsc_ordered16(old[out_pos[i]]) + d[src[i]];
        if (o < -32768 || o > 32767) { status = DSC_E_RANGE; goto done; }
        out_bits[i] = (uint16_t)(o < 0 ? ((~o) | 0x8000) : o);
    }
done:
    free(ranks);
    free(src);
    free(flags);
    free(lut);
    return status;
}

#endif
