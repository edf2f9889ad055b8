/*
 * route.h's primitives and block kernel on AVX-512F, 16 lanes, for GCC and Clang on x86-64
 * (each function compiled for the target), taken per call where the router allows it
 * (router.use_avx512: colibri_cpu_has_avx512()). Builds on route/avx2.h (COLIBRI_FOLD):
 * both are compiled under the same condition. The primitives it has no version of take
 * AVX2's or the base's (route/dispatch.h).
 */
#ifndef COLIBRI_ROUTE_AVX512_H
#define COLIBRI_ROUTE_AVX512_H

#ifndef COLIBRI_ROUTE_H
#error "include colibri/route.h, not its parts"
#endif

#include <immintrin.h>

#include "colibri/route/avx2.h"

#define COLIBRI_AVX512_FN __attribute__((target("avx512f")))

/* colibri_exp and colibri_sigmoid on 16 lanes: the 4-lane code's IEEE results bit for bit, in
 * fewer operations (checked for every float in the tests). n is rounded by roundscale, which
 * gives the integer the magic-number add and subtract round to (|n| <= 150 here); the final
 * p * 2^n1 * 2^n2 is scalef's p * 2^n: both scalings are exact but the last, so each result
 * is p * 2^n rounded once (subnormal results included), or inf for both. */
COLIBRI_AVX512_FN static inline __m512 colibri_exp_avx512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(COLIBRI_EXP_LO));
    x = _mm512_min_ps(x, _mm512_set1_ps(COLIBRI_EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(COLIBRI_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(COLIBRI_LN2_HI)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(COLIBRI_LN2_LO)));
    __m512 p = _mm512_set1_ps(COLIBRI_EXP_P5);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(COLIBRI_EXP_P4));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(COLIBRI_EXP_P3));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(COLIBRI_EXP_P2));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(COLIBRI_EXP_P1));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(COLIBRI_EXP_P0));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r),
                      _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

COLIBRI_AVX512_FN static inline __m512 colibri_sigmoid_avx512(__m512 x)
{
    __m512i sign = _mm512_set1_epi32((int32_t)0x80000000);
    __m512 z =
        colibri_exp_avx512(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign)));
    __m512 one = _mm512_set1_ps(1.0f);
    __mmask16 is_pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OS);
    return _mm512_div_ps(_mm512_mask_blend_ps(is_pos, z, one), _mm512_add_ps(one, z));
}

/* colibri_top2_values and colibri_top2_ids on 16 lanes (the tail by masked loads): the same
 * answers. */
#define COLIBRI_MERGE16(a, b, shuffled)                                  \
    do {                                                                 \
        __m512 a2_ = shuffled(a), b2_ = shuffled(b);                     \
        b = _mm512_max_ps(_mm512_min_ps(a, a2_), _mm512_max_ps(b, b2_)); \
        a = _mm512_max_ps(a, a2_);                                       \
    } while (0)
#define COLIBRI_SWAP256(v) _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2))
#define COLIBRI_SWAP128(v) _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1))
#define COLIBRI_SWAP64(v) _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2))
#define COLIBRI_SWAP32(v) _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1))

