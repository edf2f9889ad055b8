/*
 * colibri's quantizers: float rows -> the GGUF block formats of colibri/quant.h (Q8_0, Q4_0,
 * Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4), one function per type, following ggml's reference
 * quantizers (ggml-quants.c: quantize_row_q8_0_ref, quantize_row_q4_0_ref,
 * quantize_row_q4_K_ref and quantize_row_q5_K_ref with make_qkx2_quants,
 * quantize_row_q6_K_ref with make_qx_quants, quantize_iq4_xs without importance weights,
 * quantize_row_mxfp4_ref). Q8_0, Q4_0 and MXFP4 give the bits of gguf-py's numpy quantizers;
 * the K-quants and IQ4_XS follow ggml's search step for step (same bits in all but rounding
 * corner cases). MXFP4's exponent is floor(log2(max |x|)) taken exactly from the float's bits.
 *
 * The input must be finite (the caller checks): NaN or inf has no block encoding. Plain C99,
 * header-only, no allocation; a row's blocks are independent, so rows may run in parallel.
 */
#ifndef COLIBRI_QUANTIZE_H
#define COLIBRI_QUANTIZE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "colibri/half.h"
#include "colibri/quant.h"

/* ggml's GROUP_MAX_EPS: a group whose max |x| is below it is all zero. */
#define COLIBRI_QZ_EPS 1e-15f

