/*
 * route.h in plain C: the scalar helpers every instruction set shares (the exponential,
 * top-k order, the candidates' ranks), and every primitive as *_generic. Where the build's
 * base has no version of a primitive, the generic one takes its name (route/fallback.h);
 * the NEON code falls back to these at run time under COLIBRI_SIMD=scalar.
 *
 * The SIMD versions do the same IEEE operations in the same order (a row's result never
 * depends on where an expert falls in a vector), and where a plain-C primitive sums lanes
 * it sums them in the 4-lane code's order: every path gives the same bits.
 */
#ifndef COLIBRI_ROUTE_GENERIC_H
#define COLIBRI_ROUTE_GENERIC_H

#ifndef COLIBRI_ROUTE_H
#error "include colibri/route.h, not its parts"
#endif

#if defined(_MSC_VER)
#include <intrin.h>
#endif

/* Top-k for k <= this runs on candidates above a bound taken from each SIMD lane's best
 * two; exact ranks are counted among at most COLIBRI_RANK_MAX candidates. */
#define COLIBRI_BOUND_MAX_K 8
#define COLIBRI_RANK_MAX 32

/* exp(x) in float32 without libm, max relative error ~2e-7 (Cephes' polynomial, range
 * reduction by ln 2, exact two-step scaling so subnormal results round once). The SIMD
 * versions run the same IEEE operations in the same order, so every lane and the scalar
 * tail agree bit for bit. */
#define COLIBRI_EXP_LO (-104.0f)        /* exp below is 0 in float32 */
#define COLIBRI_EXP_HI 88.8f            /* exp above is inf */
#define COLIBRI_ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: adding it rounds to an integer */
/* shared by every version, which must agree bit for bit */
#define COLIBRI_LOG2E 1.44269504088896341f
#define COLIBRI_LN2_HI 0.693359375f /* ln 2 = LN2_HI + LN2_LO; n * LN2_HI is exact */
#define COLIBRI_LN2_LO (-2.12194440e-4f)
#define COLIBRI_EXP_P5 1.9875691500e-4f
#define COLIBRI_EXP_P4 1.3981999507e-3f
#define COLIBRI_EXP_P3 8.3334519073e-3f
#define COLIBRI_EXP_P2 4.1665795894e-2f
#define COLIBRI_EXP_P1 1.6666665459e-1f
#define COLIBRI_EXP_P0 5.0000001201e-1f

static inline float colibri_exp(float x)
{
    x = x < COLIBRI_EXP_LO ? COLIBRI_EXP_LO : x;
    x = x > COLIBRI_EXP_HI ? COLIBRI_EXP_HI : x;
    float n = (x * COLIBRI_LOG2E + COLIBRI_ROUND_MAGIC) - COLIBRI_ROUND_MAGIC;
    float r = x - n * COLIBRI_LN2_HI;
    r = r - n * COLIBRI_LN2_LO;
    float p = COLIBRI_EXP_P5;
    p = p * r + COLIBRI_EXP_P4;
    p = p * r + COLIBRI_EXP_P3;
    p = p * r + COLIBRI_EXP_P2;
    p = p * r + COLIBRI_EXP_P1;
    p = p * r + COLIBRI_EXP_P0;
    p = (p * (r * r) + r) + 1.0f;
    int32_t ni = (int32_t)n, n1 = ni >> 1, n2 = ni - n1;
    return p * colibri_bits_to_float((uint32_t)(n1 + 127) << 23)
           * colibri_bits_to_float((uint32_t)(n2 + 127) << 23);
}

static inline float colibri_sigmoid(float x)
{
    float z = colibri_exp(-fabsf(x));
    return x >= 0.0f ? 1.0f / (1.0f + z) : z / (1.0f + z);
}

static inline float colibri_sqrtsoftplus(float x)
{
    /* softplus as torch computes it: x above 20, log1p(exp(x)) below */
    return sqrtf(x > 20.0f ? x : log1pf(colibri_exp(x)));
}

/* Whether (v, i) comes before (w, j) in top-k order: the larger key, equal keys to the
 * lower id; NaN (a group score of inf + -inf) after every number, as numpy sorts it. */
static inline int colibri_before(float v, int32_t i, float w, int32_t j)
{
    if (v > w)
        return 1;
    if (v == w)
        return i < j;
    return v != v ? w != w && i < j : w != w; /* v < w, or unordered */
}

