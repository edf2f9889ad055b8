/*
 * Attention of a few query rows over a key/value cache, for decoding steps
 * (colibri/layer/_attention.pyx): out[t, h] = sum_j p[h, t, j] v[h / G, j] with
 * p = softmax_j(scale * q[h, t] . k[h / G, j] + mask[t, j]), G = Hq / Hkv query heads a
 * key/value head.
 *
 * One key/value head at a time: its G * T query rows are scored against each key row (read
 * and converted to float32 once), then each value row (read once) is added to every query
 * row's sum. One body, compiled for AVX2 (x86 with GCC or clang: the AVX-512 paths take it
 * too, its eight-lane sums fill a 256-bit register; 512-bit code was slower on Zen 4: 181 us
 * against 117 at 512 keys) and for the build's base; each does the same float operations in
 * the same order (eight running sums a dot product, added pairwise; -ffp-contract=off: no
 * fused multiply-add), so every path gives the same bits. Plain C99 plus a target
 * attribute, header-only.
 */
#ifndef COLIBRI_ATTENTION_H
#define COLIBRI_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "colibri/cpu.h"
#include "colibri/half.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define COLIBRI_ATTEND_X86 1
#endif
#if defined(__GNUC__) || defined(__clang__)
#define COLIBRI_ATTEND_INLINE inline __attribute__((always_inline))
#else
#define COLIBRI_ATTEND_INLINE inline
#endif

/* One call: q [Hq, T, D], k and v [Hkv, L, D], out [T, Hq, D], all stored as kind says
 * (0: float32; COLIBRI_W_F16 / COLIBRI_W_BF16: uint16 bits); mask [T, L] float32 or NULL. */
typedef struct {
    const void *q, *k, *v;
    const float *mask;
    void *out;
    int64_t Hq, Hkv, T, L, D;
    float scale;
    int kind;
} colibri_attend_t;

/* n values of src from index at, as float32 (half types converted exactly). */
static COLIBRI_ATTEND_INLINE void colibri_attend_load(const void *src, int64_t at, int64_t n,
                                                      int kind, float *dst)
{
    int64_t i;
    if (kind == COLIBRI_W_BF16) {
        const uint16_t *s = (const uint16_t *)src + at;
        for (i = 0; i < n; i++)
            dst[i] = colibri_bf16_to_float(s[i]);
    } else if (kind == COLIBRI_W_F16) {
        const uint16_t *s = (const uint16_t *)src + at;
        for (i = 0; i < n; i++)
            dst[i] = colibri_half_to_float_fast(s[i]);
    } else {
        memcpy(dst, (const float *)src + at, (size_t)n * sizeof(float));
    }
}

static COLIBRI_ATTEND_INLINE void colibri_attend_store(void *dst, int64_t at, float f, int kind)
{
    if (kind == COLIBRI_W_BF16)
        ((uint16_t *)dst)[at] = colibri_float_to_bf16(f);
    else if (kind == COLIBRI_W_F16)
        ((uint16_t *)dst)[at] = colibri_float_to_half(f);
    else
        ((float *)dst)[at] = f;
}

/* a . b in eight running sums, added pairwise. */
static COLIBRI_ATTEND_INLINE float colibri_attend_dot(const float *a, const float *b, int64_t n)
{
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    int l;
    for (; i + 8 <= n; i += 8)
        for (l = 0; l < 8; l++)
            s[l] += a[i + l] * b[i + l];
    for (; i < n; i++)
        s[0] += a[i] * b[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* The kernel; buf: (G T L + 2 G T D + D + G T) floats of scratch. */
static COLIBRI_ATTEND_INLINE void colibri_attend_body(const colibri_attend_t *a, float *buf)
{
    const int64_t G = a->Hq / a->Hkv, T = a->T, L = a->L, D = a->D, R = G * T;
    float *s = buf;           /* [R, L]: scores, then their exponentials */
    float *qf = s + R * L;    /* [R, D] */
    float *acc = qf + R * D;  /* [R, D] */
    float *row = acc + R * D; /* [D]: a key or value row as float32 */
    float *total = row + D;   /* [R] */
    int64_t g, r, j, d;
    for (g = 0; g < a->Hkv; g++) {
        for (r = 0; r < R; r++) /* row r: head g G + r / T, query r % T */
            colibri_attend_load(a->q, ((g * G + r / T) * T + r % T) * D, D, a->kind, &qf[r * D]);
        for (j = 0; j < L; j++) {
            colibri_attend_load(a->k, (g * L + j) * D, D, a->kind, row);
            for (r = 0; r < R; r++) {
                float x = colibri_attend_dot(&qf[r * D], row, D) * a->scale;
                if (a->mask != NULL)
                    x = x + a->mask[(r % T) * L + j];
                s[r * L + j] = x;
            }
        }
        for (r = 0; r < R; r++) {
            float m = -INFINITY, sum = 0;
            float *sr = &s[r * L];
            for (j = 0; j < L; j++)
                if (sr[j] > m)
                    m = sr[j];
            for (j = 0; j < L; j++) {
                float p = m != -INFINITY ? expf(sr[j] - m) : 0.0f;
                sr[j] = p;
                sum = sum + p;
            }
            total[r] = sum;
        }
        memset(acc, 0, (size_t)(R * D) * sizeof(float));
        for (j = 0; j < L; j++) {
            colibri_attend_load(a->v, (g * L + j) * D, D, a->kind, row);
            for (r = 0; r < R; r++) {
                const float p = s[r * L + j];
                float *ar = &acc[r * D];
                for (d = 0; d < D; d++)
                    ar[d] += p * row[d];
            }
        }
        for (r = 0; r < R; r++) {
            const float sum = total[r];
            const int64_t at = ((r % T) * a->Hq + g * G + r / T) * D;
            for (d = 0; d < D; d++)
                colibri_attend_store(a->out, at + d, sum != 0 ? acc[r * D + d] / sum : 0.0f,
                                     a->kind);
        }
    }
}

#ifdef COLIBRI_ATTEND_X86
__attribute__((target("avx2,f16c"))) static void colibri_attend_avx2(const colibri_attend_t *a,
                                                                     float *buf)
{
    colibri_attend_body(a, buf);
}
#endif

static void colibri_attend_base(const colibri_attend_t *a, float *buf)
{
    colibri_attend_body(a, buf);
}

/* Runs the call on path (cpu.h's COLIBRI_PATH_*: AVX2 and up, else the build's base); 0, or
 * -1 when scratch memory is short. */
static inline int colibri_attend(const colibri_attend_t *a, int path)
{
    const int64_t R = a->Hq / a->Hkv * a->T;
    float *buf = (float *)malloc((size_t)(R * a->L + 2 * R * a->D + a->D + R) * sizeof(float));
    if (buf == NULL)
        return -1;
#ifdef COLIBRI_ATTEND_X86
    if (path >= COLIBRI_PATH_AVX2 && path != COLIBRI_PATH_NEON)
        colibri_attend_avx2(a, buf);
    else
        colibri_attend_base(a, buf);
#else
    (void)path;
    colibri_attend_base(a, buf);
#endif
    free(buf);
    return 0;
}

#endif /* COLIBRI_ATTENTION_H */
