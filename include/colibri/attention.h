/*
 * Attention of a few query rows over a key/value cache, for decoding steps
 * (colibri/layer/_attention.pyx): out[t, h] = sum_j p[h, t, j] v[h / G, j] with
 * p = softmax_j(scale * q[h, t] . k[h / G, j] + mask[t, j]), G = Hq / Hkv query heads a
 * key/value head.
 *
 * One key/value head at a time: its G * T query rows are scored against blocks of eight key
 * rows (read and converted to float32 once), then each block of eight value rows (read once) is
 * added to every query row's sums, eight sums at a time held in registers across the block. The
 * heads are the chunks of colibri/pool.h's pool once a call is large enough
 * (COLIBRI_ATTEND_SPLIT): each head's values are the same whatever thread computes them. One
 * body (COLIBRI_ATTEND_BODY), compiled for AVX2 (x86 with GCC or clang: the AVX-512 paths take
 * it too, its eight-lane sums fill a 256-bit register; 512-bit code was slower on Zen 4: 181 us
 * against 117 at 512 keys; the AVX2 body scores eight keys side by side and adds their lanes
 * pairwise by horizontal adds) and for the build's base; each does the same float operations
 * in the same order (eight running sums a dot product, added pairwise; a value's sum over the
 * keys in their order; the exponentials' sum in eight running sums too; -ffp-contract=off: no
 * fused multiply-add), so every path gives the same bits. The scores' scaling, their
 * maximum and the division by the sum run eight at a time as well. 16 query heads of 64 over
 * 4 key/value heads, bfloat16, one thread of a Zen 4: 121 -> 47-53 us at 320 keys, 33 ->
 * 14-21 at 80, against one key at a time and libm's expf; then 36.5-41.7 -> 28.9-34.9 us at
 * 256 keys, 135-199 -> 112-139 at 1024, with the exponentials summed in eight lanes and the
 * per-key scalar loops vectorised (bench/bench_attention.py). Plain C99 plus target
 * attributes, header-only.
 */
#ifndef COLIBRI_ATTENTION_H
#define COLIBRI_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "colibri/cpu.h"
#include "colibri/half.h"
#include "colibri/pool.h"
#include "colibri/route.h" /* colibri_exp and its AVX2 lanes: the same bits */
#include "colibri/rows.h"  /* colibri_rows_store */

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define COLIBRI_ATTEND_X86 1
#endif
#if defined(__GNUC__) || defined(__clang__)
#define COLIBRI_ATTEND_INLINE inline __attribute__((always_inline))
#else
#define COLIBRI_ATTEND_INLINE inline
#endif

/* One call: q [Hq, T, D], k and v [Hkv, L, D] (head g's rows from g * ldk, g * ldv values
 * on: L * D when packed, more for a cache with room to grow), out [T, Hq, D], all stored as
 * kind says (0: float32; COLIBRI_W_F16 / COLIBRI_W_BF16: uint16 bits); mask [T, L] float32
 * or NULL; threads: the most threads (the caller and pool helpers) its heads run on. */
typedef struct {
    const void *q, *k, *v;
    const float *mask;
    void *out;
    int64_t Hq, Hkv, T, L, D, ldk, ldv;
    float scale;
    int kind;
    int threads;
} colibri_attend_t;

/* Query heads x rows x keys x head size from which a call's heads go to the pool: below,
 * a head's work (a few microseconds) is about what handing it to a helper costs. 16 query
 * heads of 64 over 4 key/value heads on a Zen 4, 2 threads: 12.7 -> 11.5 us at 32 keys,
 * 61 -> 38 at 216, 273 -> 159 at 1024; 8.5 -> 9.0 at 16. */
#define COLIBRI_ATTEND_SPLIT 32768

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
            dst[i] = colibri_half_to_float(s[i]);
    } else {
        memcpy(dst, (const float *)src + at, (size_t)n * sizeof(float));
    }
}

/* Eight running sums added pairwise: ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)). */
static COLIBRI_ATTEND_INLINE float colibri_attend_lanes(const float *s)
{
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
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
    return colibri_attend_lanes(s);
}

/* Keys and values are read COLIBRI_ATTEND_KEYS rows at a time (converted to float32 once). */
#define COLIBRI_ATTEND_KEYS 8

