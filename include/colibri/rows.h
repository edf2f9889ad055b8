/*
 * A decoding step's row kernels: RMSNorm (colibri/layer/_norm.pyx states the formula) and the
 * rotary embedding (colibri/layer/_rope.pyx's), over values stored as float32 or the uint16 bits
 * of a half kind (half.h).
 *
 * RMSNorm: y = w * round(x * r) with r = 1 / sqrt(mean(x^2) + eps), y may be x; the squares
 * summed exactly in double, in four running sums (value i into sum i % 4, the tail into the
 * first), added pairwise; r is 1.0 / sqrtf in double, rounded once, as torch's rsqrt rounds it.
 * Rotary: x[i] = round(round(x[i] c[i]) + round(-x[i + d/2] s[i])), x[i + d/2] =
 * round(round(x[i + d/2] c[i + d/2]) + round(x[i] s[i + d/2])), in place.
 *
 * The AVX2 code (F16C for float16) does the base's operations in the same order, so every path
 * gives the same bits: RMSNorm's four sums are one register of doubles; its roundings are
 * half.h's (to nearest even, NaN kept quiet; F16C's conversions give half.h's float16 bits,
 * NaNs included). One layer's norms and rotations of a decoding step on a Zen 4 took ~18 us of
 * its ~100 as scalar loops. Header-only.
 */
#ifndef COLIBRI_ROWS_H
#define COLIBRI_ROWS_H

#include <math.h>
#include <stdint.h>

#include "colibri/cpu.h"
#include "colibri/half.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define COLIBRI_ROWS_X86 1
#include <immintrin.h>
#define COLIBRI_ROWS_AVX2 __attribute__((target("avx2,f16c")))
#endif

