/*
 * route.h's primitives on SSE2, 4 lanes (x86-64's baseline: taken whenever compiled). The
 * same IEEE operations in the same order as route/generic.h; a row's last E mod 4 elements
 * go through the scalar code. colibri_sqrtsoftplus_row is generic's (route/fallback.h).
 */
#ifndef COLIBRI_ROUTE_SSE2_H
#define COLIBRI_ROUTE_SSE2_H

#ifndef COLIBRI_ROUTE_H
#error "include colibri/route.h, not its parts"
#endif

#include <emmintrin.h>

/* colibri_exp and colibri_sigmoid on 4 lanes. */
static inline __m128 colibri_exp_sse2(__m128 x)
{
    x = _mm_max_ps(x, _mm_set1_ps(COLIBRI_EXP_LO));
    x = _mm_min_ps(x, _mm_set1_ps(COLIBRI_EXP_HI));
    __m128 magic = _mm_set1_ps(COLIBRI_ROUND_MAGIC);
    __m128 n = _mm_sub_ps(_mm_add_ps(_mm_mul_ps(x, _mm_set1_ps(COLIBRI_LOG2E)), magic), magic);
    __m128 r = _mm_sub_ps(x, _mm_mul_ps(n, _mm_set1_ps(COLIBRI_LN2_HI)));
    r = _mm_sub_ps(r, _mm_mul_ps(n, _mm_set1_ps(COLIBRI_LN2_LO)));
    __m128 p = _mm_set1_ps(COLIBRI_EXP_P5);
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(COLIBRI_EXP_P4));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(COLIBRI_EXP_P3));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(COLIBRI_EXP_P2));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(COLIBRI_EXP_P1));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(COLIBRI_EXP_P0));
    p = _mm_add_ps(_mm_add_ps(_mm_mul_ps(p, _mm_mul_ps(r, r)), r), _mm_set1_ps(1.0f));
    __m128i ni = _mm_cvttps_epi32(n);
    __m128i n1 = _mm_srai_epi32(ni, 1);
    __m128i n2 = _mm_sub_epi32(ni, n1);
    __m128i bias = _mm_set1_epi32(127);
    __m128 s1 = _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(n1, bias), 23));
    __m128 s2 = _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(n2, bias), 23));
    return _mm_mul_ps(_mm_mul_ps(p, s1), s2);
}

static inline __m128 colibri_sigmoid_sse2(__m128 x)
{
    __m128 sign = _mm_set1_ps(-0.0f);
    __m128 z = colibri_exp_sse2(_mm_or_ps(x, sign)); /* exp(-|x|) */
    __m128 one = _mm_set1_ps(1.0f), is_pos = _mm_cmpge_ps(x, _mm_setzero_ps());
    __m128 num = _mm_or_ps(_mm_and_ps(is_pos, one), _mm_andnot_ps(is_pos, z));
    return _mm_div_ps(num, _mm_add_ps(one, z)); /* 1 / (1 + z) or z / (1 + z) */
}

static inline void colibri_prefetch(const void *p, size_t n)
{
    size_t i;
    for (i = 0; i < n; i += 64)
        _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

static inline float colibri_exp_shifted(const float *x, float m, float *out, int32_t E)
{
    int32_t e = 0;
    float sum = 0.0f;
    __m128 mm = _mm_set1_ps(m), acc = _mm_setzero_ps();
    for (; e + 4 <= E; e += 4) {
        __m128 v = colibri_exp_sse2(_mm_sub_ps(_mm_loadu_ps(x + e), mm));
        _mm_storeu_ps(out + e, v);
        acc = _mm_add_ps(acc, v);
    }
    float lanes[4];
    _mm_storeu_ps(lanes, acc);
    sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; e < E; e++) {
        out[e] = colibri_exp(x[e] - m);
        sum += out[e];
    }
    return sum;
}

static inline void colibri_exp_gathered(const float *x, const int32_t *ids, int32_t n, float m,
                                        float *out)
{
    int32_t j = 0;
    for (; j + 4 <= n; j += 4) {
        __m128 v = _mm_set_ps(x[ids[j + 3]], x[ids[j + 2]], x[ids[j + 1]], x[ids[j]]);
        _mm_storeu_ps(out + j, colibri_exp_sse2(_mm_sub_ps(v, _mm_set1_ps(m))));
    }
    if (j < n) { /* the last 1-3 in one vector too, padded with exp(0) */
        float lanes[4] = {m, m, m, m};
        int32_t i;
        for (i = 0; j + i < n; i++)
            lanes[i] = x[ids[j + i]];
        _mm_storeu_ps(lanes, colibri_exp_sse2(_mm_sub_ps(_mm_loadu_ps(lanes), _mm_set1_ps(m))));
        for (i = 0; j + i < n; i++)
            out[j + i] = lanes[i];
    }
}