/* out[c] = a . b[c * n ..] for c < 8, each colibri_attend_dot's. */
static COLIBRI_ATTEND_INLINE void colibri_attend_dots(const float *a, const float *b, int64_t n,
                                                      float *out)
{
    int c;
    for (c = 0; c < COLIBRI_ATTEND_KEYS; c++)
        out[c] = colibri_attend_dot(a, b + c * n, n);
}

/* acc[d] = ((acc[d] + p[0] b[d]) + p[1] b[ld + d]) ... over the m rows of b, d < n. */
static COLIBRI_ATTEND_INLINE void colibri_attend_add_rows(float *acc, const float *p,
                                                          const float *b, int64_t m, int64_t n,
                                                          int64_t ld)
{
    int64_t c, d;
    for (d = 0; d < n; d++) {
        float t = acc[d];
        for (c = 0; c < m; c++)
            t += p[c] * b[c * ld + d];
        acc[d] = t;
    }
}

/* colibri_attend_add_rows of b [m, n]. */
static COLIBRI_ATTEND_INLINE void colibri_attend_add(float *acc, const float *p, const float *b,
                                                     int64_t m, int64_t n)
{
    colibri_attend_add_rows(acc, p, b, m, n, n);
}

/* exp(d), colibri_exp's bits; NaN stays NaN (colibri_exp clamps it). */
static COLIBRI_ATTEND_INLINE float colibri_attend_exp1(float d)
{
    return d != d ? d : colibri_exp(d);
}

/* x[0..n) summed in eight running sums (lane j % 8, in j's order), added pairwise: one sum's
 * adds would wait on each other. */
static COLIBRI_ATTEND_INLINE float colibri_attend_sum(const float *x, int64_t n)
{
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j;
    for (j = 0; j < n; j++)
        s[j % 8] += x[j];
    return colibri_attend_lanes(s);
}

/* x[j] = exp(x[j] - m) for j < n (colibri_exp's bits, NaN kept); returns their
 * colibri_attend_sum. */
static COLIBRI_ATTEND_INLINE float colibri_attend_exp(float *x, float m, int64_t n)
{
    int64_t j;
    for (j = 0; j < n; j++)
        x[j] = colibri_attend_exp1(x[j] - m);
    return colibri_attend_sum(x, n);
}

/* dst[c] = dots[c] scale (+ mask[c]) for c < m. */
static COLIBRI_ATTEND_INLINE void colibri_attend_score(const float *dots, float scale,
                                                       const float *mask, int64_t m, float *dst)
{
    int64_t c;
    for (c = 0; c < m; c++) {
        float x = dots[c] * scale;
        if (mask != NULL)
            x = x + mask[c];
        dst[c] = x;
    }
}

/* The largest of x[0..n) that is not NaN (-inf when none); *nan: whether one is NaN. */
static COLIBRI_ATTEND_INLINE float colibri_attend_max(const float *x, int64_t n, int *nan)
{
    float mx = -INFINITY;
    int64_t j;
    *nan = 0;
    for (j = 0; j < n; j++) {
        mx = x[j] > mx ? x[j] : mx;
        *nan |= x[j] != x[j];
    }
    return mx;
}

/* out[at + c] = acc[c] / sum (0 where sum is 0) for c < n, stored as kind says. */
static COLIBRI_ATTEND_INLINE void colibri_attend_out(void *out, int64_t at, const float *acc,
                                                     float sum, int64_t n, int kind)
{
    int64_t c;
    for (c = 0; c < n; c++)
        colibri_rows_store(out, at + c, sum != 0 ? acc[c] / sum : 0.0f, kind);
}

#ifdef COLIBRI_ATTEND_X86
#include <immintrin.h>
#define COLIBRI_ATTEND_AVX2 __attribute__((target("avx2,f16c")))

/* colibri_attend_dots with the eight dot products side by side: the same sums (per dot, lane
 * l sums a[i + l] b[i + l] in i's order; the lanes added pairwise by two horizontal adds,
 * then the two halves). */