COLIBRI_AVX512_FN static inline __mmask16 colibri_tail_avx512(int32_t left)
{
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

COLIBRI_AVX512_FN static inline int colibri_top2_values_avx512(const float *x, int32_t E,
                                                               float *first, float *second)
{
    const __m512 none = _mm512_set1_ps(-INFINITY);
    __m512 a = none, b = none;
    __mmask16 unordered = 0;
    int32_t e;
    for (e = 0; e < E; e += 16) {
        __m512 v = _mm512_mask_loadu_ps(none, colibri_tail_avx512(E - e), x + e);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        b = _mm512_max_ps(_mm512_min_ps(v, a), b);
        a = _mm512_max_ps(v, a);
    }
    COLIBRI_MERGE16(a, b, COLIBRI_SWAP256);
    COLIBRI_MERGE16(a, b, COLIBRI_SWAP128);
    COLIBRI_MERGE16(a, b, COLIBRI_SWAP64);
    COLIBRI_MERGE16(a, b, COLIBRI_SWAP32);
    *first = _mm512_cvtss_f32(a);
    *second = _mm512_cvtss_f32(b);
    return unordered != 0;
}

/* Masks of the elements of x[0..n), n <= 64, equal to v1 (*k1) and to v2 (*k2). */
COLIBRI_AVX512_FN static inline void colibri_span_masks_avx512(const float *x, int32_t n, __m512 v1,
                                                               __m512 v2, uint64_t *k1,
                                                               uint64_t *k2)
{
    int32_t e;
    *k1 = *k2 = 0;
    for (e = 0; e < n; e += 16) {
        __mmask16 m = colibri_tail_avx512(n - e);
        __m512 v = _mm512_maskz_loadu_ps(m, x + e);
        *k1 |= (uint64_t)_mm512_mask_cmp_ps_mask(m, v, v1, _CMP_EQ_OQ) << e;
        *k2 |= (uint64_t)_mm512_mask_cmp_ps_mask(m, v, v2, _CMP_EQ_OQ) << e;
    }
}

COLIBRI_AVX512_FN static inline void colibri_top2_ids_avx512(const float *x, int32_t E, float m1,
                                                             float m2, int32_t *ids)
{
    const __m512 v1 = _mm512_set1_ps(m1), v2 = _mm512_set1_ps(m2);
    int32_t base, i1 = -1, i2 = -1;
    for (base = 0; base < E; base += 64) {
        uint64_t k1, k2;
        colibri_span_masks_avx512(x + base, E - base < 64 ? E - base : 64, v1, v2, &k1, &k2);
        if (colibri_top2_claim(k1, k2, base, &i1, &i2))
            break;
    }
    ids[0] = i1;
    ids[1] = i2;
}

/* The top two of 16 sets of 16 lanes (a[i], b[i]: each lane's best and second in set i),
 * folded pairwise: each shuffle step merges two sets' registers into one, so the cross-lane
 * work is shared, not done per set. m1, m2: lane i holds set i's best and second. */
COLIBRI_AVX512_FN static inline void colibri_fold_avx512(__m512 *a, __m512 *b, __m512 *m1,
                                                         __m512 *m2)
{
    int32_t i;
    /* 16 rows x 16 lanes -> 8 registers of 2 rows x 8 lanes -> ... -> 1 of 16 rows x 1 */
    for (i = 0; i < 8; i++)
        COLIBRI_FOLD(_mm512_max_ps, _mm512_min_ps, _mm512_shuffle_f32x4, a[2 * i], b[2 * i],
                     a[2 * i + 1], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0), _MM_SHUFFLE(3, 2, 3, 2),
                     a[i], b[i]);
    for (i = 0; i < 4; i++)
        COLIBRI_FOLD(_mm512_max_ps, _mm512_min_ps, _mm512_shuffle_f32x4, a[2 * i], b[2 * i],
                     a[2 * i + 1], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0), _MM_SHUFFLE(3, 1, 3, 1),
                     a[i], b[i]);
    for (i = 0; i < 2; i++)
        COLIBRI_FOLD(_mm512_max_ps, _mm512_min_ps, _mm512_shuffle_ps, a[2 * i], b[2 * i],
                     a[2 * i + 1], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0), _MM_SHUFFLE(3, 2, 3, 2),
                     a[i], b[i]);
    COLIBRI_FOLD(_mm512_max_ps, _mm512_min_ps, _mm512_shuffle_ps, a[0], b[0], a[1], b[1],
                 _MM_SHUFFLE(2, 0, 2, 0), _MM_SHUFFLE(3, 1, 3, 1), a[0], b[0]);
    /* lane j holds row (0 4 8 12 1 5 9 13 2 6 10 14 3 7 11 15)[j]: back to row order */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    *m1 = _mm512_permutexvar_ps(order, a[0]);
    *m2 = _mm512_permutexvar_ps(order, b[0]);
}

/* colibri_sigmoid_keys, 16 logits at a time (the score pass dominates DeepSeek-V3
 * routing); the SSE2 code takes the last E mod 16. */
COLIBRI_AVX512_FN static inline int colibri_sigmoid_keys_avx512(const float *x, int32_t E,
                                                                const float *bias, int on_logits,
                                                                float *scores, float *keys)
{
    int32_t e = 0;
    __mmask16 unordered = 0;
    for (; e + 16 <= E; e += 16) {
        __m512 v = _mm512_loadu_ps(x + e);
        __m512 s = colibri_sigmoid_avx512(v);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        _mm512_storeu_ps(scores + e, s);
        if (bias != NULL)
            _mm512_storeu_ps(keys + e, _mm512_add_ps(on_logits ? v : s, _mm512_loadu_ps(bias + e)));
    }
    return (unordered != 0)
           | colibri_sigmoid_keys(x + e, E - e, bias != NULL ? bias + e : NULL, on_logits,
                                  scores + e, keys + e);
}

