/*
 * route.h's primitives on aarch64's NEON, 4 lanes: the same IEEE operations in the same order
 * as the SSE2 code and plain C (separate multiplies and adds: no FMA), so the same bits.
 * Taken unless COLIBRI_SIMD=scalar: each primitive then runs its generic version. A row's
 * last E mod 4 elements go through the scalar code. colibri_prefetch is generic's.
 */
#ifndef COLIBRI_ROUTE_NEON_H
#define COLIBRI_ROUTE_NEON_H

#ifndef COLIBRI_ROUTE_H
#error "include colibri/route.h, not its parts"
#endif

#include <arm_neon.h>

static inline int colibri_neon_on(void)
{
    return colibri_simd_path() == COLIBRI_PATH_NEON;
}

/* colibri_exp and colibri_sigmoid on 4 lanes. */
static inline float32x4_t colibri_exp_neon(float32x4_t x)
{
    x = vmaxq_f32(x, vdupq_n_f32(COLIBRI_EXP_LO)); /* NaN stays NaN, as in colibri_exp */
    x = vminq_f32(x, vdupq_n_f32(COLIBRI_EXP_HI));
    float32x4_t magic = vdupq_n_f32(COLIBRI_ROUND_MAGIC);
    float32x4_t n = vsubq_f32(vaddq_f32(vmulq_f32(x, vdupq_n_f32(COLIBRI_LOG2E)), magic), magic);
    float32x4_t r = vsubq_f32(x, vmulq_f32(n, vdupq_n_f32(COLIBRI_LN2_HI)));
    r = vsubq_f32(r, vmulq_f32(n, vdupq_n_f32(COLIBRI_LN2_LO)));
    float32x4_t p = vdupq_n_f32(COLIBRI_EXP_P5);
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(COLIBRI_EXP_P4));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(COLIBRI_EXP_P3));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(COLIBRI_EXP_P2));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(COLIBRI_EXP_P1));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(COLIBRI_EXP_P0));
    p = vaddq_f32(vaddq_f32(vmulq_f32(p, vmulq_f32(r, r)), r), vdupq_n_f32(1.0f));
    int32x4_t ni = vcvtq_s32_f32(n), n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
    int32x4_t bias = vdupq_n_s32(127);
    float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, bias), 23));
    float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, bias), 23));
    return vmulq_f32(vmulq_f32(p, s1), s2);
}

static inline float32x4_t colibri_sigmoid_neon(float32x4_t x)
{
    float32x4_t z = colibri_exp_neon(vnegq_f32(vabsq_f32(x))), one = vdupq_n_f32(1.0f);
    float32x4_t num = vbslq_f32(vcgeq_f32(x, vdupq_n_f32(0.0f)), one, z);
    return vdivq_f32(num, vaddq_f32(one, z));
}

/* Bit i of the result: lane i of the mask m is set (_mm_movemask_ps). */
static inline int colibri_mask_neon(uint32x4_t m)
{
    static const uint32_t bit[4] = {1, 2, 4, 8};
    return (int)vaddvq_u32(vandq_u32(m, vld1q_u32(bit)));
}

/* All-ones lanes where v is NaN. */
static inline uint32x4_t colibri_unord_neon(float32x4_t v)
{
    return vmvnq_u32(vceqq_f32(v, v));
}

static inline float colibri_exp_shifted(const float *x, float m, float *out, int32_t E)
{
    int32_t e = 0;
    float sum;
    if (!colibri_neon_on())
        return colibri_exp_shifted_generic(x, m, out, E);
    float32x4_t mm = vdupq_n_f32(m), acc = vdupq_n_f32(0.0f);
    for (; e + 4 <= E; e += 4) {
        float32x4_t v = colibri_exp_neon(vsubq_f32(vld1q_f32(x + e), mm));
        vst1q_f32(out + e, v);
        acc = vaddq_f32(acc, v);
    }
    sum = (vgetq_lane_f32(acc, 0) + vgetq_lane_f32(acc, 1))
          + (vgetq_lane_f32(acc, 2) + vgetq_lane_f32(acc, 3));
    for (; e < E; e++) {
        out[e] = colibri_exp(x[e] - m);
        sum += out[e];
    }
    return sum;
}