COLIBRI_ATTEND_AVX2 static COLIBRI_ATTEND_INLINE void
colibri_attend_dots_avx2(const float *a, const float *b, int64_t n, float *out)
{
    __m256 s[COLIBRI_ATTEND_KEYS], h[4];
    int64_t i = 0;
    int c;
    if (n % 8) { /* a tail: colibri_attend_dot's order, dot by dot */
        colibri_attend_dots(a, b, n, out);
        return;
    }
    for (c = 0; c < COLIBRI_ATTEND_KEYS; c++)
        s[c] = _mm256_setzero_ps();
    for (; i < n; i += 8) {
        const __m256 x = _mm256_loadu_ps(a + i);
        for (c = 0; c < COLIBRI_ATTEND_KEYS; c++)
            s[c] = _mm256_add_ps(s[c], _mm256_mul_ps(x, _mm256_loadu_ps(b + c * n + i)));
    }
    /* hadd(u, v) = u0+u1, u2+u3, v0+v1, v2+v3 | the same of lanes 4-7 */
    for (c = 0; c < 4; c++)
        h[c] = _mm256_hadd_ps(s[2 * c], s[2 * c + 1]);
    h[0] = _mm256_hadd_ps(h[0], h[1]); /* (s0+s1)+(s2+s3) of dots 0-3 | (s4+s5)+(s6+s7) */
    h[2] = _mm256_hadd_ps(h[2], h[3]);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h[0]), _mm256_extractf128_ps(h[0], 1)));
    _mm_storeu_ps(out + 4,
                  _mm_add_ps(_mm256_castps256_ps128(h[2]), _mm256_extractf128_ps(h[2], 1)));
}

/* colibri_attend_add: 64 floats of acc at a time (then 8), in registers across the m rows,
 * eight sums side by side (one sum's adds wait on each other: the latency, not the adds,
 * bounds a single one); each float's adds in the rows' order, as colibri_attend_add_rows. */
COLIBRI_ATTEND_AVX2 static COLIBRI_ATTEND_INLINE void
colibri_attend_add_avx2(float *acc, const float *p, const float *b, int64_t m, int64_t n)
{
    int64_t c, d = 0;
    int l;
    for (; d + 64 <= n; d += 64) {
        __m256 t[8];
        for (l = 0; l < 8; l++)
            t[l] = _mm256_loadu_ps(acc + d + 8 * l);
        for (c = 0; c < m; c++) {
            const __m256 w = _mm256_set1_ps(p[c]);
            const float *row = b + c * n + d;
            for (l = 0; l < 8; l++)
                t[l] = _mm256_add_ps(t[l], _mm256_mul_ps(w, _mm256_loadu_ps(row + 8 * l)));
        }
        for (l = 0; l < 8; l++)
            _mm256_storeu_ps(acc + d + 8 * l, t[l]);
    }
    for (; d + 8 <= n; d += 8) {
        __m256 t = _mm256_loadu_ps(acc + d);
        for (c = 0; c < m; c++)
            t = _mm256_add_ps(t,
                              _mm256_mul_ps(_mm256_set1_ps(p[c]), _mm256_loadu_ps(b + c * n + d)));
        _mm256_storeu_ps(acc + d, t);
    }
    colibri_attend_add_rows(acc + d, p, b + d, m, n - d, n);
}

/* colibri_attend_load, eight values at a time: bfloat16 widened, float16 by F16C; the same
 * floats, but that a signaling NaN comes out quiet (as the arithmetic after it would make
 * it: a result is NaN at the same places on every path). */
