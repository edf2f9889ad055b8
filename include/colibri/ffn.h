/*
 * colibri's gated-FFN expert kernel for half-precision weights, for a few rows at a time:
 *
 *     y[r] = down @ (act(gate @ x[r]) * (up @ x[r]))      r < n (1 to ~16 rows)
 *
 * gate, up [I, H] and down [H, I] in float16 or bfloat16 (each row contiguous, any row
 * stride), x [n, H] and y [n, H] float32. Every weight is read once, in its stored dtype,
 * and multiplied in float32 (products exact, float32 accumulation): at batch 1 the kernel
 * runs at the speed memory delivers the weights. Two passes over chunks of output rows
 * (colibri/pool.h runs them on the caller and its helpers): gate and up (the activation
 * fused), then down.
 *
 * SIMD paths (colibri/cpu.h picks one at run time): AVX-512 (16 lanes; with AVX512_BF16,
 * bfloat16 weights go through native bf16 dot products on x split into two bfloat16 parts,
 * hi + lo, which carry 16 of x's 24 significand bits), AVX2 + F16C + FMA (8 lanes), NEON
 * (4 lanes) and plain C. Paths differ only in summation order: each is within the bound
 * test_kernels.py states of a float64 reference. The dot products (colibri_dot_rows) serve
 * colibri/linear.h too.
 */
#ifndef COLIBRI_FFN_H
#define COLIBRI_FFN_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "colibri/cpu.h"
#include "colibri/half.h"
#include "colibri/pool.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define COLIBRI_FFN_X86 1
#define COLIBRI_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define COLIBRI_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define COLIBRI_TARGET_AVX512BF16 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define COLIBRI_FFN_NEON 1
#endif

enum {
    COLIBRI_ACT_SILU = 0,
    COLIBRI_ACT_GELU_TANH = 1,
    COLIBRI_ACT_GELU = 2,
    COLIBRI_ACT_RELU = 3
};

/* Most rows one call takes (per-row scratch lives on the stack). */
#define COLIBRI_FFN_MAX_ROWS 64

#if defined(__GNUC__) || defined(__clang__)
#define COLIBRI_INLINE inline __attribute__((always_inline)) /* nb, kind: constants */
#else
#define COLIBRI_INLINE inline
#endif

/* Rows of x handled together against one weight row (each keeps two accumulators). */
#define COLIBRI_FFN_ROW_BLOCK 4

typedef struct {
    int32_t n, H, I; /* rows, hidden size, intermediate size */
    int32_t kind;    /* COLIBRI_W_F16 or COLIBRI_W_BF16 */
    int32_t act;     /* COLIBRI_ACT_* */
    int32_t path;    /* COLIBRI_PATH_* (one this CPU runs) */
    const float *x;  /* [n, H], row stride ldx */
    int64_t ldx;
    const uint16_t *gate, *up; /* [I, H], row strides ldg, ldu (elements) */
    int64_t ldg, ldu;
    const uint16_t *down; /* [H, I], row stride ldd */
    int64_t ldd;
    float *h;     /* scratch [n, I]: act(gate x) * (up x) */
    uint16_t *xs; /* scratch for the bf16 path: [2, n, H] and [2, n, I] */
    float *y;     /* [n, H], row stride ldy */
    int64_t ldy;
    /* set by colibri_ffn_run_many: output rows of one chunk of the pool, in each pass */
    int32_t gate_up_rows, down_rows;
} colibri_ffn_t;

static inline float colibri_w_to_float(int kind, uint16_t w)
{
    return kind == COLIBRI_W_BF16 ? colibri_bf16_to_float(w) : colibri_half_to_float(w);
}

/* ---- one weight row against nb <= 4 rows of x: y[r * ldy] = w . x[r * ldx] ---------- */

static inline void colibri_dot_scalar(int kind, const uint16_t *w, int32_t K, const float *x,
                                      int64_t ldx, int32_t nb, float *y, int64_t ldy)
{
    float acc[COLIBRI_FFN_ROW_BLOCK] = {0.0f, 0.0f, 0.0f, 0.0f};
    int32_t k, r;
    for (k = 0; k < K; k++) {
        float v = colibri_w_to_float(kind, w[k]);
        for (r = 0; r < nb; r++)
            acc[r] += v * x[r * ldx + k];
    }
    for (r = 0; r < nb; r++)
        y[r * ldy] = acc[r];
}