static inline void colibri_exp_gathered(const float *x, const int32_t *ids, int32_t n, float m,
                                        float *out)
{
    int32_t j;
    if (!colibri_neon_on()) {
        colibri_exp_gathered_generic(x, ids, n, m, out);
        return;
    }
    for (j = 0; j < n; j += 4) { /* the last 1-3 padded with exp(0) */
        float lanes[4] = {m, m, m, m};
        int32_t i;
        for (i = 0; i < 4 && j + i < n; i++)
            lanes[i] = x[ids[j + i]];
        vst1q_f32(lanes, colibri_exp_neon(vsubq_f32(vld1q_f32(lanes), vdupq_n_f32(m))));
        for (i = 0; i < 4 && j + i < n; i++)
            out[j + i] = lanes[i];
    }
}

/* The exponentials 4 at a time (log1pf stays libm's). */
static inline void colibri_sqrtsoftplus_row(const float *x, int32_t E, float *scores)
{
    int32_t e = 0;
    if (!colibri_neon_on()) {
        colibri_sqrtsoftplus_row_generic(x, E, scores);
        return;
    }
    for (; e + 4 <= E; e += 4)
        vst1q_f32(scores + e, colibri_exp_neon(vld1q_f32(x + e)));
    for (e = 0; e < E; e++) {
        float ex = e < (E & ~3) ? scores[e] : colibri_exp(x[e]);
        scores[e] = sqrtf(x[e] > 20.0f ? x[e] : log1pf(ex));
    }
}

/* The SSE2 code's lanes and merges. */
static inline int colibri_top2_values(const float *x, int32_t E, float *first, float *second)
{
    int32_t e = 0;
    int nan = 0;
    float m1 = -INFINITY, m2 = -INFINITY;
    if (!colibri_neon_on())
        return colibri_top2_values_generic(x, E, first, second);
    if (E >= 8) {
        float32x4_t a = vdupq_n_f32(-INFINITY), b = a, a2 = a, b2 = a;
        uint32x4_t unordered = vdupq_n_u32(0);
        for (; e + 8 <= E; e += 8) {
            float32x4_t v = vld1q_f32(x + e), w = vld1q_f32(x + e + 4);
            unordered =
                vorrq_u32(unordered, vorrq_u32(colibri_unord_neon(v), colibri_unord_neon(w)));
            b = vmaxq_f32(vminq_f32(v, a), b);
            a = vmaxq_f32(v, a);
            b2 = vmaxq_f32(vminq_f32(w, a2), b2);
            a2 = vmaxq_f32(w, a2);
        }
        if (e + 4 <= E) {
            float32x4_t v = vld1q_f32(x + e);
            unordered = vorrq_u32(unordered, colibri_unord_neon(v));
            b = vmaxq_f32(vminq_f32(v, a), b);
            a = vmaxq_f32(v, a);
            e += 4;
        }
        b = vmaxq_f32(vminq_f32(a, a2), vmaxq_f32(b, b2));
        a = vmaxq_f32(a, a2);
        a2 = vextq_f32(a, a, 2); /* lanes 2 3 0 1 */
        b2 = vextq_f32(b, b, 2);
        b = vmaxq_f32(vminq_f32(a, a2), vmaxq_f32(b, b2));
        a = vmaxq_f32(a, a2);
        a2 = vrev64q_f32(a); /* lanes 1 0 3 2 */
        b2 = vrev64q_f32(b);
        b = vmaxq_f32(vminq_f32(a, a2), vmaxq_f32(b, b2));
        a = vmaxq_f32(a, a2);
        m1 = vgetq_lane_f32(a, 0);
        m2 = vgetq_lane_f32(b, 0);
        nan = vmaxvq_u32(unordered) != 0;
    }
    nan |= colibri_top2_values_from(x, e, E, &m1, &m2);
    *first = m1;
    *second = m2;
    return nan;
}

static inline void colibri_top2_ids(const float *x, int32_t E, float m1, float m2, int32_t *ids)
{
    int32_t base, e, i1 = -1, i2 = -1;
    if (!colibri_neon_on()) {
        colibri_top2_ids_generic(x, E, m1, m2, ids);
        return;
    }
    const float32x4_t v1 = vdupq_n_f32(m1), v2 = vdupq_n_f32(m2);
    for (base = 0; base < E; base += 64) {
        const float *span = x + base;
        int32_t n = E - base < 64 ? E - base : 64;
        uint64_t k1 = 0, k2 = 0;
        for (e = 0; e + 4 <= n; e += 4) {
            float32x4_t v = vld1q_f32(span + e);
            k1 |= (uint64_t)(uint32_t)colibri_mask_neon(vceqq_f32(v, v1)) << e;
            k2 |= (uint64_t)(uint32_t)colibri_mask_neon(vceqq_f32(v, v2)) << e;
        }
        colibri_span_masks_from(span, e, n, m1, m2, &k1, &k2);
        if (colibri_top2_claim(k1, k2, base, &i1, &i2))
            break;
    }
    ids[0] = i1;
    ids[1] = i2;
}

