/*
 * colibri's float8 experts: weights stored as e4m3fn bytes (DeepSeek-V3 / Qwen3 FP8
 * checkpoints) with one float32 scale per 128 x 128 block, computed as stored:
 *
 *     W[o, k] = e4m3(w[o, k]) * scale[o / 128, k / 128]
 *     y[r] = down @ (act(gate @ x[r]) * (up @ x[r]))      r < n (1 to ~16 rows)
 *
 * W is never materialised. e4m3fn bytes decode through a 256-entry float table, or on the
 * SIMD paths through float16 (exact either way: every e4m3 value is a float16 times 2^8 and
 * a float32; 0x7F and 0xFF are NaN, there is no infinity). The rows of
 * a matrix may be any length: the last block of a row (or of the block rows) may be partial.
 *
 * Summation order, the contract every path keeps (so every path gives the same bits): for
 * one weight row and one x row, each 128-column block is summed into 16 float lanes, column
 * k of the block into lane k % 16 in column order (products rounded, then added: no fused
 * multiply-add; the build sets -ffp-contract=off); each lane then adds the block's scale times
 * itself into a running lane total (block order); the 16 totals are reduced pairwise, lane l
 * with l + 8, then l + 4, l + 2, l + 1. The scalar path is the contract; AVX2 (two 8-lane
 * registers) and AVX-512 (one 16-lane register) decode 16 bytes at a time through float16
 * (colibri_fp8_to_half: the same values as the table) and compute the
 * same operations in the same order. Output rows are split into chunks for colibri/pool.h
 * exactly as colibri/ffn.h does; each output is one thread's, so the thread count changes
 * no bit. Plain C99 + intrinsics, header-only.
 */
#ifndef COLIBRI_FP8_H
#define COLIBRI_FP8_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "colibri/cpu.h"
#include "colibri/ffn.h"
#include "colibri/pool.h"

/* Columns (and rows) of one scale block. */
#define COLIBRI_FP8_BLOCK 128
/* Lanes each block is summed into. */
#define COLIBRI_FP8_LANES 16

/* The value of one e4m3fn byte (sign, 4 exponent bits of bias 7, 3 mantissa bits). */
static inline float colibri_fp8_decode(uint8_t b)
{
    int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7)
        return NAN;
    v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
    return b & 0x80 ? -v : v;
}

/* The 256 decoded values (filled once; racing first calls write the same values). */
static inline const float *colibri_fp8_table(void)
{
    static float table[256];
    static volatile int ready = 0;
    int i;
    if (!ready) {
        for (i = 0; i < 256; i++)
            table[i] = colibri_fp8_decode((uint8_t)i);
        ready = 1;
    }
    return table;
}

/* The lane totals of one row, reduced in the contract's order. */
static inline float colibri_fp8_reduce(float *lanes)
{
    int32_t width, l;
    for (width = COLIBRI_FP8_LANES / 2; width > 0; width /= 2)
        for (l = 0; l < width; l++)
            lanes[l] += lanes[l + width];
    return lanes[0];
}

/* The columns of a partial 16-column tail of a block, lane by lane (every path's). */
static inline void colibri_fp8_tail(const float *t, const uint8_t *w, int32_t k0, int32_t k,
                                    int32_t k1, const float *x, int64_t ldx, int32_t nb,
                                    float (*blk)[COLIBRI_FP8_LANES])
{
    int32_t r;
    for (; k < k1; k++) {
        float v = t[w[k]];
        for (r = 0; r < nb; r++)
            blk[r][(k - k0) % COLIBRI_FP8_LANES] += v * x[r * ldx + k];
    }
}

/* y[r * ldy] = sum_k W[k] x[r * ldx + k] for r < nb <= 4: one weight row w of K bytes, its
 * block scales s[k / 128]. */
static inline void colibri_fp8_dot_scalar(const uint8_t *w, int32_t K, const float *s,
                                          const float *x, int64_t ldx, int32_t nb, float *y,
                                          int64_t ldy)
{
    const float *t = colibri_fp8_table();
    float tot[COLIBRI_FFN_ROW_BLOCK][COLIBRI_FP8_LANES];
    float blk[COLIBRI_FFN_ROW_BLOCK][COLIBRI_FP8_LANES];
    int32_t k0, r, l;
    memset(tot, 0, sizeof(tot));
    for (k0 = 0; k0 < K; k0 += COLIBRI_FP8_BLOCK) {
        int32_t k1 = K - k0 < COLIBRI_FP8_BLOCK ? K : k0 + COLIBRI_FP8_BLOCK;
        float scale = s[k0 / COLIBRI_FP8_BLOCK];
        memset(blk, 0, sizeof(blk));
        colibri_fp8_tail(t, w, k0, k0, k1, x, ldx, nb, blk);
        for (r = 0; r < nb; r++)
            for (l = 0; l < COLIBRI_FP8_LANES; l++)
                tot[r][l] += scale * blk[r][l];
    }
    for (r = 0; r < nb; r++)
        y[r * ldy] = colibri_fp8_reduce(tot[r]);
}