/* ggml's nearest_int (round half to even through the float adder), clamped to its range. */
static inline int32_t colibri_qz_nearest(float v)
{
    float val;
    int32_t i;
    v = v > 4194303.f ? 4194303.f : (v < -4194303.f ? -4194303.f : v);
    val = v + 12582912.f;
    memcpy(&i, &val, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

static inline int32_t colibri_qz_clamp(int32_t v, int32_t lo, int32_t hi)
{
    return v < lo ? lo : (v > hi ? hi : v);
}

static inline void colibri_qz_f16(uint8_t *p, float f)
{
    uint16_t h = colibri_float_to_half(f);
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

/* ---- Q8_0 / Q4_0 / MXFP4: blocks of 32 --------------------------------------------------- */

static inline void colibri_quantize_q8_0(const float *x, uint8_t *b)
{
    float amax = 0.0f, d, id;
    int32_t j;
    for (j = 0; j < 32; j++)
        amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    d = amax / 127.0f;
    id = d != 0.0f ? 1.0f / d : 0.0f;
    colibri_qz_f16(b, d);
    for (j = 0; j < 32; j++)
        b[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

static inline void colibri_quantize_q4_0(const float *x, uint8_t *b)
{
    float amax = 0.0f, max = 0.0f, d, id;
    int32_t j;
    for (j = 0; j < 32; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    d = max / -8.0f;
    id = d != 0.0f ? 1.0f / d : 0.0f;
    colibri_qz_f16(b, d);
    for (j = 0; j < 16; j++) {
        int32_t lo = (int32_t)(x[j] * id + 8.5f), hi = (int32_t)(x[16 + j] * id + 8.5f);
        lo = lo > 15 ? 15 : lo;
        hi = hi > 15 ? 15 : hi;
        b[2 + j] = (uint8_t)(lo | (hi << 4));
    }
}

static inline int32_t colibri_qz_best_mxfp4(float x, float d)
{
    int32_t i, best = 0;
    float err = fabsf((float)colibri_mxfp4_levels[0] * d - x);
    for (i = 1; i < 16; i++) {
        float e = fabsf((float)colibri_mxfp4_levels[i] * d - x);
        if (e < err) {
            best = i;
            err = e;
        }
    }
    return best;
}

static inline void colibri_quantize_mxfp4(const float *x, uint8_t *b)
{
    float amax = 0.0f, d;
    int32_t j, e = 0;
    for (j = 0; j < 32; j++)
        amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    if (amax > 0.0f) {
        int exponent;
        (void)frexpf(amax, &exponent); /* amax = m 2^exponent, m in [0.5, 1) */
        e = colibri_qz_clamp(exponent - 1 - 2 + 127, 0, 254);
    }
    b[0] = (uint8_t)e;
    d = colibri_e8m0_half((uint8_t)e);
    for (j = 0; j < 16; j++)
        b[1 + j] =
            (uint8_t)(colibri_qz_best_mxfp4(x[j], d) | (colibri_qz_best_mxfp4(x[16 + j], d) << 4));
}

/* ---- Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins -------------------------- */

/* ggml's make_qkx2_quants: levels L [n] in [0, nmax] of x with a scale and a min (returned
 * scale, *the_min = -min) minimising the weighted squared error over a grid of scales. */
static inline float colibri_qz_qkx2(int32_t n, int32_t nmax, const float *x, const float *w,
                                    uint8_t *L, float *the_min, uint8_t *Laux, float rmin,
                                    float rdelta, int32_t nstep)
{
    float min = x[0], max = x[0], sum_w = w[0], sum_x = w[0] * x[0];
    float iscale, scale, best_error = 0.0f;
    int32_t i, is;
    for (i = 1; i < n; i++) {
        min = x[i] < min ? x[i] : min;
        max = x[i] > max ? x[i] : max;
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0.0f)
        min = 0.0f;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.0f;
    }
    iscale = (float)nmax / (max - min);
    scale = 1.0f / iscale;
    for (i = 0; i < n; i++) {
        float diff;
        L[i] = (uint8_t)colibri_qz_clamp(colibri_qz_nearest(iscale * (x[i] - min)), 0, nmax);
        diff = scale * (float)L[i] + min - x[i];
        best_error += w[i] * (diff * diff);
    }
    for (is = 0; is <= nstep; is++) {
        float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f, D;
        iscale = (rmin + rdelta * (float)is + (float)nmax) / (max - min);
        for (i = 0; i < n; i++) {
            int32_t l = colibri_qz_clamp(colibri_qz_nearest(iscale * (x[i] - min)), 0, nmax);
            Laux[i] = (uint8_t)l;
            sum_l += w[i] * (float)l;
            sum_l2 += w[i] * (float)l * (float)l;
            sum_xl += w[i] * (float)l * x[i];
        }
        D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0.0f) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            float cur_error = 0.0f;
            if (this_min > 0.0f) {
                this_min = 0.0f;
                this_scale = sum_xl / sum_l2;
            }
            for (i = 0; i < n; i++) {
                float diff = this_scale * (float)Laux[i] + this_min - x[i];
                cur_error += w[i] * (diff * diff);
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* One Q4_K (nmax 15) or Q5_K (nmax 31) super-block: d, dmin, the 12 scale bytes at b + 4,
 * and the levels L [256] in [0, nmax] (the caller packs them). */
static inline void colibri_qz_k_scales(const float *x, uint8_t *b, int32_t nmax, float rmin,
                                       int32_t nstep, uint8_t *L)
{
    float mins[8], scales[8], weights[32], max_scale = 0.0f, max_min = 0.0f;
    float inv_scale, inv_min, d, dmin;
    uint8_t Laux[32], *s = b + 4;
    int32_t j, l;
    for (j = 0; j < 8; j++) {
        float sum_x2 = 0.0f, av_x;
        for (l = 0; l < 32; l++)
            sum_x2 += x[32 * j + l] * x[32 * j + l];
        av_x = sqrtf(sum_x2 / 32.0f);
        for (l = 0; l < 32; l++)
            weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = colibri_qz_qkx2(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, rmin,
                                    0.1f, nstep);
        max_scale = scales[j] > max_scale ? scales[j] : max_scale;
        max_min = mins[j] > max_min ? mins[j] : max_min;
    }
    inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
    inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
    memset(s, 0, 12);
    for (j = 0; j < 8; j++) {
        /* ggml stores nearest_int in a uint8_t, then takes MIN(63, .) */
        uint8_t ls = (uint8_t)colibri_qz_nearest(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)colibri_qz_nearest(inv_min * mins[j]);
        ls = ls > 63 ? 63 : ls;
        lm = lm > 63 ? 63 : lm;
        if (j < 4) {
            s[j] = ls;
            s[j + 4] = lm;
        } else {
            s[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            s[j - 4] |= (uint8_t)((ls >> 4) << 6);
            s[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    colibri_qz_f16(b, max_scale / 63.0f);
    colibri_qz_f16(b + 2, max_min / 63.0f);
    d = colibri_q_f16(b);
    dmin = colibri_q_f16(b + 2);
    for (j = 0; j < 8; j++) {
        int32_t sc, m;
        float dj, dm;
        colibri_q_k_scale_min(s, j, &sc, &m);
        dj = d * (float)sc;
        if (dj == 0.0f)
            continue;
        dm = dmin * (float)m;
        for (l = 0; l < 32; l++)
            L[32 * j + l] =
                (uint8_t)colibri_qz_clamp(colibri_qz_nearest((x[32 * j + l] + dm) / dj), 0, nmax);
    }
}

static inline void colibri_quantize_q4_k(const float *x, uint8_t *b)
{
    uint8_t L[256], *q = b + 16;
    int32_t j, l;
    colibri_qz_k_scales(x, b, 15, -1.0f, 20, L);
    for (j = 0; j < 256; j += 64, q += 32)
        for (l = 0; l < 32; l++)
            q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

static inline void colibri_quantize_q5_k(const float *x, uint8_t *b)
{
    uint8_t L[256], *qh = b + 16, *ql = b + 48, m1 = 1, m2 = 2;
    int32_t n, j;
    colibri_qz_k_scales(x, b, 31, -0.5f, 15, L);
    memset(qh, 0, 32);
    for (n = 0; n < 256; n += 64, ql += 32) {
        for (j = 0; j < 32; j++) {
            int32_t l1 = L[n + j], l2 = L[n + j + 32];
            if (l1 > 15) {
                l1 -= 16;
                qh[j] |= m1;
            }
            if (l2 > 15) {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[j] = (uint8_t)(l1 | (l2 << 4));
        }
        m1 = (uint8_t)(m1 << 2);
        m2 = (uint8_t)(m2 << 2);
    }
}

/* ---- Q6_K: 16 sub-blocks of 16 with int8 scales ------------------------------------------ */

/* ggml's make_qx_quants with rmse_type 1 (weights x^2): levels L [n] in [0, 2 nmax) and the
 * (signed) scale of the best of 19 candidate scales. */
static inline float colibri_qz_qx(int32_t n, int32_t nmax, const float *x, int8_t *L)
{
    float max = 0.0f, amax = 0.0f, iscale, sumlx = 0.0f, suml2 = 0.0f, scale, best;
    int32_t i, is;
    for (i = 0; i < n; i++) {
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            max = x[i];
        }
    }
    if (amax < COLIBRI_QZ_EPS) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    iscale = -(float)nmax / max;
    for (i = 0; i < n; i++) {
        int32_t l = colibri_qz_clamp(colibri_qz_nearest(iscale * x[i]), -nmax, nmax - 1);
        float w = x[i] * x[i];
        L[i] = (int8_t)(l + nmax);
        sumlx += w * x[i] * (float)l;
        suml2 += w * (float)l * (float)l;
    }
    scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
    best = scale * sumlx;
    for (is = -9; is <= 9; is++) {
        if (is == 0)
            continue;
        iscale = -((float)nmax + 0.1f * (float)is) / max;
        sumlx = suml2 = 0.0f;
        for (i = 0; i < n; i++) {
            int32_t l = colibri_qz_clamp(colibri_qz_nearest(iscale * x[i]), -nmax, nmax - 1);
            float w = x[i] * x[i];
            sumlx += w * x[i] * (float)l;
            suml2 += w * (float)l * (float)l;
        }
        if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
            for (i = 0; i < n; i++)
                L[i] = (int8_t)(nmax
                                + colibri_qz_clamp(colibri_qz_nearest(iscale * x[i]), -nmax,
                                                   nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

static inline void colibri_quantize_q6_k(const float *x, uint8_t *b)
{
    int8_t L[256];
    float scales[16], max_scale = 0.0f, max_abs_scale = 0.0f, iscale, d;
    uint8_t *ql = b, *qh = b + 128;
    int8_t *sc = (int8_t *)(b + 192);
    int32_t ib, j, l;
    for (ib = 0; ib < 16; ib++) {
        scales[ib] = colibri_qz_qx(16, 32, x + 16 * ib, L + 16 * ib);
        if (fabsf(scales[ib]) > max_abs_scale) {
            max_abs_scale = fabsf(scales[ib]);
            max_scale = scales[ib];
        }
    }
    if (max_abs_scale < COLIBRI_QZ_EPS) {
        memset(b, 0, 210);
        return;
    }
    iscale = -128.0f / max_scale;
    colibri_qz_f16(b + 208, 1.0f / iscale);
    for (ib = 0; ib < 16; ib++) {
        int32_t v = colibri_qz_nearest(iscale * scales[ib]);
        sc[ib] = (int8_t)(v > 127 ? 127 : v);
    }
    d = colibri_q_f16(b + 208);
    for (j = 0; j < 16; j++) {
        float dj = d * (float)sc[j];
        if (dj == 0.0f)
            continue;
        for (l = 0; l < 16; l++)
            L[16 * j + l] =
                (int8_t)(colibri_qz_clamp(colibri_qz_nearest(x[16 * j + l] / dj), -32, 31) + 32);
    }
    for (j = 0; j < 256; j += 128, ql += 64, qh += 32) {
        for (l = 0; l < 32; l++) {
            const uint8_t *Lu = (const uint8_t *)L + j + l;
            ql[l] = (uint8_t)((Lu[0] & 0xF) | ((Lu[64] & 0xF) << 4));
            ql[l + 32] = (uint8_t)((Lu[32] & 0xF) | ((Lu[96] & 0xF) << 4));
            qh[l] = (uint8_t)((Lu[0] >> 4) | ((Lu[32] >> 4) << 2) | ((Lu[64] >> 4) << 4)
                              | ((Lu[96] >> 4) << 6));
        }
    }
}

/* ---- IQ4_XS: 8 sub-blocks of 32 on IQ4_NL's non-linear levels, 6-bit scales ------------- */

/* ggml's best_index_int8: the index of the level nearest x among the 16 ascending levels. */
static inline int32_t colibri_qz_best_iq4(float x)
{
    const int8_t *val = colibri_iq4_levels;
    int32_t ml = 0, mu = 15;
    if (x <= (float)val[0])
        return 0;
    if (x >= (float)val[15])
        return 15;
    while (mu - ml > 1) {
        int32_t mav = (ml + mu) / 2;
        if (x < (float)val[mav])
            mu = mav;
        else
            ml = mav;
    }
    return x - (float)val[mu - 1] < (float)val[mu] - x ? mu - 1 : mu;
}

static inline void colibri_quantize_iq4_xs(const float *x, uint8_t *b)
{
    const int8_t *values = colibri_iq4_levels;
    const int32_t ntry = 7;
    float scales[8], weight[32], max_scale = 0.0f, amax_scale = 0.0f, d, id;
    uint8_t L[256], *q4 = b + 8, *scales_l = b + 4;
    uint16_t scales_h = 0;
    int32_t ib, j, itry;
    memset(L, 0, sizeof L);
    for (ib = 0; ib < 8; ib++) {
        const float *xb = x + 32 * ib;
        float amax = 0.0f, max = 0.0f, sumqx = 0.0f, sumq2 = 0.0f, best;
        for (j = 0; j < 32; j++) {
            weight[j] = xb[j] * xb[j];
            if (fabsf(xb[j]) > amax) {
                amax = fabsf(xb[j]);
                max = xb[j];
            }
        }
        if (amax < COLIBRI_QZ_EPS) {
            scales[ib] = 0.0f;
            continue;
        }
        d = -max / (float)values[0];
        id = 1.0f / d;
        for (j = 0; j < 32; j++) {
            float q = (float)values[colibri_qz_best_iq4(id * xb[j])];
            sumqx += weight[j] * q * xb[j];
            sumq2 += weight[j] * q * q;
        }
        d = sumq2 > 0.0f ? sumqx / sumq2 : d; /* x^2 underflowing to 0 everywhere: keep d */
        best = d * sumqx;
        for (itry = -ntry; itry <= ntry; itry++) {
            id = ((float)itry + (float)values[0]) / max;
            sumqx = sumq2 = 0.0f;
            for (j = 0; j < 32; j++) {
                float q = (float)values[colibri_qz_best_iq4(id * xb[j])];
                sumqx += weight[j] * q * xb[j];
                sumq2 += weight[j] * q * q;
            }
            if (sumq2 > 0.0f && sumqx * sumqx > best * sumq2) {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        if (fabsf(d) > amax_scale) {
            amax_scale = fabsf(d);
            max_scale = d;
        }
    }
    d = -max_scale / 32.0f;
    colibri_qz_f16(b, d);
    id = d != 0.0f ? 1.0f / d : 0.0f;
    memset(scales_l, 0, 4);
    for (ib = 0; ib < 8; ib++) {
        int32_t l = colibri_qz_clamp(colibri_qz_nearest(id * scales[ib]), -32, 31);
        float dl = d * (float)l, idl = dl != 0.0f ? 1.0f / dl : 0.0f;
        for (j = 0; j < 32; j++)
            L[32 * ib + j] = (uint8_t)colibri_qz_best_iq4(idl * x[32 * ib + j]);
        l += 32;
        scales_l[ib / 2] |= (uint8_t)((l & 0xF) << ((ib % 2) * 4));
        scales_h |= (uint16_t)((l >> 4) << (2 * ib));
    }
    b[2] = (uint8_t)(scales_h & 0xff);
    b[3] = (uint8_t)(scales_h >> 8);
    for (ib = 0; ib < 8; ib++)
        for (j = 0; j < 16; j++)
            q4[16 * ib + j] = (uint8_t)(L[32 * ib + j] | (L[32 * ib + 16 + j] << 4));
}

/* ---- dispatch ---------------------------------------------------------------------------- */

/* One block of `type`: colibri_q_block[type] finite floats x -> colibri_q_bytes[type] bytes. */
static inline void colibri_quantize_block(int type, const float *x, uint8_t *b)
{
    switch (type) {
    case COLIBRI_Q8_0:
        colibri_quantize_q8_0(x, b);
        break;
    case COLIBRI_Q4_0:
        colibri_quantize_q4_0(x, b);
        break;
    case COLIBRI_Q4_K:
        colibri_quantize_q4_k(x, b);
        break;
    case COLIBRI_Q5_K:
        colibri_quantize_q5_k(x, b);
        break;
    case COLIBRI_Q6_K:
        colibri_quantize_q6_k(x, b);
        break;
    case COLIBRI_IQ4_XS:
        colibri_quantize_iq4_xs(x, b);
        break;
    default: /* COLIBRI_MXFP4 */
        colibri_quantize_mxfp4(x, b);
        break;
    }
}

/* A row of K finite floats (K a multiple of colibri_q_block[type]) -> its blocks at out. */
static inline void colibri_quantize_row(int type, const float *x, int64_t K, uint8_t *out)
{
    int64_t i, blocks = K / colibri_q_block[type];
    for (i = 0; i < blocks; i++)
        colibri_quantize_block(type, x + i * colibri_q_block[type],
                               out + i * colibri_q_bytes[type]);
}

#endif /* COLIBRI_QUANTIZE_H */