/* The block path (route/rows.h) on 16 rows, as colibri_route_block_avx2. Returns COLIBRI_OK, COLIBRI_ROW_NAN (route the rows one by one to name it), or -1
 * when a row's best logit is infinite (colibri_route_rows8 takes such blocks). */
COLIBRI_AVX512_FN static inline int colibri_route_block_avx512(const colibri_router_t *r,
                                                               const float *x, int64_t stride,
                                                               int32_t *ids, float *weights)
{
    const int32_t E = r->num_experts;
    const __m512 none = _mm512_set1_ps(-INFINITY);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    __m512 a[16], b[16];
    __m512i worst = _mm512_setzero_si512(); /* the largest |bits|: above inf's means a NaN */
    float first[16], second[16];
    int32_t i, e;
    for (i = 0; i < 16; i++) {
        const float *row = x + i * stride;
        __m512 ai = none, bi = none, v;
        for (e = 0; e + 16 <= E; e += 16) {
            v = _mm512_loadu_ps(row + e);
            worst = _mm512_max_epu32(worst, _mm512_and_epi32(_mm512_castps_si512(v), magnitude));
            bi = _mm512_max_ps(_mm512_min_ps(v, ai), bi);
            ai = _mm512_max_ps(v, ai);
        }
        if (e < E) {
            v = _mm512_mask_loadu_ps(none, colibri_tail_avx512(E - e), row + e);
            worst = _mm512_max_epu32(worst, _mm512_and_epi32(_mm512_castps_si512(v), magnitude));
            bi = _mm512_max_ps(_mm512_min_ps(v, ai), bi);
            ai = _mm512_max_ps(v, ai);
        }
        a[i] = ai;
        b[i] = bi;
    }
    if (_mm512_cmpgt_epu32_mask(worst, _mm512_set1_epi32(0x7f800000)))
        return COLIBRI_ROW_NAN;
    __m512 m1, m2;
    colibri_fold_avx512(a, b, &m1, &m2);
    if ((_mm512_cmp_ps_mask(m1, none, _CMP_GT_OQ)
         & _mm512_cmp_ps_mask(m1, _mm512_set1_ps(INFINITY), _CMP_LT_OQ))
        != 0xffff)
        return -1;
    _mm512_storeu_ps(first, m1);
    _mm512_storeu_ps(second, m2);
    if (E <= 64) { /* one span holds both values: no claim loop */
        for (i = 0; i < 16; i++) {
            uint64_t k1, k2;
            colibri_span_masks_avx512(x + i * stride, E, _mm512_set1_ps(first[i]),
                                      _mm512_set1_ps(second[i]), &k1, &k2);
            ids[2 * i] = colibri_ctz64(k1);
            ids[2 * i + 1] = colibri_ctz64(k2 & ~((uint64_t)1 << ids[2 * i]));
        }
    } else {
        for (i = 0; i < 16; i++)
            colibri_top2_ids_avx512(x + i * stride, E, first[i], second[i], ids + 2 * i);
    }
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 ex = colibri_exp_avx512(_mm512_sub_ps(m2, m1));
    __m512 sum = _mm512_add_ps(_mm512_add_ps(one, ex), _mm512_set1_ps(r->norm_eps));
    __m512 w0 = _mm512_div_ps(one, sum), w1 = _mm512_div_ps(ex, sum);
    if (r->expert_scale != NULL) {
        __m512i i0 = _mm512_loadu_si512(ids), i1 = _mm512_loadu_si512(ids + 16);
        __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        w0 = _mm512_mul_ps(
            w0, _mm512_i32gather_ps(_mm512_permutex2var_epi32(i0, even, i1), r->expert_scale, 4));
        w1 = _mm512_mul_ps(
            w1, _mm512_i32gather_ps(_mm512_permutex2var_epi32(i0, odd, i1), r->expert_scale, 4));
    }
    w0 = _mm512_mul_ps(w0, _mm512_set1_ps(r->scale));
    w1 = _mm512_mul_ps(w1, _mm512_set1_ps(r->scale));
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    _mm512_storeu_ps(weights, _mm512_permutex2var_ps(w0, lo, w1));
    _mm512_storeu_ps(weights + 16,
                     _mm512_permutex2var_ps(w0, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), w1));
    return COLIBRI_OK;
}

#endif /* COLIBRI_ROUTE_AVX512_H */