#ifdef COLIBRI_FFN_X86
/* 16 e4m3fn bytes as float16 bits of 2^-8 times their values, exactly (subnormals too):
 * the exponent and mantissa moved up into float16's fields (the biases differ by 8), the
 * sign into its own, NaN (S.1111.111) made the table's NaN. */
COLIBRI_TARGET_AVX2 static inline __m256i colibri_fp8_to_half(__m128i bytes)
{
    const __m256i b = _mm256_cvtepu8_epi16(bytes);
    const __m256i low7 = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i nan = _mm256_cmpeq_epi16(low7, _mm256_set1_epi16(0x7f));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(low7, 7), sign);
    return _mm256_or_si256(_mm256_andnot_si256(nan, h),
                           _mm256_and_si256(nan, _mm256_set1_epi16(0x7e00)));
}

COLIBRI_TARGET_AVX2 static inline void colibri_fp8_dot_avx2(const uint8_t *w, int32_t K,
                                                            const float *s, const float *x,
                                                            int64_t ldx, int32_t nb, float *y,
                                                            int64_t ldy)
{
    const float *t = colibri_fp8_table();
    const __m256 up8 = _mm256_set1_ps(256.0f);
    __m256 tot[COLIBRI_FFN_ROW_BLOCK][2], b[COLIBRI_FFN_ROW_BLOCK][2];
    float blk[COLIBRI_FFN_ROW_BLOCK][COLIBRI_FP8_LANES];
    int32_t k0, k, r;
    for (r = 0; r < nb; r++)
        tot[r][0] = tot[r][1] = _mm256_setzero_ps();
    for (k0 = 0; k0 < K; k0 += COLIBRI_FP8_BLOCK) {
        int32_t k1 = K - k0 < COLIBRI_FP8_BLOCK ? K : k0 + COLIBRI_FP8_BLOCK;
        __m256 scale = _mm256_set1_ps(s[k0 / COLIBRI_FP8_BLOCK]);
        for (r = 0; r < nb; r++)
            b[r][0] = b[r][1] = _mm256_setzero_ps();
        for (k = k0; k + COLIBRI_FP8_LANES <= k1; k += COLIBRI_FP8_LANES) {
            __m256i h = colibri_fp8_to_half(_mm_loadu_si128((const __m128i *)(w + k)));
            __m256 v0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), up8);
            __m256 v1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), up8);
            for (r = 0; r < nb; r++) {
                const float *xr = x + r * ldx + k;
                b[r][0] = _mm256_add_ps(b[r][0], _mm256_mul_ps(v0, _mm256_loadu_ps(xr)));
                b[r][1] = _mm256_add_ps(b[r][1], _mm256_mul_ps(v1, _mm256_loadu_ps(xr + 8)));
            }
        }
        if (k < k1) {
            for (r = 0; r < nb; r++) {
                _mm256_storeu_ps(blk[r], b[r][0]);
                _mm256_storeu_ps(blk[r] + 8, b[r][1]);
            }
            colibri_fp8_tail(t, w, k0, k, k1, x, ldx, nb, blk);
            for (r = 0; r < nb; r++) {
                b[r][0] = _mm256_loadu_ps(blk[r]);
                b[r][1] = _mm256_loadu_ps(blk[r] + 8);
            }
        }
        for (r = 0; r < nb; r++) {
            tot[r][0] = _mm256_add_ps(tot[r][0], _mm256_mul_ps(scale, b[r][0]));
            tot[r][1] = _mm256_add_ps(tot[r][1], _mm256_mul_ps(scale, b[r][1]));
        }
    }
    for (r = 0; r < nb; r++) {
        _mm256_storeu_ps(blk[r], tot[r][0]);
        _mm256_storeu_ps(blk[r] + 8, tot[r][1]);
        y[r * ldy] = colibri_fp8_reduce(blk[r]);
    }
}

