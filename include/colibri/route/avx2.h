/*
 * route.h's primitives and block kernel on AVX2, 8 lanes, for GCC and Clang on x86-64 (each
 * function compiled for the target, so the build itself needs no -mavx2), taken per call
 * where the router allows it (router.use_avx2: colibri_cpu_has_avx2()). No FMA, so that
 * every lane rounds as the SSE2 and scalar code do; the last elements of a row go through
 * the SSE2 code. colibri_rank and colibri_has_nan stay the base's (route/dispatch.h).
 */
#ifndef COLIBRI_ROUTE_AVX2_H
#define COLIBRI_ROUTE_AVX2_H

#ifndef COLIBRI_ROUTE_H
#error "include colibri/route.h, not its parts"
#endif

#include <immintrin.h>

#define COLIBRI_AVX2_FN __attribute__((target("avx2")))

/* merged top two of lane pairs (lo, hi) picked from two rows' registers by a shuffle */
#define COLIBRI_FOLD(max, min, shuffle, a1, b1, a2, b2, ilo, ihi, oa, ob)        \
    do {                                                                         \
        __typeof__(a1) lo_ = shuffle(a1, a2, ilo), hi_ = shuffle(a1, a2, ihi);   \
        __typeof__(a1) blo_ = shuffle(b1, b2, ilo), bhi_ = shuffle(b1, b2, ihi); \
        ob = max(min(lo_, hi_), max(blo_, bhi_));                                \
        oa = max(lo_, hi_);                                                      \
    } while (0)

/* colibri_exp and colibri_sigmoid on 8 lanes: colibri_exp_sse2's operations in its order. */
COLIBRI_AVX2_FN static inline __m256 colibri_exp_avx2(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(COLIBRI_EXP_LO));
    x = _mm256_min_ps(x, _mm256_set1_ps(COLIBRI_EXP_HI));
    __m256 magic = _mm256_set1_ps(COLIBRI_ROUND_MAGIC);
    __m256 n =
        _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(COLIBRI_LOG2E)), magic), magic);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(COLIBRI_LN2_HI)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(COLIBRI_LN2_LO)));
    __m256 p = _mm256_set1_ps(COLIBRI_EXP_P5);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(COLIBRI_EXP_P4));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(COLIBRI_EXP_P3));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(COLIBRI_EXP_P2));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(COLIBRI_EXP_P1));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(COLIBRI_EXP_P0));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r),
                      _mm256_set1_ps(1.0f));
    __m256i ni = _mm256_cvttps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1);
    __m256i n2 = _mm256_sub_epi32(ni, n1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

COLIBRI_AVX2_FN static inline __m256 colibri_sigmoid_avx2(__m256 x)
{
    __m256 z = colibri_exp_avx2(_mm256_or_ps(x, _mm256_set1_ps(-0.0f))); /* exp(-|x|) */
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 is_pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    return _mm256_div_ps(_mm256_blendv_ps(z, one, is_pos), _mm256_add_ps(one, z));
}

/* colibri_sigmoid_keys, 8 logits at a time; the SSE2 code takes the last E mod 8. */
COLIBRI_AVX2_FN static inline int colibri_sigmoid_keys_avx2(const float *x, int32_t E,
                                                            const float *bias, int on_logits,
                                                            float *scores, float *keys)
{
    int32_t e = 0;
    __m256 unordered = _mm256_setzero_ps();
    for (; e + 8 <= E; e += 8) {
        __m256 v = _mm256_loadu_ps(x + e);
        __m256 s = colibri_sigmoid_avx2(v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        _mm256_storeu_ps(scores + e, s);
        if (bias != NULL)
            _mm256_storeu_ps(keys + e, _mm256_add_ps(on_logits ? v : s, _mm256_loadu_ps(bias + e)));
    }
    return (_mm256_movemask_ps(unordered) != 0)
           | colibri_sigmoid_keys(x + e, E - e, bias != NULL ? bias + e : NULL, on_logits,
                                  scores + e, keys + e);
}

/* colibri_exp_shifted with 8-lane exponentials, summed as the SSE2 code sums them: one
 * 4-lane accumulator taking each vector's low half, then its high half. */
COLIBRI_AVX2_FN static inline float colibri_exp_shifted_avx2(const float *x, float m, float *out,
                                                             int32_t E)
{
    int32_t e = 0;
    float sum, lanes[4];
    __m256 mm = _mm256_set1_ps(m);
    __m128 acc = _mm_setzero_ps();
    for (; e + 8 <= E; e += 8) {
        __m256 v = colibri_exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + e), mm));
        _mm256_storeu_ps(out + e, v);
        acc = _mm_add_ps(acc, _mm256_castps256_ps128(v));
        acc = _mm_add_ps(acc, _mm256_extractf128_ps(v, 1));
    }
    if (e + 4 <= E) {
        __m128 v = colibri_exp_sse2(_mm_sub_ps(_mm_loadu_ps(x + e), _mm_set1_ps(m)));
        _mm_storeu_ps(out + e, v);
        acc = _mm_add_ps(acc, v);
        e += 4;
    }
    _mm_storeu_ps(lanes, acc);
    sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; e < E; e++) {
        out[e] = colibri_exp(x[e] - m);
        sum += out[e];
    }
    return sum;
}