/* Calls fn with kind and nb as constants (the compiler specializes each). */
#define COLIBRI_DOT_CASES(fn)                           \
    if (kind == COLIBRI_W_F16) {                        \
        switch (nb) {                                   \
        case 1:                                         \
            fn(COLIBRI_W_F16, w, K, x, ldx, 1, y, ldy); \
            return;                                     \
        case 2:                                         \
            fn(COLIBRI_W_F16, w, K, x, ldx, 2, y, ldy); \
            return;                                     \
        case 3:                                         \
            fn(COLIBRI_W_F16, w, K, x, ldx, 3, y, ldy); \
            return;                                     \
        default:                                        \
            fn(COLIBRI_W_F16, w, K, x, ldx, 4, y, ldy); \
            return;                                     \
        }                                               \
    }                                                   \
    switch (nb) {                                       \
    case 1:                                             \
        fn(COLIBRI_W_BF16, w, K, x, ldx, 1, y, ldy);    \
        return;                                         \
    case 2:                                             \
        fn(COLIBRI_W_BF16, w, K, x, ldx, 2, y, ldy);    \
        return;                                         \
    case 3:                                             \
        fn(COLIBRI_W_BF16, w, K, x, ldx, 3, y, ldy);    \
        return;                                         \
    default:                                            \
        fn(COLIBRI_W_BF16, w, K, x, ldx, 4, y, ldy);    \
        return;                                         \
    }

#ifdef COLIBRI_FFN_X86
COLIBRI_TARGET_AVX2 static COLIBRI_INLINE __m256 colibri_load8w(int kind, const uint16_t *p)
{
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    if (kind == COLIBRI_W_F16)
        return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

COLIBRI_TARGET_AVX2 static inline float colibri_hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* kind and nb are constants where this is inlined (colibri_dot_avx2 below). */
COLIBRI_TARGET_AVX2 static COLIBRI_INLINE void colibri_dot_avx2_nb(int kind, const uint16_t *w,
                                                                   int32_t K, const float *x,
                                                                   int64_t ldx, int32_t nb,
                                                                   float *y, int64_t ldy)
{
    __m256 a[COLIBRI_FFN_ROW_BLOCK], b[COLIBRI_FFN_ROW_BLOCK];
    int32_t k = 0, r;
    for (r = 0; r < nb; r++)
        a[r] = b[r] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = colibri_load8w(kind, w + k), w1 = colibri_load8w(kind, w + k + 8);
        for (r = 0; r < nb; r++) {
            a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), a[r]);
            b[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + k + 8), b[r]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 w0 = colibri_load8w(kind, w + k);
        for (r = 0; r < nb; r++)
            a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), a[r]);
    }
    for (r = 0; r < nb; r++) {
        float s = colibri_hsum8(_mm256_add_ps(a[r], b[r]));
        int32_t t;
        for (t = k; t < K; t++)
            s += colibri_w_to_float(kind, w[t]) * x[r * ldx + t];
        y[r * ldy] = s;
    }
}

COLIBRI_TARGET_AVX2 static void
colibri_dot_avx2(int kind, const uint16_t *w, int32_t K, const float *x, int64_t ldx, int32_t nb,
                 float *y, int64_t ldy){COLIBRI_DOT_CASES(colibri_dot_avx2_nb)}

/* Bytes ahead of the weights' read position that the AVX-512 dot products prefetch (into
 * L1, as the quantized kernels do): a row at a time, the hardware prefetchers alone left two
 * threads at ~0.73x of a read pass over f16 weights. A 2-core Sapphire Rapids, one row, 2
 * threads: a [1024, 1024] f16 linear over 200 distinct weights 130 -> 102-108 us, [3072,
 * 1024] 350 -> 258-284 us (22-24 GB/s against a 23.9 GB/s read pass), bfloat16 on the
 * avx512_bf16 path alike; one thread unchanged. The AVX2 path (the default of AMD's Zen 3
 * and Zen 4) has none: on a Zen 4, one row, 2 threads, the same prefetch once a cache line
 * slowed it (f16 [3072, 1024] 144-217 -> 198-251 us with T0, 165-217 -> 200-223 with NTA,
 * builds alternating), its own prefetchers already near the read pass (30-36 GB/s, 33); NTA
 * for one row only, to keep the caller's lines in L3 as the quantized kernels' AVX2 path
 * does, sped whole f16 tokens in one series of interleaved runs and slowed them in the next
 * (bench/README.md, "Back on a Zen 4"). */