COLIBRI_TARGET_AVX512 static inline void colibri_fp8_dot_avx512(const uint8_t *w, int32_t K,
                                                                const float *s, const float *x,
                                                                int64_t ldx, int32_t nb, float *y,
                                                                int64_t ldy)
{
    const float *t = colibri_fp8_table();
    const __m512 up8 = _mm512_set1_ps(256.0f);
    __m512 tot[COLIBRI_FFN_ROW_BLOCK], b[COLIBRI_FFN_ROW_BLOCK];
    float blk[COLIBRI_FFN_ROW_BLOCK][COLIBRI_FP8_LANES];
    int32_t k0, k, r;
    for (r = 0; r < nb; r++)
        tot[r] = _mm512_setzero_ps();
    for (k0 = 0; k0 < K; k0 += COLIBRI_FP8_BLOCK) {
        int32_t k1 = K - k0 < COLIBRI_FP8_BLOCK ? K : k0 + COLIBRI_FP8_BLOCK;
        __m512 scale = _mm512_set1_ps(s[k0 / COLIBRI_FP8_BLOCK]);
        for (r = 0; r < nb; r++)
            b[r] = _mm512_setzero_ps();
        for (k = k0; k + COLIBRI_FP8_LANES <= k1; k += COLIBRI_FP8_LANES) {
            __m256i h = colibri_fp8_to_half(_mm_loadu_si128((const __m128i *)(w + k)));
            __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), up8);
            for (r = 0; r < nb; r++)
                b[r] = _mm512_add_ps(b[r], _mm512_mul_ps(v, _mm512_loadu_ps(x + r * ldx + k)));
        }
        if (k < k1) {
            for (r = 0; r < nb; r++)
                _mm512_storeu_ps(blk[r], b[r]);
            colibri_fp8_tail(t, w, k0, k, k1, x, ldx, nb, blk);
            for (r = 0; r < nb; r++)
                b[r] = _mm512_loadu_ps(blk[r]);
        }
        for (r = 0; r < nb; r++)
            tot[r] = _mm512_add_ps(tot[r], _mm512_mul_ps(scale, b[r]));
    }
    for (r = 0; r < nb; r++) {
        _mm512_storeu_ps(blk[r], tot[r]);
        y[r * ldy] = colibri_fp8_reduce(blk[r]);
    }
}
#endif

/* One weight row against n rows of x (4 at a time), on `path` (any COLIBRI_PATH_*; paths
 * without an fp8 kernel of their own run the scalar one, which gives the same bits). */
static inline void colibri_fp8_dot(int path, const uint8_t *w, int32_t K, const float *s,
                                   const float *x, int64_t ldx, int32_t n, float *y, int64_t ldy)
{
    int32_t r;
    for (r = 0; r < n; r += COLIBRI_FFN_ROW_BLOCK) {
        int32_t nb = n - r < COLIBRI_FFN_ROW_BLOCK ? n - r : COLIBRI_FFN_ROW_BLOCK;
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
#ifdef COLIBRI_FFN_X86
        if (path == COLIBRI_PATH_AVX512 || path == COLIBRI_PATH_AVX512_BF16) {
            colibri_fp8_dot_avx512(w, K, s, xr, ldx, nb, yr, ldy);
            continue;
        }
        if (path == COLIBRI_PATH_AVX2) {
            colibri_fp8_dot_avx2(w, K, s, xr, ldx, nb, yr, ldy);
            continue;
        }
#endif
        (void)path;
        colibri_fp8_dot_scalar(w, K, s, xr, ldx, nb, yr, ldy);
    }
}

/* ---- the gated FFN ------------------------------------------------------------------ */

typedef struct {
    int32_t n, H, I; /* rows (<= COLIBRI_FFN_MAX_ROWS), hidden size, intermediate size */
    int32_t act;     /* COLIBRI_ACT_* */
    int32_t path;    /* COLIBRI_PATH_* (one this CPU runs) */
    const float *x;  /* [n, H], row stride ldx */
    int64_t ldx;
    const uint8_t *gate, *up; /* [I, H] e4m3 bytes, row strides ldg, ldu */
    int64_t ldg, ldu;
    const float *gs, *us; /* their scales [ceil(I / 128), ceil(H / 128)], row strides lgs, lus */
    int64_t lgs, lus;
    const uint8_t *down; /* [H, I], row stride ldd */
    int64_t ldd;
    const float *ds; /* its scales [ceil(H / 128), ceil(I / 128)], row stride lds */
    int64_t lds;
    float *h; /* scratch [n, I]: act(gate x) * (up x) */
    float *y; /* [n, H], row stride ldy */
    int64_t ldy;
} colibri_fp8_ffn_t;