/* scores = sqrt(softplus(x)) with the exponentials 8 at a time (log1pf stays libm's). */
COLIBRI_AVX2_FN static inline void colibri_sqrtsoftplus_row_avx2(const float *x, int32_t E,
                                                                 float *scores)
{
    int32_t e = 0;
    for (; e + 8 <= E; e += 8)
        _mm256_storeu_ps(scores + e, colibri_exp_avx2(_mm256_loadu_ps(x + e)));
    for (e = 0; e < E; e++) {
        float ex = e < (E & ~7) ? scores[e] : colibri_exp(x[e]);
        scores[e] = sqrtf(x[e] > 20.0f ? x[e] : log1pf(ex));
    }
}

/* colibri_top2_values on 8 lanes (two sets of lanes, as the SSE2 code), E >= 16. */
COLIBRI_AVX2_FN static inline int colibri_top2_values_avx2(const float *x, int32_t E, float *first,
                                                           float *second)
{
    int32_t e = 0;
    float m1, m2;
    __m256 a = _mm256_set1_ps(-INFINITY), b = a, a2 = a, b2 = a;
    __m256 unordered = _mm256_setzero_ps();
    for (; e + 16 <= E; e += 16) {
        __m256 v = _mm256_loadu_ps(x + e), w = _mm256_loadu_ps(x + e + 8);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, w, _CMP_UNORD_Q));
        b = _mm256_max_ps(_mm256_min_ps(v, a), b);
        a = _mm256_max_ps(v, a);
        b2 = _mm256_max_ps(_mm256_min_ps(w, a2), b2);
        a2 = _mm256_max_ps(w, a2);
    }
    if (e + 8 <= E) {
        __m256 v = _mm256_loadu_ps(x + e);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        b = _mm256_max_ps(_mm256_min_ps(v, a), b);
        a = _mm256_max_ps(v, a);
        e += 8;
    }
    b = _mm256_max_ps(_mm256_min_ps(a, a2), _mm256_max_ps(b, b2));
    a = _mm256_max_ps(a, a2);
    {
        /* the two halves, then lane pairs twice */
        __m128 lo = _mm256_castps256_ps128(a), hi = _mm256_extractf128_ps(a, 1);
        __m128 blo = _mm256_castps256_ps128(b), bhi = _mm256_extractf128_ps(b, 1);
        __m128 s = _mm_max_ps(_mm_min_ps(lo, hi), _mm_max_ps(blo, bhi));
        __m128 f = _mm_max_ps(lo, hi), f2, s2;
        f2 = _mm_shuffle_ps(f, f, _MM_SHUFFLE(1, 0, 3, 2));
        s2 = _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2));
        s = _mm_max_ps(_mm_min_ps(f, f2), _mm_max_ps(s, s2));
        f = _mm_max_ps(f, f2);
        f2 = _mm_shuffle_ps(f, f, _MM_SHUFFLE(2, 3, 0, 1));
        s2 = _mm_shuffle_ps(s, s, _MM_SHUFFLE(2, 3, 0, 1));
        s = _mm_max_ps(_mm_min_ps(f, f2), _mm_max_ps(s, s2));
        f = _mm_max_ps(f, f2);
        m1 = _mm_cvtss_f32(f);
        m2 = _mm_cvtss_f32(s);
    }
    int nan = _mm256_movemask_ps(unordered);
    nan |= colibri_top2_values_from(x, e, E, &m1, &m2);
    *first = m1;
    *second = m2;
    return nan;
}