static inline int colibri_top2_values(const float *x, int32_t E, float *first, float *second)
{
    int32_t e = 0;
    int nan = 0;
    float m1 = -INFINITY, m2 = -INFINITY;
    if (E >= 8) {
        /* two sets of lanes (even and odd vectors): two dependency chains */
        __m128 a = _mm_set1_ps(-INFINITY), b = a, a2 = a, b2 = a;
        __m128 unordered = _mm_setzero_ps();
        for (; e + 8 <= E; e += 8) {
            __m128 v = _mm_loadu_ps(x + e), w = _mm_loadu_ps(x + e + 4);
            unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, w));
            b = _mm_max_ps(_mm_min_ps(v, a), b);
            a = _mm_max_ps(v, a);
            b2 = _mm_max_ps(_mm_min_ps(w, a2), b2);
            a2 = _mm_max_ps(w, a2);
        }
        if (e + 4 <= E) {
            __m128 v = _mm_loadu_ps(x + e);
            unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
            b = _mm_max_ps(_mm_min_ps(v, a), b);
            a = _mm_max_ps(v, a);
            e += 4;
        }
        /* merge: the best two of {a >= b} and {a' >= b'} are max(a, a') and
         * max(min(a, a'), max(b, b')); the two sets, then lane pairs twice */
        b = _mm_max_ps(_mm_min_ps(a, a2), _mm_max_ps(b, b2));
        a = _mm_max_ps(a, a2);
        a2 = _mm_shuffle_ps(a, a, _MM_SHUFFLE(1, 0, 3, 2));
        b2 = _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2));
        b = _mm_max_ps(_mm_min_ps(a, a2), _mm_max_ps(b, b2));
        a = _mm_max_ps(a, a2);
        a2 = _mm_shuffle_ps(a, a, _MM_SHUFFLE(2, 3, 0, 1));
        b2 = _mm_shuffle_ps(b, b, _MM_SHUFFLE(2, 3, 0, 1));
        b = _mm_max_ps(_mm_min_ps(a, a2), _mm_max_ps(b, b2));
        a = _mm_max_ps(a, a2);
        m1 = _mm_cvtss_f32(a);
        m2 = _mm_cvtss_f32(b);
        nan = _mm_movemask_ps(unordered);
    }
    nan |= colibri_top2_values_from(x, e, E, &m1, &m2);
    *first = m1;
    *second = m2;
    return nan;
}

static inline void colibri_top2_ids(const float *x, int32_t E, float m1, float m2, int32_t *ids)
{
    int32_t base, e, i1 = -1, i2 = -1;
    for (base = 0; base < E; base += 64) {
        const float *span = x + base;
        int32_t n = E - base < 64 ? E - base : 64;
        uint64_t k1 = 0, k2 = 0;
        e = 0;
        __m128 v1 = _mm_set1_ps(m1), v2 = _mm_set1_ps(m2);
        for (; e + 16 <= n; e += 16) {
            __m128 x0 = _mm_loadu_ps(span + e), x1 = _mm_loadu_ps(span + e + 4);
            __m128 x2 = _mm_loadu_ps(span + e + 8), x3 = _mm_loadu_ps(span + e + 12);
            __m128i lo = _mm_packs_epi32(_mm_castps_si128(_mm_cmpeq_ps(x0, v1)),
                                         _mm_castps_si128(_mm_cmpeq_ps(x1, v1)));
            __m128i hi = _mm_packs_epi32(_mm_castps_si128(_mm_cmpeq_ps(x2, v1)),
                                         _mm_castps_si128(_mm_cmpeq_ps(x3, v1)));
            k1 |= (uint64_t)(uint32_t)_mm_movemask_epi8(_mm_packs_epi16(lo, hi)) << e;
            lo = _mm_packs_epi32(_mm_castps_si128(_mm_cmpeq_ps(x0, v2)),
                                 _mm_castps_si128(_mm_cmpeq_ps(x1, v2)));
            hi = _mm_packs_epi32(_mm_castps_si128(_mm_cmpeq_ps(x2, v2)),
                                 _mm_castps_si128(_mm_cmpeq_ps(x3, v2)));
            k2 |= (uint64_t)(uint32_t)_mm_movemask_epi8(_mm_packs_epi16(lo, hi)) << e;
        }
        for (; e + 4 <= n; e += 4) {
            __m128 v = _mm_loadu_ps(span + e);
            k1 |= (uint64_t)(uint32_t)_mm_movemask_ps(_mm_cmpeq_ps(v, v1)) << e;
            k2 |= (uint64_t)(uint32_t)_mm_movemask_ps(_mm_cmpeq_ps(v, v2)) << e;
        }
        colibri_span_masks_from(span, e, n, m1, m2, &k1, &k2);
        if (colibri_top2_claim(k1, k2, base, &i1, &i2))
            break;
    }
    ids[0] = i1;
    ids[1] = i2;
}

/* Each of 4 lanes keeps its best two; the smallest of the 8 (or of the 4 lane maxima when
 * k <= 4) is reached by at least k elements, and usually only a few more reach it. */