/* h[r, o] = act(gate[o] . x[r]) * (up[o] . x[r]) for o in [o0, o1). */
static inline void colibri_fp8_gate_up(const colibri_fp8_ffn_t *f, int32_t o0, int32_t o1)
{
    float g[COLIBRI_FFN_MAX_ROWS], u[COLIBRI_FFN_MAX_ROWS];
    int32_t o, r;
    for (o = o0; o < o1; o++) {
        int64_t b = o / COLIBRI_FP8_BLOCK;
        colibri_fp8_dot(f->path, f->gate + o * f->ldg, f->H, f->gs + b * f->lgs, f->x, f->ldx, f->n,
                        g, 1);
        colibri_fp8_dot(f->path, f->up + o * f->ldu, f->H, f->us + b * f->lus, f->x, f->ldx, f->n,
                        u, 1);
        for (r = 0; r < f->n; r++)
            f->h[r * (int64_t)f->I + o] = colibri_act(f->act, g[r]) * u[r];
    }
}

/* y[r, o] = down[o] . h[r] for o in [o0, o1). */
static inline void colibri_fp8_down(const colibri_fp8_ffn_t *f, int32_t o0, int32_t o1)
{
    int32_t o;
    for (o = o0; o < o1; o++)
        colibri_fp8_dot(f->path, f->down + o * f->ldd, f->I,
                        f->ds + (int64_t)(o / COLIBRI_FP8_BLOCK) * f->lds, f->h, f->I, f->n,
                        f->y + o, f->ldy);
}

/* Several experts' FFNs (same layer) in two pool runs, their chunks in one index space. */
typedef struct {
    const colibri_fp8_ffn_t *f;
    int32_t count;
    const int32_t *first;
    int64_t bytes; /* weights a chunk of the pass (colibri_pool_chunk_bytes) */
} colibri_fp8_many_t;

static inline int32_t colibri_fp8_owner(const colibri_fp8_many_t *m, int32_t c)
{
    int32_t j = 0;
    while (j + 1 < m->count && m->first[j + 1] <= c)
        j++;
    return j;
}

static void colibri_fp8_many_gate_up(void *arg, int32_t c)
{
    const colibri_fp8_many_t *m = (const colibri_fp8_many_t *)arg;
    int32_t j = colibri_fp8_owner(m, c);
    const colibri_fp8_ffn_t *f = &m->f[j];
    const int32_t rows = colibri_pool_chunk_rows(m->bytes, 2 * (int64_t)f->H, 1);
    int32_t o0 = (c - m->first[j]) * rows;
    colibri_fp8_gate_up(f, o0, o0 + rows < f->I ? o0 + rows : f->I);
}

static void colibri_fp8_many_down(void *arg, int32_t c)
{
    const colibri_fp8_many_t *m = (const colibri_fp8_many_t *)arg;
    int32_t j = colibri_fp8_owner(m, c);
    const colibri_fp8_ffn_t *f = &m->f[j];
    const int32_t rows = colibri_pool_chunk_rows(m->bytes, f->I, 1);
    int32_t o0 = (c - m->first[j]) * rows;
    colibri_fp8_down(f, o0, o0 + rows < f->H ? o0 + rows : f->H);
}

/* count experts on up to `threads` threads; first must hold count + 1 entries (scratch). */
static inline void colibri_fp8_run_many(const colibri_fp8_ffn_t *f, int32_t count, int32_t *first,
                                        int threads)
{
    colibri_fp8_many_t m;
    int32_t j;
    if (count < 1)
        return;
    (void)colibri_fp8_table(); /* filled before any helper reads it */
    m.f = f;
    m.count = count;
    m.first = first;
    m.bytes = 0;
    for (j = 0; j < count; j++)
        m.bytes += 2 * (int64_t)f[j].I * f[j].H; /* one byte a weight */
    m.bytes = colibri_pool_chunk_bytes(m.bytes, threads);
    first[0] = 0;
    for (j = 0; j < count; j++) {
        int32_t rows = colibri_pool_chunk_rows(m.bytes, 2 * (int64_t)f[j].H, 1);
        first[j + 1] = first[j] + (f[j].I + rows - 1) / rows;
    }
    colibri_pool_run(colibri_fp8_many_gate_up, (void *)&m, first[count], threads);
    m.bytes = 0;
    for (j = 0; j < count; j++)
        m.bytes += (int64_t)f[j].H * f[j].I;
    m.bytes = colibri_pool_chunk_bytes(m.bytes, threads);
    first[0] = 0;
    for (j = 0; j < count; j++) {
        int32_t rows = colibri_pool_chunk_rows(m.bytes, f[j].I, 1);
        first[j + 1] = first[j] + (f[j].H + rows - 1) / rows;
    }
    colibri_pool_run(colibri_fp8_many_down, (void *)&m, first[count], threads);
}

#endif /* COLIBRI_FP8_H */