#ifndef COLIBRI_HALF_PREFETCH
#define COLIBRI_HALF_PREFETCH 2048
#endif
COLIBRI_TARGET_AVX512 static COLIBRI_INLINE __m512 colibri_load16w(int kind, const uint16_t *p)
{
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    if (kind == COLIBRI_W_F16)
        return _mm512_cvtph_ps(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

COLIBRI_TARGET_AVX512 static COLIBRI_INLINE void colibri_dot_avx512_nb(int kind, const uint16_t *w,
                                                                       int32_t K, const float *x,
                                                                       int64_t ldx, int32_t nb,
                                                                       float *y, int64_t ldy)
{
    __m512 a[COLIBRI_FFN_ROW_BLOCK], b[COLIBRI_FFN_ROW_BLOCK];
    int32_t k = 0, r;
    for (r = 0; r < nb; r++)
        a[r] = b[r] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        __m512 w0 = colibri_load16w(kind, w + k), w1 = colibri_load16w(kind, w + k + 16);
        _mm_prefetch((const char *)(w + k) + COLIBRI_HALF_PREFETCH, _MM_HINT_T0);
        for (r = 0; r < nb; r++) {
            a[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * ldx + k), a[r]);
            b[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * ldx + k + 16), b[r]);
        }
    }
    if (k < K) { /* the last 1-31: masked loads read nothing past the row */
        __mmask16 m0 = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        __mmask16 m1 = K - k <= 16 ? 0 : (__mmask16)((1u << (K - k - 16)) - 1);
        __m256i v0 = _mm256_maskz_loadu_epi16(m0, w + k);
        __m256i v1 = _mm256_maskz_loadu_epi16(m1, w + k + 16);
        __m512 w0, w1;
        if (kind == COLIBRI_W_F16) {
            w0 = _mm512_cvtph_ps(v0);
            w1 = _mm512_cvtph_ps(v1);
        } else {
            w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v0), 16));
            w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v1), 16));
        }
        for (r = 0; r < nb; r++) {
            a[r] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m0, x + r * ldx + k), a[r]);
            b[r] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(m1, x + r * ldx + k + 16), b[r]);
        }
    }
    for (r = 0; r < nb; r++)
        y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(a[r], b[r]));
}

COLIBRI_TARGET_AVX512 static void
colibri_dot_avx512(int kind, const uint16_t *w, int32_t K, const float *x, int64_t ldx, int32_t nb,
                   float *y, int64_t ldy){COLIBRI_DOT_CASES(colibri_dot_avx512_nb)}

/* bfloat16 weights against x = xh + xl (both bfloat16, [nb, K] at row stride ldx, K even
 * in the vector part): two native bf16 dot products per 32 weights. */
COLIBRI_TARGET_AVX512BF16 static COLIBRI_INLINE
    void colibri_dot_bf16_nb(const uint16_t *w, int32_t K, const uint16_t *xh, const uint16_t *xl,
                             int64_t ldx, int32_t nb, float *y, int64_t ldy)
{
    __m512 a[COLIBRI_FFN_ROW_BLOCK], b[COLIBRI_FFN_ROW_BLOCK];
    int32_t k = 0, r;
    for (r = 0; r < nb; r++)
        a[r] = b[r] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + k));
        _mm_prefetch((const char *)(w + k) + COLIBRI_HALF_PREFETCH, _MM_HINT_T0);
        for (r = 0; r < nb; r++) {
            a[r] = _mm512_dpbf16_ps(a[r], wv, (__m512bh)_mm512_loadu_si512(xh + r * ldx + k));
            b[r] = _mm512_dpbf16_ps(b[r], wv, (__m512bh)_mm512_loadu_si512(xl + r * ldx + k));
        }
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);
        for (r = 0; r < nb; r++) {
            a[r] =
                _mm512_dpbf16_ps(a[r], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, xh + r * ldx + k));
            b[r] =
                _mm512_dpbf16_ps(b[r], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, xl + r * ldx + k));
        }
    }
    for (r = 0; r < nb; r++)
        y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(a[r], b[r]));
}