/* colibri_top2_ids with 8-lane equality masks. */
COLIBRI_AVX2_FN static inline void colibri_top2_ids_avx2(const float *x, int32_t E, float m1,
                                                         float m2, int32_t *ids)
{
    const __m256 v1 = _mm256_set1_ps(m1), v2 = _mm256_set1_ps(m2);
    int32_t base, e, i1 = -1, i2 = -1;
    for (base = 0; base < E; base += 64) {
        const float *span = x + base;
        int32_t n = E - base < 64 ? E - base : 64;
        uint64_t k1 = 0, k2 = 0;
        for (e = 0; e + 8 <= n; e += 8) {
            __m256 v = _mm256_loadu_ps(span + e);
            k1 |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, v1, _CMP_EQ_OQ)) << e;
            k2 |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, v2, _CMP_EQ_OQ)) << e;
        }
        colibri_span_masks_from(span, e, n, m1, m2, &k1, &k2);
        if (colibri_top2_claim(k1, k2, base, &i1, &i2))
            break;
    }
    ids[0] = i1;
    ids[1] = i2;
}

/* colibri_lane_bound on 8 lanes, E >= 16: for k <= 8 the smallest lane maximum (8 distinct
 * elements reach it), a tighter bound than 4 lanes give; the same candidates survive
 * selection, so the same answers. */
COLIBRI_AVX2_FN static inline float colibri_lane_bound_avx2(const float *x, int32_t E, int32_t k,
                                                            int *nan)
{
    int32_t e = 0;
    __m256 a = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    (void)k; /* k <= COLIBRI_BOUND_MAX_K = 8 */
    for (; e + 8 <= E; e += 8) {
        __m256 v = _mm256_loadu_ps(x + e);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        a = _mm256_max_ps(v, a);
    }
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_min_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_min_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    *nan |= _mm256_movemask_ps(unordered);
    for (; e < E; e++)
        *nan |= x[e] != x[e];
    return _mm_cvtss_f32(m);
}

/* colibri_compact comparing 8 keys at a time (each half's ids stored by the 4-lane table). */
COLIBRI_AVX2_FN static inline int32_t colibri_compact_avx2(const float *x, int32_t first,
                                                           int32_t last, float bound, int32_t *cand,
                                                           int32_t c)
{
    static const int32_t lanes[16][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0},
                                         {2, 0, 0, 0}, {0, 2, 0, 0}, {1, 2, 0, 0}, {0, 1, 2, 0},
                                         {3, 0, 0, 0}, {0, 3, 0, 0}, {1, 3, 0, 0}, {0, 1, 3, 0},
                                         {2, 3, 0, 0}, {0, 2, 3, 0}, {1, 2, 3, 0}, {0, 1, 2, 3}};
    static const signed char count[16] = {0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4};
    int32_t e = first;
    __m256 b = _mm256_set1_ps(bound);
    for (; e + 8 <= last; e += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + e), b, _CMP_GE_OQ));
        int lo = mask & 15, hi = mask >> 4;
        _mm_storeu_si128(
            (__m128i *)(cand + c),
            _mm_add_epi32(_mm_loadu_si128((const __m128i *)lanes[lo]), _mm_set1_epi32(e)));
        c += count[lo];
        _mm_storeu_si128(
            (__m128i *)(cand + c),
            _mm_add_epi32(_mm_loadu_si128((const __m128i *)lanes[hi]), _mm_set1_epi32(e + 4)));
        c += count[hi];
    }
    return colibri_compact(x, e, last, bound, cand, c);
}