COLIBRI_ATTEND_AVX2 static COLIBRI_ATTEND_INLINE void
colibri_attend_load_avx2(const void *src, int64_t at, int64_t n, int kind, float *dst)
{
    const uint16_t *s = (const uint16_t *)src + at;
    int64_t i = 0;
    if (kind == COLIBRI_W_BF16)
        for (; i + 8 <= n; i += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
    else if (kind == COLIBRI_W_F16)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    colibri_attend_load(src, at + i, n - i, kind, dst + i); /* the rest; float32 */
}

/* colibri_attend_exp, eight exponentials at a time (colibri_exp_avx2: colibri_exp's bits). */
COLIBRI_ATTEND_AVX2 static COLIBRI_ATTEND_INLINE float colibri_attend_exp_avx2(float *x, float m,
                                                                               int64_t n)
{
    const __m256 mm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    float s[8];
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + j), mm);
        const __m256 e =
            _mm256_blendv_ps(colibri_exp_avx2(d), d, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
        _mm256_storeu_ps(x + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(s, sum);
    for (; j < n; j++) {
        x[j] = colibri_attend_exp1(x[j] - m);
        s[j % 8] += x[j];
    }
    return colibri_attend_lanes(s);
}

/* colibri_attend_score, eight at a time. */
COLIBRI_ATTEND_AVX2 static COLIBRI_ATTEND_INLINE void
colibri_attend_score_avx2(const float *dots, float scale, const float *mask, int64_t m, float *dst)
{
    __m256 x;
    if (m < 8) {
        colibri_attend_score(dots, scale, mask, m, dst);
        return;
    }
    x = _mm256_mul_ps(_mm256_loadu_ps(dots), _mm256_set1_ps(scale));
    if (mask != NULL)
        x = _mm256_add_ps(x, _mm256_loadu_ps(mask));
    _mm256_storeu_ps(dst, x);
}

/* colibri_attend_max, eight at a time (the largest is the same in any order; max_ps keeps
 * its second operand, the running maxima, where the first is NaN). */
COLIBRI_ATTEND_AVX2 static COLIBRI_ATTEND_INLINE float colibri_attend_max_avx2(const float *x,
                                                                               int64_t n, int *nan)
{
    __m256 mx = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    float lanes[8], m;
    int64_t j = 0;
    int l;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        mx = _mm256_max_ps(v, mx);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    _mm256_storeu_ps(lanes, mx);
    m = colibri_attend_max(x + j, n - j, nan);
    *nan |= _mm256_movemask_ps(un) != 0;
    for (l = 0; l < 8; l++)
        m = lanes[l] > m ? lanes[l] : m;
    return m;
}

/* colibri_attend_out, eight at a time (the same quotients, rounded as colibri_rows_store). */
COLIBRI_ATTEND_AVX2 static COLIBRI_ATTEND_INLINE void
colibri_attend_out_avx2(void *out, int64_t at, const float *acc, float sum, int64_t n, int kind)
{
    const __m256 s = _mm256_set1_ps(sum);
    int64_t c = 0;
    if (sum != 0)
        for (; c + 8 <= n; c += 8)
            colibri_rows_store8(out, at + c, _mm256_div_ps(_mm256_loadu_ps(acc + c), s), kind);
    colibri_attend_out(out, at + c, acc + c, sum, n - c, kind);
}
#endif

/* Floats of scratch one head takes: G T L + 2 G T D + 8 D + G T. */
static inline int64_t colibri_attend_scratch(const colibri_attend_t *a)
{
    const int64_t R = a->Hq / a->Hkv * a->T;
    return R * a->L + 2 * R * a->D + COLIBRI_ATTEND_KEYS * a->D + R;
}

/* The kernel for key/value head g; buf: colibri_attend_scratch(a) floats. Scores a block of
 * eight keys (converted once) against every query row, then adds a block of eight values to
 * every row's sums: per value the operations of one key at a time, in the keys' order. */
#define COLIBRI_ATTEND_BODY(name, LOAD, DOTS, SCORE, MAX, EXP, ADD, OUT, ATTR)                     \
    ATTR static void name(const colibri_attend_t *a, int64_t g, float *buf)                        \
    {                                                                                              \
        const int64_t G = a->Hq / a->Hkv, T = a->T, L = a->L, D = a->D, R = G * T;                 \
        float *s = buf;                                /* [R, L]: scores, then exponentials */     \
        float *qf = s + R * L;                         /* [R, D] */                                \
        float *acc = qf + R * D;                       /* [R, D] */                                \
        float *rows = acc + R * D;                     /* [8, D]: key or value rows, float32 */    \
        float *total = rows + COLIBRI_ATTEND_KEYS * D; /* [R] */                                   \
        float dots[COLIBRI_ATTEND_KEYS];                                                           \
        int64_t r, j, c, m;                                                                        \
        for (r = 0; r < R; r++) /* row r: head g G + r / T, query r % T */                         \
            LOAD(a->q, ((g * G + r / T) * T + r % T) * D, D, a->kind, &qf[r * D]);                 \
        memset(rows, 0, (size_t)(COLIBRI_ATTEND_KEYS * D) * sizeof(float));                        \
        for (j = 0; j < L; j += COLIBRI_ATTEND_KEYS) {                                             \
            m = L - j < COLIBRI_ATTEND_KEYS ? L - j : COLIBRI_ATTEND_KEYS;                         \
            for (c = 0; c < m; c++)                                                                \
                LOAD(a->k, g * a->ldk + (j + c) * D, D, a->kind, &rows[c * D]);                    \
            for (r = 0; r < R; r++) {                                                              \
                DOTS(&qf[r * D], rows, D, dots);                                                   \
                SCORE(dots, a->scale, a->mask != NULL ? a->mask + (r % T) * L + j : NULL, m,       \
                      &s[r * L + j]);                                                              \
            }                                                                                      \
        }                                                                                          \
        for (r = 0; r < R; r++) {                                                                  \
            float *sr = &s[r * L];                                                                 \
            int nan;                                                                               \
            const float mx = MAX(sr, L, &nan);                                                     \
            if (mx == -INFINITY && !nan) { /* every key masked: zeros */                           \
                memset(sr, 0, (size_t)L * sizeof(float));                                          \
                total[r] = 0.0f;                                                                   \
            } else { /* NaN scores (-inf - -inf too, when all are NaN or masked) stay */           \
                total[r] = EXP(sr, mx, L);                                                         \
            }                                                                                      \
        }                                                                                          \
        memset(acc, 0, (size_t)(R * D) * sizeof(float));                                           \
        for (j = 0; j < L; j += COLIBRI_ATTEND_KEYS) {                                             \
            m = L - j < COLIBRI_ATTEND_KEYS ? L - j : COLIBRI_ATTEND_KEYS;                         \
            for (c = 0; c < m; c++)                                                                \
                LOAD(a->v, g * a->ldv + (j + c) * D, D, a->kind, &rows[c * D]);                    \
            for (r = 0; r < R; r++)                                                                \
                ADD(&acc[r * D], &s[r * L + j], rows, m, D);                                       \
        }                                                                                          \
        for (r = 0; r < R; r++)                                                                    \
            OUT(a->out, ((r % T) * a->Hq + g * G + r / T) * D, &acc[r * D], total[r], D, a->kind); \
    }

#ifdef COLIBRI_ATTEND_X86
COLIBRI_ATTEND_BODY(colibri_attend_avx2, colibri_attend_load_avx2, colibri_attend_dots_avx2,
                    colibri_attend_score_avx2, colibri_attend_max_avx2, colibri_attend_exp_avx2,
                    colibri_attend_add_avx2, colibri_attend_out_avx2, COLIBRI_ATTEND_AVX2)
#endif
COLIBRI_ATTEND_BODY(colibri_attend_base, colibri_attend_load, colibri_attend_dots,
                    colibri_attend_score, colibri_attend_max, colibri_attend_exp,
                    colibri_attend_add, colibri_attend_out, )

/* A call's heads as pool chunks: head c on path with scratch buf + c * per. */
typedef struct {
    const colibri_attend_t *a;
    float *buf;
    int64_t per;
    int path;
} colibri_attend_job_t;

static void colibri_attend_head(void *arg, int32_t c)
{
    const colibri_attend_job_t *job = (const colibri_attend_job_t *)arg;
    float *buf = job->buf + (int64_t)c * job->per;
#ifdef COLIBRI_ATTEND_X86
    if (job->path >= COLIBRI_PATH_AVX2 && job->path != COLIBRI_PATH_NEON) {
        colibri_attend_avx2(job->a, c, buf);
        return;
    }
#endif
    colibri_attend_base(job->a, c, buf);
}

/* Runs the call on path (cpu.h's COLIBRI_PATH_*: AVX2 and up, else the build's base); 0, or
 * -1 when scratch memory is short. */
static inline int colibri_attend(const colibri_attend_t *a, int path)
{
    const int split =
        a->threads > 1 && a->Hkv > 1 && a->Hq * a->T * a->L * a->D >= COLIBRI_ATTEND_SPLIT;
    colibri_attend_job_t job;
    int32_t c;
    job.a = a;
    job.per = colibri_attend_scratch(a);
    job.path = path;
    job.buf = (float *)malloc((size_t)(job.per * (split ? a->Hkv : 1)) * sizeof(float));
    if (job.buf == NULL)
        return -1;
    if (split) {
        colibri_pool_run(colibri_attend_head, &job, (int32_t)a->Hkv, a->threads);
    } else {
        job.per = 0; /* one head after another in the same scratch */
        for (c = 0; c < (int32_t)a->Hkv; c++)
            colibri_attend_head(&job, c);
    }
    free(job.buf);
    return 0;
}

#endif /* COLIBRI_ATTENTION_H */