COLIBRI_TARGET_AVX512BF16 static void colibri_dot_bf16(const uint16_t *w, int32_t K,
                                                       const uint16_t *xh, const uint16_t *xl,
                                                       int64_t ldx, int32_t nb, float *y,
                                                       int64_t ldy)
{
    switch (nb) {
    case 1:
        colibri_dot_bf16_nb(w, K, xh, xl, ldx, 1, y, ldy);
        return;
    case 2:
        colibri_dot_bf16_nb(w, K, xh, xl, ldx, 2, y, ldy);
        return;
    case 3:
        colibri_dot_bf16_nb(w, K, xh, xl, ldx, 3, y, ldy);
        return;
    default:
        colibri_dot_bf16_nb(w, K, xh, xl, ldx, 4, y, ldy);
        return;
    }
}
#endif /* COLIBRI_FFN_X86 */

#ifdef COLIBRI_FFN_NEON
static COLIBRI_INLINE float32x4_t colibri_load4w(int kind, const uint16_t *p)
{
    uint16x4_t v = vld1_u16(p);
    if (kind == COLIBRI_W_F16)
        return vcvt_f32_f16(vreinterpret_f16_u16(v));
    return vreinterpretq_f32_u32(vshll_n_u16(v, 16));
}

static COLIBRI_INLINE void colibri_dot_neon_nb(int kind, const uint16_t *w, int32_t K,
                                               const float *x, int64_t ldx, int32_t nb, float *y,
                                               int64_t ldy)
{
    float32x4_t a[COLIBRI_FFN_ROW_BLOCK], b[COLIBRI_FFN_ROW_BLOCK];
    int32_t k = 0, r;
    for (r = 0; r < nb; r++)
        a[r] = b[r] = vdupq_n_f32(0.0f);
    for (; k + 8 <= K; k += 8) {
        float32x4_t w0 = colibri_load4w(kind, w + k), w1 = colibri_load4w(kind, w + k + 4);
        for (r = 0; r < nb; r++) {
            a[r] = vfmaq_f32(a[r], w0, vld1q_f32(x + r * ldx + k));
            b[r] = vfmaq_f32(b[r], w1, vld1q_f32(x + r * ldx + k + 4));
        }
    }
    for (r = 0; r < nb; r++) {
        float s = vaddvq_f32(vaddq_f32(a[r], b[r]));
        int32_t t;
        for (t = k; t < K; t++)
            s += colibri_w_to_float(kind, w[t]) * x[r * ldx + t];
        y[r * ldy] = s;
    }
}

static void colibri_dot_neon(int kind, const uint16_t *w, int32_t K, const float *x, int64_t ldx,
                             int32_t nb, float *y, int64_t ldy)
{
    COLIBRI_DOT_CASES(colibri_dot_neon_nb)
}
#endif

/* One weight row (`kind`, K elements) against all n rows of x on SIMD path `path` (blocks
 * of 4 rows; the row stays in L1): y[r * ldy] = w . x[r * ldx]. On the avx512_bf16 path
 * with bfloat16 weights, xs holds x split as colibri_split_rows writes it ([2, n, K]). */