/* The block path (route/rows.h) on 8 rows: each row's best two per lane, the rows' lanes
 * folded pairwise (COLIBRI_FOLD), ids from equality masks, one exponential for the block's
 * weights. Returns COLIBRI_OK, COLIBRI_ROW_NAN (route the rows one by one to name it), or -1
 * when a row's best logit is infinite (colibri_route_rows8 takes such blocks). */
COLIBRI_AVX2_FN static inline int colibri_route_block_avx2(const colibri_router_t *r,
                                                           const float *x, int64_t stride,
                                                           int32_t *ids, float *weights)
{
    const int32_t E = r->num_experts;
    const __m256 none = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(E % 8), lane);
    __m256 a[8], b[8], unordered = _mm256_setzero_ps();
    float first[8], second[8];
    int32_t i, e;
    for (i = 0; i < 8; i++) {
        const float *row = x + i * stride;
        __m256 ai = none, bi = none, v;
        for (e = 0; e + 8 <= E; e += 8) {
            v = _mm256_loadu_ps(row + e);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            bi = _mm256_max_ps(_mm256_min_ps(v, ai), bi);
            ai = _mm256_max_ps(v, ai);
        }
        if (e < E) { /* the last E mod 8, the other lanes -inf */
            v = _mm256_blendv_ps(none, _mm256_maskload_ps(row + e, tail),
                                 _mm256_castsi256_ps(tail));
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            bi = _mm256_max_ps(_mm256_min_ps(v, ai), bi);
            ai = _mm256_max_ps(v, ai);
        }
        a[i] = ai;
        b[i] = bi;
    }
    if (_mm256_movemask_ps(unordered))
        return COLIBRI_ROW_NAN;
    for (i = 0; i < 4; i++)
        COLIBRI_FOLD(_mm256_max_ps, _mm256_min_ps, _mm256_permute2f128_ps, a[2 * i], b[2 * i],
                     a[2 * i + 1], b[2 * i + 1], 0x20, 0x31, a[i], b[i]);
    for (i = 0; i < 2; i++)
        COLIBRI_FOLD(_mm256_max_ps, _mm256_min_ps, _mm256_shuffle_ps, a[2 * i], b[2 * i],
                     a[2 * i + 1], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0), _MM_SHUFFLE(3, 2, 3, 2),
                     a[i], b[i]);
    COLIBRI_FOLD(_mm256_max_ps, _mm256_min_ps, _mm256_shuffle_ps, a[0], b[0], a[1], b[1],
                 _MM_SHUFFLE(2, 0, 2, 0), _MM_SHUFFLE(3, 1, 3, 1), a[0], b[0]);
    /* lane j holds row (0 2 4 6 1 3 5 7)[j] */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 m1 = _mm256_permutevar8x32_ps(a[0], order), m2 = _mm256_permutevar8x32_ps(b[0], order);
    if (_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(m1, none, _CMP_GT_OQ),
                                         _mm256_cmp_ps(m1, _mm256_set1_ps(INFINITY), _CMP_LT_OQ)))
        != 0xff)
        return -1;
    _mm256_storeu_ps(first, m1);
    _mm256_storeu_ps(second, m2);
    for (i = 0; i < 8; i++)
        colibri_top2_ids_avx2(x + i * stride, E, first[i], second[i], ids + 2 * i);
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 ex = colibri_exp_avx2(_mm256_sub_ps(m2, m1));
    __m256 sum = _mm256_add_ps(_mm256_add_ps(one, ex), _mm256_set1_ps(r->norm_eps));
    __m256 w0 = _mm256_div_ps(one, sum), w1 = _mm256_div_ps(ex, sum);
    __m256 lo = _mm256_unpacklo_ps(w0, w1), hi = _mm256_unpackhi_ps(w0, w1);
    _mm256_storeu_ps(weights, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(weights + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    for (i = 0; i < 16; i++) { /* as colibri_route_rows8: a *= expert_scale[id], a *= scale */
        if (r->expert_scale != NULL)
            weights[i] *= r->expert_scale[ids[i]];
        weights[i] *= r->scale;
    }
    return COLIBRI_OK;
}

#endif /* COLIBRI_ROUTE_AVX2_H */