/* Insert (v, i) into the list (vals, ids) of length *n <= cap, kept in top-k order. */
static inline void colibri_push(float *vals, int32_t *ids, int32_t *n, int32_t cap, float v,
                                int32_t i)
{
    int32_t j = *n;
    if (j == cap) {
        if (!colibri_before(v, i, vals[cap - 1], ids[cap - 1]))
            return;
        j = cap - 1;
    } else {
        *n = j + 1;
    }
    while (j > 0 && colibri_before(v, i, vals[j - 1], ids[j - 1])) {
        vals[j] = vals[j - 1];
        ids[j] = ids[j - 1];
        j--;
    }
    vals[j] = v;
    ids[j] = i;
}

/* Index of the lowest set bit of m != 0. */
static inline int32_t colibri_ctz64(uint64_t m)
{
#if defined(__GNUC__) || defined(__clang__)
    return (int32_t)__builtin_ctzll(m);
#elif defined(_MSC_VER) && defined(_M_X64)
    unsigned long i;
    _BitScanForward64(&i, m);
    return (int32_t)i;
#else
    int32_t i = 0;
    for (; !(m & 1); m >>= 1)
        i++;
    return i;
#endif
}

/* One 64-element span's part in finding the top two's ids: k1 and k2 mark its elements
 * equal to m1 and m2 (bit i: element base + i). The first m1 is *i1, the first m2 other
 * than it *i2 (-1 while unknown). Returns 1 once both are known. */
static inline int colibri_top2_claim(uint64_t k1, uint64_t k2, int32_t base, int32_t *i1,
                                     int32_t *i2)
{
    if (*i1 < 0 && k1)
        *i1 = base + colibri_ctz64(k1);
    if (*i1 >= base)
        k2 &= ~((uint64_t)1 << (*i1 - base)); /* *i1 - base < 64: found in this span */
    if (*i2 < 0 && k2)
        *i2 = base + colibri_ctz64(k2);
    return *i1 >= 0 && *i2 >= 0;
}

/* colibri_rank of a NaN candidate i (every version's first step): a NaN comes after the
 * numbers and after the NaNs of lower id. */
static inline int32_t colibri_rank_nan(const float *cv, const int32_t *cand, int32_t c, int32_t i)
{
    int32_t q, rank = 0;
    for (q = 0; q < c; q++)
        rank += cv[q] == cv[q] || cand[q] < cand[i];
    return rank;
}

/* ---- the primitives ---------------------------------------------------------------------- */

static inline void colibri_prefetch_generic(const void *p, size_t n)
{
    (void)p;
    (void)n;
}

/* out[e] = exp(x[e] - m) for e < E; returns the sum (lanes summed in a fixed order: four
 * lanes, then lane pairs, as the 4-lane code sums them). */
static inline float colibri_exp_shifted_generic(const float *x, float m, float *out, int32_t E)
{
    int32_t e = 0, j;
    float sum, lanes[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (; e + 4 <= E; e += 4)
        for (j = 0; j < 4; j++) {
            out[e + j] = colibri_exp(x[e + j] - m);
            lanes[j] += out[e + j];
        }
    sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; e < E; e++) {
        out[e] = colibri_exp(x[e] - m);
        sum += out[e];
    }
    return sum;
}

/* out[j] = exp(x[ids[j]] - m) for j < n. */
static inline void colibri_exp_gathered_generic(const float *x, const int32_t *ids, int32_t n,
                                                float m, float *out)
{
    int32_t j;
    for (j = 0; j < n; j++)
        out[j] = colibri_exp(x[ids[j]] - m);
}

/* scores = sqrt(softplus(x)) for e < E. */
static inline void colibri_sqrtsoftplus_row_generic(const float *x, int32_t E, float *scores)
{
    int32_t e;
    for (e = 0; e < E; e++)
        scores[e] = colibri_sqrtsoftplus(x[e]);
}

/* The two largest values of x[0..E), E >= 2, into *first >= *second (equal when tied, -inf
 * when absent); returns nonzero when x holds a NaN. The SIMD versions: each lane keeps its
 * best two, merged at the end: no branch per element. */
/* x[e..E) folded into the best two so far, *m1 >= *m2, element by element (the SIMD paths'
 * tails too); returns whether one of them is a NaN. */
static inline int colibri_top2_values_from(const float *x, int32_t e, int32_t E, float *m1,
                                           float *m2)
{
    int nan = 0;
    float a = *m1, b = *m2;
    for (; e < E; e++) {
        float v = x[e];
        nan |= v != v;
        b = v > b ? (v > a ? a : v) : b;
        a = v > a ? v : a;
    }
    *m1 = a;
    *m2 = b;
    return nan;
}

static inline int colibri_top2_values_generic(const float *x, int32_t E, float *first,
                                              float *second)
{
    *first = -INFINITY;
    *second = -INFINITY;
    return colibri_top2_values_from(x, 0, E, first, second);
}