static inline void colibri_dot_rows(int path, int kind, int32_t n, const uint16_t *w, int32_t K,
                                    const float *x, int64_t ldx, const uint16_t *xs, float *y,
                                    int64_t ldy)
{
    int32_t r, nb;
    for (r = 0; r < n; r += nb) {
        nb = n - r < COLIBRI_FFN_ROW_BLOCK ? n - r : COLIBRI_FFN_ROW_BLOCK;
        switch (path) {
#ifdef COLIBRI_FFN_X86
        case COLIBRI_PATH_AVX512_BF16:
            if (kind == COLIBRI_W_BF16) {
                colibri_dot_bf16(w, K, xs + r * (int64_t)K, xs + (n + r) * (int64_t)K, K, nb,
                                 y + r * ldy, ldy);
                break;
            }
            colibri_dot_avx512(kind, w, K, x + r * ldx, ldx, nb, y + r * ldy, ldy);
            break;
        case COLIBRI_PATH_AVX512:
            colibri_dot_avx512(kind, w, K, x + r * ldx, ldx, nb, y + r * ldy, ldy);
            break;
        case COLIBRI_PATH_AVX2:
            colibri_dot_avx2(kind, w, K, x + r * ldx, ldx, nb, y + r * ldy, ldy);
            break;
#endif
#ifdef COLIBRI_FFN_NEON
        case COLIBRI_PATH_NEON:
            colibri_dot_neon(kind, w, K, x + r * ldx, ldx, nb, y + r * ldy, ldy);
            break;
#endif
        default:
            colibri_dot_scalar(kind, w, K, x + r * ldx, ldx, nb, y + r * ldy, ldy);
        }
    }
}

/* ---- activation and the bf16 split -------------------------------------------------- */

static inline float colibri_act(int act, float g)
{
    switch (act) {
    case COLIBRI_ACT_SILU:
        return g / (1.0f + expf(-g));
    case COLIBRI_ACT_GELU_TANH:
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    case COLIBRI_ACT_GELU:
        return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
    default:
        return g > 0.0f ? g : 0.0f * g; /* relu (NaN stays NaN) */
    }
}

/* v as hi + lo, both bfloat16: hi = bf16(v), lo = bf16(v - hi) (|v - hi - lo| <= 2^-17 |v|). */
static inline void colibri_split_bf16(float v, uint16_t *hi, uint16_t *lo)
{
    uint16_t h = colibri_float_to_bf16(v);
    float rest = v - colibri_bf16_to_float(h);
    *hi = h;
    *lo = colibri_float_to_bf16(rest == rest ? rest : 0.0f); /* inf - inf: hi carries it */
}

/* Whether path and kind take x as two bfloat16 parts (the native bf16 dot products). */
static inline int colibri_uses_split(int path, int kind)
{
    return path == COLIBRI_PATH_AVX512_BF16 && kind == COLIBRI_W_BF16;
}

static inline int colibri_ffn_uses_split(const colibri_ffn_t *f)
{
    return colibri_uses_split(f->path, f->kind);
}

/* x [n, K] (row stride ldx) as xs[0:n K] = hi, xs[n K:2 n K] = lo (rows contiguous). */
static inline void colibri_split_rows(const float *x, int64_t ldx, int32_t n, int32_t K,
                                      uint16_t *xs)
{
    int64_t i;
    for (i = 0; i < (int64_t)n * K; i++) {
        int64_t r = i / K, k = i % K;
        colibri_split_bf16(x[r * ldx + k], xs + i, xs + (int64_t)n * K + i);
    }
}

/* ---- the two passes, by chunks of output rows -------------------------------------- */

/* h[r, o] = act(gate[o] . x[r]) * (up[o] . x[r]) for o in [o0, o1). */
static inline void colibri_ffn_gate_up(const colibri_ffn_t *f, int32_t o0, int32_t o1)
{
    const int32_t n = f->n, I = f->I;
    const uint16_t *xs = f->xs;
    uint16_t *hs = colibri_ffn_uses_split(f) ? f->xs + 2 * (int64_t)n * f->H : NULL;
    float g[COLIBRI_FFN_MAX_ROWS], u[COLIBRI_FFN_MAX_ROWS];
    int32_t o, r;
    for (o = o0; o < o1; o++) {
        colibri_dot_rows(f->path, f->kind, n, f->gate + o * f->ldg, f->H, f->x, f->ldx, xs, g, 1);
        colibri_dot_rows(f->path, f->kind, n, f->up + o * f->ldu, f->H, f->x, f->ldx, xs, u, 1);
        for (r = 0; r < n; r++) {
            float v = colibri_act(f->act, g[r]) * u[r];
            f->h[r * (int64_t)I + o] = v;
            if (hs != NULL)
                colibri_split_bf16(v, hs + r * (int64_t)I + o, hs + (n + r) * (int64_t)I + o);
        }
    }
}