static inline float colibri_lane_bound(const float *x, int32_t E, int32_t k, int *nan)
{
    int32_t e = 0;
    float bound = -INFINITY;
    if (E >= 8) {
        __m128 a = _mm_set1_ps(-INFINITY), b = a, unordered = _mm_setzero_ps();
        for (; e + 4 <= E; e += 4) {
            __m128 v = _mm_loadu_ps(x + e);
            unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
            b = _mm_max_ps(_mm_min_ps(v, a), b);
            a = _mm_max_ps(v, a);
        }
        __m128 m = k <= 4 ? a : b;
        m = _mm_min_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
        m = _mm_min_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
        bound = _mm_cvtss_f32(m);
        *nan |= _mm_movemask_ps(unordered);
    }
    for (; e < E; e++)
        *nan |= x[e] != x[e];
    return bound;
}

static inline int32_t colibri_compact(const float *x, int32_t first, int32_t last, float bound,
                                      int32_t *cand, int32_t c)
{
    static const int32_t lanes[16][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0},
                                         {2, 0, 0, 0}, {0, 2, 0, 0}, {1, 2, 0, 0}, {0, 1, 2, 0},
                                         {3, 0, 0, 0}, {0, 3, 0, 0}, {1, 3, 0, 0}, {0, 1, 3, 0},
                                         {2, 3, 0, 0}, {0, 2, 3, 0}, {1, 2, 3, 0}, {0, 1, 2, 3}};
    static const signed char count[16] = {0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4};
    int32_t e = first;
    __m128 b = _mm_set1_ps(bound);
    for (; e + 4 <= last; e += 4) {
        int mask = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(x + e), b));
        __m128i at =
            _mm_add_epi32(_mm_loadu_si128((const __m128i *)lanes[mask]), _mm_set1_epi32(e));
        _mm_storeu_si128((__m128i *)(cand + c), at);
        c += count[mask];
    }
    for (; e < last; e++) {
        cand[c] = e;
        c += x[e] >= bound;
    }
    return c;
}

static inline int32_t colibri_rank(const float *cv, const int32_t *cand, int32_t c, int32_t i)
{
    int32_t q;
    if (cv[i] != cv[i])
        return colibri_rank_nan(cv, cand, c, i);
    __m128 v = _mm_set1_ps(cv[i]);
    __m128i id = _mm_set1_epi32(cand[i]), before = _mm_setzero_si128();
    for (q = 0; q < c; q += 4) {
        __m128 w = _mm_loadu_ps(cv + q);
        __m128i j = _mm_loadu_si128((const __m128i *)(cand + q));
        __m128 tie = _mm_and_ps(_mm_cmpeq_ps(w, v), _mm_castsi128_ps(_mm_cmplt_epi32(j, id)));
        before = _mm_sub_epi32(before, _mm_castps_si128(_mm_or_ps(_mm_cmpgt_ps(w, v), tie)));
    }
    before = _mm_add_epi32(before, _mm_shuffle_epi32(before, _MM_SHUFFLE(1, 0, 3, 2)));
    before = _mm_add_epi32(before, _mm_shuffle_epi32(before, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(before);
}

static inline int colibri_sigmoid_keys(const float *x, int32_t E, const float *bias, int on_logits,
                                       float *scores, float *keys)
{
    int32_t e = 0;
    int nan = 0;
    __m128 unordered = _mm_setzero_ps();
    for (; e + 4 <= E; e += 4) {
        __m128 v = _mm_loadu_ps(x + e);
        __m128 s = colibri_sigmoid_sse2(v);
        unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
        _mm_storeu_ps(scores + e, s);
        if (bias != NULL)
            _mm_storeu_ps(keys + e, _mm_add_ps(on_logits ? v : s, _mm_loadu_ps(bias + e)));
    }
    nan = _mm_movemask_ps(unordered);
    for (; e < E; e++) {
        nan |= x[e] != x[e];
        scores[e] = colibri_sigmoid(x[e]);
        if (bias != NULL)
            keys[e] = (on_logits ? x[e] : scores[e]) + bias[e];
    }
    return nan;
}

static inline int colibri_has_nan(const float *x, int32_t E)
{
    int32_t e = 0;
    int nan = 0;
    __m128 unordered = _mm_setzero_ps();
    for (; e + 4 <= E; e += 4) {
        __m128 v = _mm_loadu_ps(x + e);
        unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
    }
    nan = _mm_movemask_ps(unordered);
    for (; e < E; e++)
        nan |= x[e] != x[e];
    return nan;
}

static inline int colibri_top2_softmax8(const float *first, const float *second, float eps,
                                        float *w0, float *w1)
{
    int32_t i;
    __m128 one = _mm_set1_ps(1.0f), veps = _mm_set1_ps(eps);
    for (i = 0; i < 8; i += 4) {
        __m128 e = colibri_exp_sse2(_mm_sub_ps(_mm_loadu_ps(second + i), _mm_loadu_ps(first + i)));
        __m128 sum = _mm_add_ps(_mm_add_ps(one, e), veps);
        _mm_storeu_ps(w0 + i, _mm_div_ps(one, sum));
        _mm_storeu_ps(w1 + i, _mm_div_ps(e, sum));
    }
    return 1;
}

#endif /* COLIBRI_ROUTE_SSE2_H */