/* Bits e..n of span's equality masks: bit i of *k1 (*k2) set when span[i] == m1 (m2); the
 * SIMD paths take the tail of a span this way. */
static inline void colibri_span_masks_from(const float *span, int32_t e, int32_t n, float m1,
                                           float m2, uint64_t *k1, uint64_t *k2)
{
    uint64_t a = *k1, b = *k2;
    for (; e < n; e++) {
        a |= (uint64_t)(span[e] == m1) << e;
        b |= (uint64_t)(span[e] == m2) << e;
    }
    *k1 = a;
    *k2 = b;
}

/* The ids of the top two of x[0..E) (no NaN), given their values m1 >= m2: the first
 * occurrence of m1, then the first occurrence of m2 other than that one. Masks of the
 * elements equal to each value, 64 elements at a time: no branch per element. */
static inline void colibri_top2_ids_generic(const float *x, int32_t E, float m1, float m2,
                                            int32_t *ids)
{
    int32_t base, i1 = -1, i2 = -1;
    for (base = 0; base < E; base += 64) {
        int32_t n = E - base < 64 ? E - base : 64;
        uint64_t k1 = 0, k2 = 0;
        colibri_span_masks_from(x + base, 0, n, m1, m2, &k1, &k2);
        if (colibri_top2_claim(k1, k2, base, &i1, &i2))
            break;
    }
    ids[0] = i1;
    ids[1] = i2;
}

/* A bound for top-k, k <= COLIBRI_BOUND_MAX_K: a value that at least k elements of x[0..E)
 * reach (-inf: no lanes here; the SIMD versions take each lane's best two). Sets *nan when
 * x holds a NaN. */
static inline float colibri_lane_bound_generic(const float *x, int32_t E, int32_t k, int *nan)
{
    int32_t e;
    (void)k;
    for (e = 0; e < E; e++)
        *nan |= x[e] != x[e];
    return -INFINITY;
}

/* Append to cand the ids first + e of x[first .. last) with x >= bound; returns the new
 * count. Keys are never NaN here. cand needs 3 spare slots. */
static inline int32_t colibri_compact_generic(const float *x, int32_t first, int32_t last,
                                              float bound, int32_t *cand, int32_t c)
{
    int32_t e;
    for (e = first; e < last; e++) {
        cand[c] = e;
        c += x[e] >= bound;
    }
    return c;
}

/* How many of the candidates (cv, cand)[0..c) come before candidate i (cv padded to whole
 * vectors with NaN, cand with INT32_MAX). */
static inline int32_t colibri_rank_generic(const float *cv, const int32_t *cand, int32_t c,
                                           int32_t i)
{
    int32_t q, rank = 0;
    if (cv[i] != cv[i])
        return colibri_rank_nan(cv, cand, c, i);
    for (q = 0; q < c; q++)
        rank += colibri_before(cv[q], cand[q], cv[i], cand[i]);
    return rank;
}

/* scores = sigmoid(x), keys = scores + bias (x + bias when on_logits; no keys without a
 * bias); returns nonzero when x holds a NaN. */
static inline int colibri_sigmoid_keys_generic(const float *x, int32_t E, const float *bias,
                                               int on_logits, float *scores, float *keys)
{
    int32_t e;
    int nan = 0;
    for (e = 0; e < E; e++) {
        nan |= x[e] != x[e];
        scores[e] = colibri_sigmoid(x[e]);
        if (bias != NULL)
            keys[e] = (on_logits ? x[e] : scores[e]) + bias[e];
    }
    return nan;
}

/* Whether x[0..E) holds a NaN. */
static inline int colibri_has_nan_generic(const float *x, int32_t E)
{
    int32_t e;
    int nan = 0;
    for (e = 0; e < E; e++)
        nan |= x[e] != x[e];
    return nan;
}

/* The renormalised softmax of 8 rows' top two (colibri_weights' operations, the rows'
 * exponentials in vectors): w0 = 1 / sum and w1 = exp(second - first) / sum, with
 * sum = (1 + exp(second - first)) + eps. Returns 1, or 0 when this ISA has no vectors for
 * it: colibri_route_rows8 then takes colibri_weights row by row, the same bits. */
static inline int colibri_top2_softmax8_generic(const float *first, const float *second, float eps,
                                                float *w0, float *w1)
{
    (void)first;
    (void)second;
    (void)eps;
    (void)w0;
    (void)w1;
    return 0;
}

#endif /* COLIBRI_ROUTE_GENERIC_H */