/* y[r, o] = down[o] . h[r] for o in [o0, o1). */
static inline void colibri_ffn_down(const colibri_ffn_t *f, int32_t o0, int32_t o1)
{
    const uint16_t *hs = colibri_ffn_uses_split(f) ? f->xs + 2 * (int64_t)f->n * f->H : NULL;
    int32_t o;
    for (o = o0; o < o1; o++)
        colibri_dot_rows(f->path, f->kind, f->n, f->down + o * f->ldd, f->I, f->h, f->I, hs,
                         f->y + o, f->ldy);
}

/* Bytes of scratch f->xs needs (0 unless the bf16 path runs). */
static inline size_t colibri_ffn_split_bytes(const colibri_ffn_t *f)
{
    if (!colibri_ffn_uses_split(f))
        return 0;
    return 2 * sizeof(uint16_t) * (size_t)f->n * ((size_t)f->H + (size_t)f->I);
}

static void colibri_ffn_gate_up_chunk(void *arg, int32_t c)
{
    const colibri_ffn_t *f = (const colibri_ffn_t *)arg;
    const int32_t rows = f->gate_up_rows;
    colibri_ffn_gate_up(f, c * rows, (int64_t)(c + 1) * rows < f->I ? (c + 1) * rows : f->I);
}

static void colibri_ffn_down_chunk(void *arg, int32_t c)
{
    const colibri_ffn_t *f = (const colibri_ffn_t *)arg;
    const int32_t rows = f->down_rows;
    colibri_ffn_down(f, c * rows, (int64_t)(c + 1) * rows < f->H ? (c + 1) * rows : f->H);
}

/* Several experts' FFNs in two pool runs (gate/up, then down), their chunks in one index
 * space: one dispatch per pass for a whole layer's decoding step; each f[j] as for
 * colibri_ffn_run. */
/* first must hold count + 1 entries (scratch). Sets each f[j]'s chunk rows. */
static inline void colibri_ffn_run_many(colibri_ffn_t *f, int32_t count, int32_t *first,
                                        int threads)
{
    int32_t j;
    int64_t gate_up = 0, down = 0;
    if (count < 1)
        return;
    for (j = 0; j < count; j++) {
        if (colibri_ffn_uses_split(&f[j]))
            colibri_split_rows(f[j].x, f[j].ldx, f[j].n, f[j].H, f[j].xs);
        gate_up += 4 * (int64_t)f[j].I * f[j].H; /* two bytes a weight */
        down += 2 * (int64_t)f[j].H * f[j].I;
    }
    first[0] = 0;
    for (j = 0; j < count; j++) {
        f[j].gate_up_rows = colibri_pool_chunk_rows(colibri_pool_chunk_bytes(gate_up, threads),
                                                    4 * (int64_t)f[j].H, 1);
        first[j + 1] = first[j] + (f[j].I + f[j].gate_up_rows - 1) / f[j].gate_up_rows;
    }
    colibri_pool_run_many(colibri_ffn_gate_up_chunk, f, sizeof *f, count, first, threads);
    first[0] = 0;
    for (j = 0; j < count; j++) {
        f[j].down_rows = colibri_pool_chunk_rows(colibri_pool_chunk_bytes(down, threads),
                                                 2 * (int64_t)f[j].I, 1);
        first[j + 1] = first[j] + (f[j].H + f[j].down_rows - 1) / f[j].down_rows;
    }
    colibri_pool_run_many(colibri_ffn_down_chunk, f, sizeof *f, count, first, threads);
}

/* One expert: both passes on up to `threads` threads (colibri/pool.h: the caller claims
 * chunks too, and never waits for a helper that has not started). f->xs must hold
 * colibri_ffn_split_bytes(f) bytes. */
static inline void colibri_ffn_run(colibri_ffn_t *f, int threads)
{
    int32_t first[2];
    colibri_ffn_run_many(f, 1, first, threads);
}

#endif /* COLIBRI_FFN_H */