/* As the SSE2 code: each lane's best two, the smallest of them (of the lane maxima, k <= 4). */
static inline float colibri_lane_bound(const float *x, int32_t E, int32_t k, int *nan)
{
    int32_t e = 0;
    float bound = -INFINITY;
    if (!colibri_neon_on())
        return colibri_lane_bound_generic(x, E, k, nan);
    if (E >= 8) {
        float32x4_t a = vdupq_n_f32(-INFINITY), b = a;
        uint32x4_t unordered = vdupq_n_u32(0);
        for (; e + 4 <= E; e += 4) {
            float32x4_t v = vld1q_f32(x + e);
            unordered = vorrq_u32(unordered, colibri_unord_neon(v));
            b = vmaxq_f32(vminq_f32(v, a), b);
            a = vmaxq_f32(v, a);
        }
        bound = vminvq_f32(k <= 4 ? a : b);
        *nan |= vmaxvq_u32(unordered) != 0;
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
    if (!colibri_neon_on())
        return colibri_compact_generic(x, first, last, bound, cand, c);
    float32x4_t b = vdupq_n_f32(bound);
    for (; e + 4 <= last; e += 4) {
        int mask = colibri_mask_neon(vcgeq_f32(vld1q_f32(x + e), b));
        vst1q_s32(cand + c, vaddq_s32(vld1q_s32(lanes[mask]), vdupq_n_s32(e)));
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
    if (!colibri_neon_on())
        return colibri_rank_generic(cv, cand, c, i);
    if (cv[i] != cv[i])
        return colibri_rank_nan(cv, cand, c, i);
    float32x4_t v = vdupq_n_f32(cv[i]);
    int32x4_t id = vdupq_n_s32(cand[i]), before = vdupq_n_s32(0);
    for (q = 0; q < c; q += 4) {
        float32x4_t w = vld1q_f32(cv + q);
        uint32x4_t tie = vandq_u32(vceqq_f32(w, v), vcltq_s32(vld1q_s32(cand + q), id));
        before = vsubq_s32(before, vreinterpretq_s32_u32(vorrq_u32(vcgtq_f32(w, v), tie)));
    }
    return vaddvq_s32(before);
}

static inline int colibri_sigmoid_keys(const float *x, int32_t E, const float *bias, int on_logits,
                                       float *scores, float *keys)
{
    int32_t e = 0;
    int nan;
    if (!colibri_neon_on())
        return colibri_sigmoid_keys_generic(x, E, bias, on_logits, scores, keys);
    uint32x4_t unordered = vdupq_n_u32(0);
    for (; e + 4 <= E; e += 4) {
        float32x4_t v = vld1q_f32(x + e);
        float32x4_t s = colibri_sigmoid_neon(v);
        unordered = vorrq_u32(unordered, colibri_unord_neon(v));
        vst1q_f32(scores + e, s);
        if (bias != NULL)
            vst1q_f32(keys + e, vaddq_f32(on_logits ? v : s, vld1q_f32(bias + e)));
    }
    nan = vmaxvq_u32(unordered) != 0;
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
    int nan;
    if (!colibri_neon_on())
        return colibri_has_nan_generic(x, E);
    uint32x4_t unordered = vdupq_n_u32(0);
    for (; e + 4 <= E; e += 4)
        unordered = vorrq_u32(unordered, colibri_unord_neon(vld1q_f32(x + e)));
    nan = vmaxvq_u32(unordered) != 0;
    for (; e < E; e++)
        nan |= x[e] != x[e];
    return nan;
}

static inline int colibri_top2_softmax8(const float *first, const float *second, float eps,
                                        float *w0, float *w1)
{
    int32_t i;
    if (!colibri_neon_on())
        return colibri_top2_softmax8_generic(first, second, eps, w0, w1);
    float32x4_t one = vdupq_n_f32(1.0f), veps = vdupq_n_f32(eps);
    for (i = 0; i < 8; i += 4) {
        float32x4_t e = colibri_exp_neon(vsubq_f32(vld1q_f32(second + i), vld1q_f32(first + i)));
        float32x4_t sum = vaddq_f32(vaddq_f32(one, e), veps);
        vst1q_f32(w0 + i, vdivq_f32(one, sum));
        vst1q_f32(w1 + i, vdivq_f32(e, sum));
    }
    return 1;
}

#endif /* COLIBRI_ROUTE_NEON_H */