static inline float colibri_rows_load(const void *p, int64_t i, int kind)
{
    if (kind == COLIBRI_W_BF16)
        return colibri_bf16_to_float(((const uint16_t *)p)[i]);
    if (kind == COLIBRI_W_F16)
        return colibri_half_to_float(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* Stores f at p[i] in the storage type; returns the stored value as float32. */
static inline float colibri_rows_store(void *p, int64_t i, float f, int kind)
{
    if (kind == COLIBRI_W_BF16) {
        ((uint16_t *)p)[i] = colibri_float_to_bf16(f);
        return colibri_bf16_to_float(((uint16_t *)p)[i]);
    }
    if (kind == COLIBRI_W_F16) {
        ((uint16_t *)p)[i] = colibri_float_to_half(f);
        return colibri_half_to_float(((uint16_t *)p)[i]);
    }
    ((float *)p)[i] = f;
    return f;
}

/* r of a row's n values: 1.0 / sqrtf(mean + eps), the mean from the four sums. */
static inline float colibri_norm_scale(const double *s, int64_t n, float eps)
{
    const float v = (float)(((s[0] + s[1]) + (s[2] + s[3])) / (double)n);
    return (float)(1.0 / (double)sqrtf(v + eps));
}

/* The four sums of the squares of values i .. n - 1 of the row at x + at, continued in s
 * (products of floats are exact in double). */
static inline void colibri_norm_squares(const void *x, int64_t at, int64_t i, int64_t n, int kind,
                                        double *s)
{
    float h;
    for (; i + 4 <= n; i += 4) {
        int l;
        for (l = 0; l < 4; l++) {
            h = colibri_rows_load(x, at + i + l, kind);
            s[l] += (double)h * h;
        }
    }
    for (; i < n; i++) {
        h = colibri_rows_load(x, at + i, kind);
        s[0] += (double)h * h;
    }
}

/* y = w * round(x * r) for values i .. n - 1 of the row at x + at (y + at). */
static inline void colibri_norm_apply(const void *x, const void *w, int64_t at, int64_t i,
                                      int64_t n, float r, void *y, int kind)
{
    for (; i < n; i++) {
        const float h = colibri_rows_store(y, at + i, colibri_rows_load(x, at + i, kind) * r, kind);
        colibri_rows_store(y, at + i, colibri_rows_load(w, i, kind) * h, kind);
    }
}

static inline void colibri_norm_rows_base(const void *x, const void *w, int64_t T, int64_t n,
                                          float eps, void *y, int kind)
{
    int64_t t;
    for (t = 0; t < T; t++) {
        double s[4] = {0, 0, 0, 0};
        colibri_norm_squares(x, t * n, 0, n, kind, s);
        colibri_norm_apply(x, w, t * n, 0, n, colibri_norm_scale(s, n, eps), y, kind);
    }
}

/* The rotary embedding of the R rows of d values at x (d even) by cos, sin [d], in place. */
static inline void colibri_rope_rows_base(void *x, const void *cos, const void *sin, int64_t R,
                                          int64_t d, int kind)
{
    const int64_t half = d / 2;
    uint16_t t[1];
    float u[1];
    void *tmp = kind == 0 ? (void *)u : (void *)t;
    int64_t r, i;
    for (r = 0; r < R; r++) {
        const int64_t at = r * d;
        for (i = 0; i < half; i++) {
            const float a = colibri_rows_load(x, at + i, kind); /* its partner: -x[i + half] */
            const float b = colibri_rows_load(x, at + i + half, kind);
            float c = colibri_rows_load(cos, i, kind), s = colibri_rows_load(sin, i, kind);
            const float lo =
                colibri_rows_store(tmp, 0, a * c, kind) + colibri_rows_store(tmp, 0, -b * s, kind);
            float hi;
            c = colibri_rows_load(cos, i + half, kind);
            s = colibri_rows_load(sin, i + half, kind);
            hi = colibri_rows_store(tmp, 0, b * c, kind) + colibri_rows_store(tmp, 0, a * s, kind);
            colibri_rows_store(x, at + i, lo, kind);
            colibri_rows_store(x, at + i + half, hi, kind);
        }
    }
}

#ifdef COLIBRI_ROWS_X86
/* Eight float32 values rounded to a half kind's bits (colibri_float_to_bf16 /
 * colibri_float_to_half's). */
COLIBRI_ROWS_AVX2 static inline __m128i colibri_rows_half8(__m256 f, int kind)
{
    if (kind == COLIBRI_W_F16)
        return _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    {
        const __m256i x = _mm256_castps_si256(f);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
        const __m256i b = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
        const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
        const __m256i h = _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(b), _mm256_castsi256_ps(quiet), _mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
        return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    }
}

/* Eight half bits as float32 (exact). */
COLIBRI_ROWS_AVX2 static inline __m256 colibri_rows_float8(__m128i h, int kind)
{
    if (kind == COLIBRI_W_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Eight values at p + i as float32. */
COLIBRI_ROWS_AVX2 static inline __m256 colibri_rows_load8(const void *p, int64_t i, int kind)
{
    if (kind == 0)
        return _mm256_loadu_ps((const float *)p + i);
    return colibri_rows_float8(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)), kind);
}

/* Eight values rounded to the storage type (kind 0: as they are). */
COLIBRI_ROWS_AVX2 static inline __m256 colibri_rows_round8(__m256 f, int kind)
{
    return kind == 0 ? f : colibri_rows_float8(colibri_rows_half8(f, kind), kind);
}

/* Eight values rounded to the storage type and stored at p + i; returns them as float32. */
COLIBRI_ROWS_AVX2 static inline __m256 colibri_rows_store8(void *p, int64_t i, __m256 f, int kind)
{
    __m128i h;
    if (kind == 0) {
        _mm256_storeu_ps((float *)p + i, f);
        return f;
    }
    h = colibri_rows_half8(f, kind);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
    return colibri_rows_float8(h, kind);
}

COLIBRI_ROWS_AVX2 static void colibri_norm_rows_avx2(const void *x, const void *w, int64_t T,
                                                     int64_t n, float eps, void *y, int kind)
{
    int64_t t, i;
    for (t = 0; t < T; t++) {
        const int64_t at = t * n;
        double s[4];
        __m256d acc = _mm256_setzero_pd(); /* lane l: the sum of values i % 4 == l */
        __m256 r;
        float h;
        for (i = 0; i + 8 <= n; i += 8) {
            const __m256 v = colibri_rows_load8(x, at + i, kind);
            const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
            acc = _mm256_add_pd(acc, _mm256_mul_pd(lo, lo));
            acc = _mm256_add_pd(acc, _mm256_mul_pd(hi, hi));
        }
        _mm256_storeu_pd(s, acc);
        colibri_norm_squares(x, at, i, n, kind, s);
        h = colibri_norm_scale(s, n, eps);
        r = _mm256_set1_ps(h);
        for (i = 0; i + 8 <= n; i += 8) {
            const __m256 v = colibri_rows_store8(
                y, at + i, _mm256_mul_ps(colibri_rows_load8(x, at + i, kind), r), kind);
            colibri_rows_store8(y, at + i, _mm256_mul_ps(colibri_rows_load8(w, i, kind), v), kind);
        }
        colibri_norm_apply(x, w, at, i, n, h, y, kind);
    }
}

COLIBRI_ROWS_AVX2 static void colibri_rope_rows_avx2(void *x, const void *cos, const void *sin,
                                                     int64_t R, int64_t d, int kind)
{
    const int64_t half = d / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t r, i;
    if (half % 8) {
        colibri_rope_rows_base(x, cos, sin, R, d, kind);
        return;
    }
    for (r = 0; r < R; r++) {
        const int64_t at = r * d;
        for (i = 0; i < half; i += 8) {
            const __m256 a = colibri_rows_load8(x, at + i, kind);
            const __m256 b = colibri_rows_load8(x, at + i + half, kind);
            const __m256 lo = _mm256_add_ps(
                colibri_rows_round8(_mm256_mul_ps(a, colibri_rows_load8(cos, i, kind)), kind),
                colibri_rows_round8(
                    _mm256_mul_ps(_mm256_xor_ps(b, sign), colibri_rows_load8(sin, i, kind)), kind));
            const __m256 hi =
                _mm256_add_ps(colibri_rows_round8(
                                  _mm256_mul_ps(b, colibri_rows_load8(cos, i + half, kind)), kind),
                              colibri_rows_round8(
                                  _mm256_mul_ps(a, colibri_rows_load8(sin, i + half, kind)), kind));
            colibri_rows_store8(x, at + i, lo, kind);
            colibri_rows_store8(x, at + i + half, hi, kind);
        }
    }
}
#endif

/* The T rows of n values at x, normed by weight w [n], into y (may be x), on SIMD path `path`
 * (cpu.h's COLIBRI_PATH_*: AVX2 and up on x86, else the base); kind: 0 for float32, else
 * half.h's COLIBRI_W_F16 / COLIBRI_W_BF16. */
static inline void colibri_norm_rows(const void *x, const void *w, int64_t T, int64_t n, float eps,
                                     void *y, int kind, int path)
{
#ifdef COLIBRI_ROWS_X86
    if (path >= COLIBRI_PATH_AVX2 && path != COLIBRI_PATH_NEON) {
        colibri_norm_rows_avx2(x, w, T, n, eps, y, kind);
        return;
    }
#endif
    (void)path;
    colibri_norm_rows_base(x, w, T, n, eps, y, kind);
}

/* colibri_rope_rows_base on SIMD path `path`, as colibri_norm_rows takes it. */
static inline void colibri_rope_rows(void *x, const void *cos, const void *sin, int64_t R,
                                     int64_t d, int kind, int path)
{
#ifdef COLIBRI_ROWS_X86
    if (path >= COLIBRI_PATH_AVX2 && path != COLIBRI_PATH_NEON) {
        colibri_rope_rows_avx2(x, cos, sin, R, d, kind);
        return;
    }
#endif
    (void)path;
    colibri_rope_rows_base(x, cos, sin, R, d, kind);
}

#endif /* COLIBRI_ROWS_H */
