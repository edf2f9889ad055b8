/*
 * colibri/quant.h's weight-row products on aarch64 NEON: each block of 32's integer dot
 * product with widening multiplies (vmull_s8, pairwise-added into int32), the blocks' float
 * terms as in colibri_q_dot_scalar: the same bits. Included by colibri/quant.h.
 */
#ifndef COLIBRI_QUANT_NEON_H
#define COLIBRI_QUANT_NEON_H

#include <arm_neon.h>

/* 16 bytes -> their 16 low nibbles (lo) and 16 high nibbles (hi). */
static inline void colibri_q_nibbles_neon(const uint8_t *p, int8x16_t *lo, int8x16_t *hi)
{
    uint8x16_t v = vld1q_u8(p), m = vdupq_n_u8(15);
    *lo = vreinterpretq_s8_u8(vandq_u8(v, m));
    *hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
}

/* Weight sub-block j of block b -> its 32 levels as two halves (colibri_q_level's values). */
static inline void colibri_q_unpack_neon(int type, const uint8_t *b, int32_t j, int8x16_t *v0,
                                         int8x16_t *v1)
{
    int8_t lv[32];
    switch (type) {
    case COLIBRI_Q8_0:
        *v0 = vld1q_s8((const int8_t *)b + 2);
        *v1 = vld1q_s8((const int8_t *)b + 18);
        return;
    case COLIBRI_Q4_0:
        colibri_q_nibbles_neon(b + 2, v0, v1);
        *v0 = vsubq_s8(*v0, vdupq_n_s8(8));
        *v1 = vsubq_s8(*v1, vdupq_n_s8(8));
        return;
    case COLIBRI_MXFP4:
    case COLIBRI_MXFP4_OSS:
    case COLIBRI_IQ4_XS: {
        const int8x16_t t =
            vld1q_s8(COLIBRI_Q_E2M1(type) ? colibri_mxfp4_levels : colibri_iq4_levels);
        colibri_q_nibbles_neon(
            type == COLIBRI_IQ4_XS ? b + 8 + 16 * j : b + (type == COLIBRI_MXFP4), v0, v1);
        *v0 = vqtbl1q_s8(t, vreinterpretq_u8_s8(*v0));
        *v1 = vqtbl1q_s8(t, vreinterpretq_u8_s8(*v1));
        return;
    }
    default: /* the K types: the generic unpacking */
        colibri_q_unpack(type, b, j, lv);
        *v0 = vld1q_s8(lv);
        *v1 = vld1q_s8(lv + 16);
        return;
    }
}

/* sum v * q over 16 values, exact in int32. */
static inline int32_t colibri_q_dot16_neon(int8x16_t v, const int8_t *q)
{
    int8x16_t x = vld1q_s8(q);
    int32x4_t acc = vpaddlq_s16(vmull_s8(vget_low_s8(v), vget_low_s8(x)));
    acc = vpadalq_s16(acc, vmull_high_s8(v, x));
    return vaddvq_s32(acc);
}

static void colibri_q_dot_neon(int type, const uint8_t *w, const uint8_t *e, int32_t K,
                               const float *d, const int8_t *q, const int32_t *s, int32_t nb,
                               float *y, int64_t ldy)
{
    float lanes[COLIBRI_Q_ROW_BLOCK][COLIBRI_Q_LANES];
    const int32_t subs = colibri_q_block[type] / 32, G = K / 32;
    int32_t g, r;
    memset(lanes, 0, sizeof lanes);
    for (g = 0; g < G; g++) {
        const uint8_t *b = w + (size_t)(g / subs) * (size_t)colibri_q_bytes[type];
        const int32_t j = g % subs;
        int8x16_t v0, v1;
        colibri_q_unpack_neon(type, b, j, &v0, &v1);
        for (r = 0; r < nb; r++) {
            const int8_t *qr = q + (size_t)r * K + 32 * g;
            int32_t a = colibri_q_dot16_neon(v0, qr), c = colibri_q_dot16_neon(v1, qr + 16);
            int32_t isum = type == COLIBRI_Q6_K
                               ? (int8_t)b[192 + 2 * j] * a + (int8_t)b[192 + 2 * j + 1] * c
                               : a + c;
            lanes[r][g % COLIBRI_Q_LANES] +=
                colibri_q_term(type, colibri_q_scale_at(type, w, e, g / subs), j, isum,
                               d[r * G + g], s[r * G + g]);
        }
    }
    for (r = 0; r < nb; r++)
        y[r * ldy] = colibri_q_lanes_sum(lanes[r]);
}

#endif /* COLIBRI_QUANT_NEON_H */
