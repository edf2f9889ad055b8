/*
 * colibri's per-token router: one fused pass over a row of E gate logits picks the
 * top-k experts and their weights. Plain C99 (no VLAs), header-only, usable from C without
 * Python: SSE2 where the target has it, NEON on aarch64 (unless COLIBRI_SIMD=scalar), plain C
 * elsewhere, and where GCC/Clang can build
 * them and the CPU runs them (colibri/cpu.h; COLIBRI_SIMD caps the path): AVX-512F for the
 * sigmoid pass and the top two (router.use_avx512), AVX2 for the score passes, the top two
 * and the top-k candidate bound (router.use_avx2). Every path gives the same bits. The batch
 * loop (OpenMP) lives in colibri/_core.pyx.
 *
 * How a row is routed:
 *   k <= 2, keys = logits: the best two by value (each SIMD lane keeps its two, merged),
 *       then their ids from equality masks; 8 rows at a time batch the softmax weights, and
 *       for softmax k = 2, blocks of 16 (AVX-512F) or 8 (AVX2) rows share the lane folds.
 *   otherwise: scores and keys (sigmoid fused with the bias), group scores from each group's
 *       best two, then top-k among the candidates at or above a bound that at least k keys
 *       reach (each lane's best two, or the kept groups' runners-up): ranks are counted,
 *       not sorted, so no branch depends on the data.
 *
 * Semantics (docs: README "Routing"):
 *   scores   = score(logits)              softmax | sigmoid | sqrt(softplus)
 *   keys     = scores + bias              (bias: selection only, may be NULL; or logits + bias)
 *   groups   : keep the topk_groups best groups by max / top-2-sum of keys; experts of
 *              dropped groups are never chosen (never a 0.0 fill that a negative key loses to)
 *   ids      = top-k of keys over the kept experts, descending; equal keys -> lower id
 *   weights  = scores[ids], renormalised to unit p-norm if normalize, times expert_scale[id],
 *              times scale.
 * Every score function is increasing, so without a bias the keys are the logits themselves
 * and softmax needs exponentials only for the k chosen experts.
 */
#ifndef COLIBRI_ROUTE_H
#define COLIBRI_ROUTE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "colibri/cpu.h"
#include "colibri/half.h"

#if defined(_MSC_VER)
#include <intrin.h>
#endif

#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#include <emmintrin.h>
#define COLIBRI_SSE2 1
#endif

/* aarch64: NEON versions of the 4-lane code (the same IEEE operations in the same order as
 * the SSE2 code and plain C, so the same bits), taken unless COLIBRI_SIMD=scalar. */
#if !defined(COLIBRI_SSE2) && defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define COLIBRI_NEON 1
static inline int colibri_neon_on(void)
{
    return colibri_simd_path() == COLIBRI_PATH_NEON;
}
#endif

/* GCC and Clang on x86-64 also compile AVX-512F kernels (the sigmoid pass and the top two),
 * used when router.use_avx512 is set (colibri_cpu_has_avx512() says whether it may be). */
#if defined(COLIBRI_SSE2) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define COLIBRI_AVX512 1
#define COLIBRI_AVX512_FN __attribute__((target("avx512f")))
/* 8-lane kernels: no FMA, so that every lane rounds as the SSE2 and scalar code does */
#define COLIBRI_AVX2 1
#define COLIBRI_AVX2_FN __attribute__((target("avx2")))
#endif

/* Top-k for k <= this runs on candidates above a bound taken from each SIMD lane's best
 * two; exact ranks are counted among at most COLIBRI_RANK_MAX candidates. */
#define COLIBRI_BOUND_MAX_K 8
#define COLIBRI_RANK_MAX 32

enum { COLIBRI_SOFTMAX = 0, COLIBRI_SIGMOID = 1, COLIBRI_SQRTSOFTPLUS = 2 };
enum { COLIBRI_GROUP_MAX = 0, COLIBRI_GROUP_TOP2_SUM = 1 };
enum { COLIBRI_F32 = 0, COLIBRI_F64 = 1, COLIBRI_F16 = 2, COLIBRI_BF16 = 3 };

/* Row status: the batch driver reports the first failing row. */
enum { COLIBRI_OK = 0, COLIBRI_ROW_NAN = 1, COLIBRI_ROW_ALL_NEG_INF = 2, COLIBRI_ROW_SHORT = 3 };

typedef struct {
    int32_t num_experts;
    int32_t top_k;
    int32_t scoring;
    int32_t normalize;
    float norm_p;              /* 1: divide by the sum; p: by the p-norm (DBRX) */
    float norm_eps;            /* added to the norm before dividing (LFM2: 1e-6) */
    float scale;               /* multiplies the final weights */
    const float *bias;         /* [E] selection-only bias, or NULL */
    int32_t bias_on_logits;    /* add the bias to the logits, not the scores (Kolibri) */
    const float *expert_scale; /* [E] per-expert factor after renormalisation, or NULL */
    int32_t num_groups;        /* <= 1: no group limit */
    int32_t topk_groups;
    int32_t group_score;
    const int32_t *group_start;   /* [G + 1] offsets into group_members */
    const int32_t *group_members; /* [E] expert ids, group by group */
    int32_t groups_in_order;      /* group_members is 0, 1, ..., E-1 (contiguous groups) */
    int32_t use_avx512;           /* the AVX-512F kernels: only if colibri_cpu_has_avx512() */
    int32_t use_avx2;             /* the AVX2 kernels: only if colibri_cpu_has_avx2() */
} colibri_router_t;

/* v**p and v**(1/p) for the p-norm. p = 2 (the usual p besides 1) is exact arithmetic, so it
 * gives the same bits with every C library (correctly rounded powf, as glibc's, agrees with
 * it); other p use the C library's powf, which may differ by an ulp between platforms. */
static inline float colibri_pow_p(float v, float p)
{
    return p == 2.0f ? v * v : powf(v, p);
}

static inline float colibri_root_p(float v, float p)
{
    return p == 2.0f ? sqrtf(v) : powf(v, 1.0f / p);
}

/* Most rows one colibri_route_block call routes (colibri_block_rows says how many). */
#define COLIBRI_BLOCK_MAX_ROWS 16

/* One thread's scratch, written once here: byte offsets of its areas from its start (each
 * 4-aligned when the start is) and its size. colibri_route_row carves the row's areas, the
 * batch driver the block's results, and colibri_scratch_bytes is .bytes. */
typedef struct {
    size_t row;           /* float [E]: the decoded row (colibri_load_row's buffer) */
    size_t scores;        /* float [E]: scores (the softmax of colibri_weights without them) */
    size_t keys;          /* float [E]: selection keys */
    size_t grouped;       /* float [E]: keys in group order */
    size_t cand_keys;     /* float [E + 4]: candidates' keys, padded to whole vectors */
    size_t cand;          /* int32 [E + 4]: candidates' ids, likewise */
    size_t group_scores;  /* float [G] */
    size_t group_runners; /* float [G]: each group's second key */
    size_t kept_scores;   /* float [G + 1]: the kept groups, plus one spare slot */
    size_t kept;          /* int32 [G + 1] */
    size_t top_keys;      /* float [k + 1]: the top k, plus one spare slot */
    size_t top;           /* int32 [k + 1] */
    size_t block_ids;     /* int32 [16 k], at a multiple of 64: a block's results (batch) */
    size_t block_weights; /* float [16 k] */
    size_t bytes;         /* all of it, a multiple of 64 */
} colibri_scratch_t;

static inline colibri_scratch_t colibri_scratch_layout(const colibri_router_t *r)
{
    const size_t E = (size_t)r->num_experts, k = (size_t)r->top_k;
    const size_t G = (size_t)(r->num_groups > 1 ? r->num_groups : 1);
    colibri_scratch_t s;
    size_t at = 0;
    s.row = at, at += 4 * E;
    s.scores = at, at += 4 * E;
    s.keys = at, at += 4 * E;
    s.grouped = at, at += 4 * E;
    s.cand_keys = at, at += 4 * (E + 4);
    s.cand = at, at += 4 * (E + 4);
    s.group_scores = at, at += 4 * G;
    s.group_runners = at, at += 4 * G;
    s.kept_scores = at, at += 4 * (G + 1);
    s.kept = at, at += 4 * (G + 1);
    s.top_keys = at, at += 4 * (k + 1);
    s.top = at, at += 4 * (k + 1);
    at = (at + 63) & ~(size_t)63;
    s.block_ids = at, at += 4 * COLIBRI_BLOCK_MAX_ROWS * k;
    s.block_weights = at, at += 4 * COLIBRI_BLOCK_MAX_ROWS * k;
    s.bytes = (at + 63) & ~(size_t)63;
    return s;
}

/* Bytes of one thread's scratch (a multiple of 64): colibri_scratch_layout(r).bytes. */
static inline size_t colibri_scratch_bytes(const colibri_router_t *r)
{
    return colibri_scratch_layout(r).bytes;
}

/* Ask for bytes [p, p + n) to be brought into the cache (a hint; no effect without SSE).
 * The batch driver fetches rows ahead: hardware prefetchers alone leave long rows waiting. */
static inline void colibri_prefetch(const void *p, size_t n)
{
#ifdef COLIBRI_SSE2
    size_t i;
    for (i = 0; i < n; i += 64)
        _mm_prefetch((const char *)p + i, _MM_HINT_T0);
#else
    (void)p;
    (void)n;
#endif
}

/* Decode one row of E logits (any supported dtype, any element stride) to float32.
 * Returns the row itself when it already is contiguous float32. */
static inline const float *colibri_load_row(const char *row, int dtype, int64_t stride, int32_t E,
                                            float *buf)
{
    int32_t e;
    switch (dtype) {
    case COLIBRI_F32:
        if (stride == 1 && ((uintptr_t)row & 3) == 0)
            return (const float *)row;
        for (e = 0; e < E; e++) /* memcpy: producers need not align their data */
            memcpy(buf + e, row + (int64_t)e * stride * 4, sizeof(float));
        break;
    case COLIBRI_F64:
        for (e = 0; e < E; e++) {
            double v;
            memcpy(&v, row + (int64_t)e * stride * 8, sizeof v);
            buf[e] = (float)v;
        }
        break;
    case COLIBRI_F16:
        for (e = 0; e < E; e++) {
            uint16_t v;
            memcpy(&v, row + (int64_t)e * stride * 2, sizeof v);
            buf[e] = colibri_half_to_float(v);
        }
        break;
    default: /* COLIBRI_BF16 */
        for (e = 0; e < E; e++) {
            uint16_t v;
            memcpy(&v, row + (int64_t)e * stride * 2, sizeof v);
            buf[e] = colibri_bf16_to_float(v);
        }
        break;
    }
    return buf;
}

/* exp(x) in float32 without libm, max relative error ~2e-7 (Cephes' polynomial, range
 * reduction by ln 2, exact two-step scaling so subnormal results round once). The SSE2 path
 * runs the same IEEE operations in the same order, so every lane and the scalar tail agree
 * bit for bit: a row's result never depends on where an expert falls in a vector. */
#define COLIBRI_EXP_LO (-104.0f)        /* exp below is 0 in float32 */
#define COLIBRI_EXP_HI 88.8f            /* exp above is inf */
#define COLIBRI_ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: adding it rounds to an integer */
/* shared by the scalar, SSE2 and AVX-512 versions, which must agree bit for bit */
#define COLIBRI_LOG2E 1.44269504088896341f
#define COLIBRI_LN2_HI 0.693359375f /* ln 2 = LN2_HI + LN2_LO; n * LN2_HI is exact */
#define COLIBRI_LN2_LO (-2.12194440e-4f)
#define COLIBRI_EXP_P5 1.9875691500e-4f
#define COLIBRI_EXP_P4 1.3981999507e-3f
#define COLIBRI_EXP_P3 8.3334519073e-3f
#define COLIBRI_EXP_P2 4.1665795894e-2f
#define COLIBRI_EXP_P1 1.6666665459e-1f
#define COLIBRI_EXP_P0 5.0000001201e-1f

static inline float colibri_exp(float x)
{
    x = x < COLIBRI_EXP_LO ? COLIBRI_EXP_LO : x;
    x = x > COLIBRI_EXP_HI ? COLIBRI_EXP_HI : x;
    float n = (x * COLIBRI_LOG2E + COLIBRI_ROUND_MAGIC) - COLIBRI_ROUND_MAGIC;
    float r = x - n * COLIBRI_LN2_HI;
    r = r - n * COLIBRI_LN2_LO;
    float p = COLIBRI_EXP_P5;
    p = p * r + COLIBRI_EXP_P4;
    p = p * r + COLIBRI_EXP_P3;
    p = p * r + COLIBRI_EXP_P2;
    p = p * r + COLIBRI_EXP_P1;
    p = p * r + COLIBRI_EXP_P0;
    p = (p * (r * r) + r) + 1.0f;
    int32_t ni = (int32_t)n, n1 = ni >> 1, n2 = ni - n1;
    return p * colibri_bits_to_float((uint32_t)(n1 + 127) << 23)
           * colibri_bits_to_float((uint32_t)(n2 + 127) << 23);
}

static inline float colibri_sigmoid(float x)
{
    float z = colibri_exp(-fabsf(x));
    return x >= 0.0f ? 1.0f / (1.0f + z) : z / (1.0f + z);
}

#ifdef COLIBRI_SSE2
static inline __m128 colibri_exp4(__m128 x)
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

static inline __m128 colibri_sigmoid4(__m128 x)
{
    __m128 sign = _mm_set1_ps(-0.0f);
    __m128 z = colibri_exp4(_mm_or_ps(x, sign)); /* exp(-|x|) */
    __m128 one = _mm_set1_ps(1.0f), is_pos = _mm_cmpge_ps(x, _mm_setzero_ps());
    __m128 num = _mm_or_ps(_mm_and_ps(is_pos, one), _mm_andnot_ps(is_pos, z));
    return _mm_div_ps(num, _mm_add_ps(one, z)); /* 1 / (1 + z) or z / (1 + z) */
}
#endif

#ifdef COLIBRI_NEON
/* colibri_exp and colibri_sigmoid on 4 NEON lanes (separate multiplies and adds: no FMA). */
static inline float32x4_t colibri_exp4n(float32x4_t x)
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

static inline float32x4_t colibri_sigmoid4n(float32x4_t x)
{
    float32x4_t z = colibri_exp4n(vnegq_f32(vabsq_f32(x))), one = vdupq_n_f32(1.0f);
    float32x4_t num = vbslq_f32(vcgeq_f32(x, vdupq_n_f32(0.0f)), one, z);
    return vdivq_f32(num, vaddq_f32(one, z));
}

/* Bit i of the result: lane i of the mask m is set (_mm_movemask_ps). */
static inline int colibri_mask4n(uint32x4_t m)
{
    static const uint32_t bit[4] = {1, 2, 4, 8};
    return (int)vaddvq_u32(vandq_u32(m, vld1q_u32(bit)));
}

/* All-ones lanes where v is NaN. */
static inline uint32x4_t colibri_unord4n(float32x4_t v)
{
    return vmvnq_u32(vceqq_f32(v, v));
}
#endif

/* out[e] = exp(x[e] - m) for e < E; returns the sum (lanes summed in a fixed order). */
static inline float colibri_exp_shifted(const float *x, float m, float *out, int32_t E)
{
    int32_t e = 0;
    float sum = 0.0f;
#ifdef COLIBRI_SSE2
    __m128 mm = _mm_set1_ps(m), acc = _mm_setzero_ps();
    for (; e + 4 <= E; e += 4) {
        __m128 v = colibri_exp4(_mm_sub_ps(_mm_loadu_ps(x + e), mm));
        _mm_storeu_ps(out + e, v);
        acc = _mm_add_ps(acc, v);
    }
    float lanes[4];
    _mm_storeu_ps(lanes, acc);
    sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#else
#ifdef COLIBRI_NEON
    if (colibri_neon_on()) {
        float32x4_t mm = vdupq_n_f32(m), acc = vdupq_n_f32(0.0f);
        for (; e + 4 <= E; e += 4) {
            float32x4_t v = colibri_exp4n(vsubq_f32(vld1q_f32(x + e), mm));
            vst1q_f32(out + e, v);
            acc = vaddq_f32(acc, v);
        }
        sum = (vgetq_lane_f32(acc, 0) + vgetq_lane_f32(acc, 1))
              + (vgetq_lane_f32(acc, 2) + vgetq_lane_f32(acc, 3));
    } else
#endif
    { /* plain C sums in the SSE2 code's order: four lanes, then lane pairs */
        float lanes[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int32_t j;
        for (; e + 4 <= E; e += 4)
            for (j = 0; j < 4; j++) {
                out[e + j] = colibri_exp(x[e + j] - m);
                lanes[j] += out[e + j];
            }
        sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    }
#endif
    for (; e < E; e++) {
        out[e] = colibri_exp(x[e] - m);
        sum += out[e];
    }
    return sum;
}

/* out[j] = exp(x[ids[j]] - m) for j < n, four at a time. */
static inline void colibri_exp_gathered(const float *x, const int32_t *ids, int32_t n, float m,
                                        float *out)
{
    int32_t j = 0;
#ifdef COLIBRI_SSE2
    for (; j + 4 <= n; j += 4) {
        __m128 v = _mm_set_ps(x[ids[j + 3]], x[ids[j + 2]], x[ids[j + 1]], x[ids[j]]);
        _mm_storeu_ps(out + j, colibri_exp4(_mm_sub_ps(v, _mm_set1_ps(m))));
    }
    if (j < n) { /* the last 1-3 in one vector too, padded with exp(0) */
        float lanes[4] = {m, m, m, m};
        int32_t i;
        for (i = 0; j + i < n; i++)
            lanes[i] = x[ids[j + i]];
        _mm_storeu_ps(lanes, colibri_exp4(_mm_sub_ps(_mm_loadu_ps(lanes), _mm_set1_ps(m))));
        for (i = 0; j + i < n; i++)
            out[j + i] = lanes[i];
        return;
    }
#endif
#ifdef COLIBRI_NEON
    if (colibri_neon_on()) {
        for (; j < n; j += 4) { /* the last 1-3 padded with exp(0) */
            float lanes[4] = {m, m, m, m};
            int32_t i;
            for (i = 0; i < 4 && j + i < n; i++)
                lanes[i] = x[ids[j + i]];
            vst1q_f32(lanes, colibri_exp4n(vsubq_f32(vld1q_f32(lanes), vdupq_n_f32(m))));
            for (i = 0; i < 4 && j + i < n; i++)
                out[j + i] = lanes[i];
        }
        return;
    }
#endif
    for (; j < n; j++)
        out[j] = colibri_exp(x[ids[j]] - m);
}

static inline float colibri_sqrtsoftplus(float x)
{
    /* softplus as torch computes it: x above 20, log1p(exp(x)) below */
    return sqrtf(x > 20.0f ? x : log1pf(colibri_exp(x)));
}

#ifdef COLIBRI_NEON
/* scores = sqrt(softplus(x)) with the exponentials 4 at a time (log1pf stays libm's). */
static inline void colibri_sqrtsoftplus4n(const float *x, int32_t E, float *scores)
{
    int32_t e = 0;
    for (; e + 4 <= E; e += 4)
        vst1q_f32(scores + e, colibri_exp4n(vld1q_f32(x + e)));
    for (e = 0; e < E; e++) {
        float ex = e < (E & ~3) ? scores[e] : colibri_exp(x[e]);
        scores[e] = sqrtf(x[e] > 20.0f ? x[e] : log1pf(ex));
    }
}
#endif

/* Whether (v, i) comes before (w, j) in top-k order: the larger key, equal keys to the
 * lower id; NaN (a group score of inf + -inf) after every number, as numpy sorts it. */
static inline int colibri_before(float v, int32_t i, float w, int32_t j)
{
    if (v > w)
        return 1;
    if (v == w)
        return i < j;
    return v != v ? w != w && i < j : w != w; /* v < w, or unordered */
}

/* Insert (v, i) into the list (vals, ids) of length *n <= cap, kept in top-k order. */
static inline void colibri_push(float *vals, int32_t *ids, int32_t *n, int32_t cap, float v,
                                int32_t i)
{
    int32_t j = *n;
    if (j == cap) {
        if (!colibri_before(v, i, vals[cap - 1], ids[cap - 1]))
            return;
        j = cap - 1;
    } else {
        *n = j + 1;
    }
    while (j > 0 && colibri_before(v, i, vals[j - 1], ids[j - 1])) {
        vals[j] = vals[j - 1];
        ids[j] = ids[j - 1];
        j--;
    }
    vals[j] = v;
    ids[j] = i;
}

/* Index of the lowest set bit of m != 0. */
static inline int32_t colibri_ctz64(uint64_t m)
{
#if defined(__GNUC__) || defined(__clang__)
    return (int32_t)__builtin_ctzll(m);
#elif defined(_MSC_VER) && defined(_M_X64)
    unsigned long i;
    _BitScanForward64(&i, m);
    return (int32_t)i;
#else
    int32_t i = 0;
    for (; !(m & 1); m >>= 1)
        i++;
    return i;
#endif
}

/* The two largest values of x[0..E), E >= 2, into *first >= *second (equal when tied, -inf
 * when absent); returns nonzero when x holds a NaN. Each lane keeps its best two, merged at
 * the end: no branch per element. */
static inline int colibri_top2_values(const float *x, int32_t E, float *first, float *second)
{
    int32_t e = 0;
    int nan = 0;
    float m1 = -INFINITY, m2 = -INFINITY;
#ifdef COLIBRI_SSE2
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
#endif
#ifdef COLIBRI_NEON
    if (E >= 8 && colibri_neon_on()) { /* the SSE2 code's lanes and merges */
        float32x4_t a = vdupq_n_f32(-INFINITY), b = a, a2 = a, b2 = a;
        uint32x4_t unordered = vdupq_n_u32(0);
        for (; e + 8 <= E; e += 8) {
            float32x4_t v = vld1q_f32(x + e), w = vld1q_f32(x + e + 4);
            unordered = vorrq_u32(unordered, vorrq_u32(colibri_unord4n(v), colibri_unord4n(w)));
            b = vmaxq_f32(vminq_f32(v, a), b);
            a = vmaxq_f32(v, a);
            b2 = vmaxq_f32(vminq_f32(w, a2), b2);
            a2 = vmaxq_f32(w, a2);
        }
        if (e + 4 <= E) {
            float32x4_t v = vld1q_f32(x + e);
            unordered = vorrq_u32(unordered, colibri_unord4n(v));
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
#endif
    for (; e < E; e++) {
        float v = x[e];
        nan |= v != v;
        m2 = v > m2 ? (v > m1 ? m1 : v) : m2;
        m1 = v > m1 ? v : m1;
    }
    *first = m1;
    *second = m2;
    return nan;
}

/* One 64-element span's part in finding the top two's ids: k1 and k2 mark its elements
 * equal to m1 and m2 (bit i: element base + i). The first m1 is *i1, the first m2 other
 * than it *i2 (-1 while unknown). Returns 1 once both are known. */
static inline int colibri_top2_claim(uint64_t k1, uint64_t k2, int32_t base, int32_t *i1,
                                     int32_t *i2)
{
    if (*i1 < 0 && k1)
        *i1 = base + colibri_ctz64(k1);
    if (*i1 >= base)
        k2 &= ~((uint64_t)1 << (*i1 - base)); /* *i1 - base < 64: found in this span */
    if (*i2 < 0 && k2)
        *i2 = base + colibri_ctz64(k2);
    return *i1 >= 0 && *i2 >= 0;
}

/* The ids of the top two of x[0..E) (no NaN), given their values m1 >= m2: the first
 * occurrence of m1, then the first occurrence of m2 other than that one. Masks of the
 * elements equal to each value, 64 elements at a time: no branch per element. */
static inline void colibri_top2_ids(const float *x, int32_t E, float m1, float m2, int32_t *ids)
{
    int32_t base, e, i1 = -1, i2 = -1;
#ifdef COLIBRI_NEON
    const int neon = colibri_neon_on();
#endif
    for (base = 0; base < E; base += 64) {
        const float *span = x + base;
        int32_t n = E - base < 64 ? E - base : 64;
        uint64_t k1 = 0, k2 = 0;
        e = 0;
#ifdef COLIBRI_SSE2
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
#endif
#ifdef COLIBRI_NEON
        if (neon) {
            const float32x4_t v1 = vdupq_n_f32(m1), v2 = vdupq_n_f32(m2);
            for (; e + 4 <= n; e += 4) {
                float32x4_t v = vld1q_f32(span + e);
                k1 |= (uint64_t)(uint32_t)colibri_mask4n(vceqq_f32(v, v1)) << e;
                k2 |= (uint64_t)(uint32_t)colibri_mask4n(vceqq_f32(v, v2)) << e;
            }
        }
#endif
        for (; e < n; e++) {
            k1 |= (uint64_t)(span[e] == m1) << e;
            k2 |= (uint64_t)(span[e] == m2) << e;
        }
        if (colibri_top2_claim(k1, k2, base, &i1, &i2))
            break;
    }
    ids[0] = i1;
    ids[1] = i2;
}

/* A bound for top-k, k <= 8: a value that at least k elements of x[0..E) reach. Each of 4
 * lanes keeps its best two; the smallest of the 8 (or of the 4 lane maxima when k <= 4)
 * is such a value, and usually only a few more elements reach it. -inf where no SIMD.
 * Sets *nan when x holds a NaN. */
static inline float colibri_lane_bound(const float *x, int32_t E, int32_t k, int *nan)
{
    int32_t e = 0;
    float bound = -INFINITY;
#ifdef COLIBRI_SSE2
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
#endif
#ifdef COLIBRI_NEON
    if (E >= 8 && colibri_neon_on()) {
        float32x4_t a = vdupq_n_f32(-INFINITY), b = a;
        uint32x4_t unordered = vdupq_n_u32(0);
        for (; e + 4 <= E; e += 4) {
            float32x4_t v = vld1q_f32(x + e);
            unordered = vorrq_u32(unordered, colibri_unord4n(v));
            b = vmaxq_f32(vminq_f32(v, a), b);
            a = vmaxq_f32(v, a);
        }
        bound = vminvq_f32(k <= 4 ? a : b);
        *nan |= vmaxvq_u32(unordered) != 0;
    }
#endif
    (void)k;
    for (; e < E; e++)
        *nan |= x[e] != x[e];
    return bound;
}

/* Append to cand the ids first + e of x[first .. last) with x >= bound; returns the new
 * count. Keys are never NaN here. cand needs 3 spare slots. */
static inline int32_t colibri_compact(const float *x, int32_t first, int32_t last, float bound,
                                      int32_t *cand, int32_t c)
{
    int32_t e = first;
#if defined(COLIBRI_SSE2) || defined(COLIBRI_NEON)
    static const int32_t lanes[16][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0},
                                         {2, 0, 0, 0}, {0, 2, 0, 0}, {1, 2, 0, 0}, {0, 1, 2, 0},
                                         {3, 0, 0, 0}, {0, 3, 0, 0}, {1, 3, 0, 0}, {0, 1, 3, 0},
                                         {2, 3, 0, 0}, {0, 2, 3, 0}, {1, 2, 3, 0}, {0, 1, 2, 3}};
    static const signed char count[16] = {0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4};
#endif
#ifdef COLIBRI_NEON
    if (colibri_neon_on()) {
        float32x4_t b = vdupq_n_f32(bound);
        for (; e + 4 <= last; e += 4) {
            int mask = colibri_mask4n(vcgeq_f32(vld1q_f32(x + e), b));
            vst1q_s32(cand + c, vaddq_s32(vld1q_s32(lanes[mask]), vdupq_n_s32(e)));
            c += count[mask];
        }
    }
#endif
#ifdef COLIBRI_SSE2
    __m128 b = _mm_set1_ps(bound);
    for (; e + 4 <= last; e += 4) {
        int mask = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(x + e), b));
        __m128i at =
            _mm_add_epi32(_mm_loadu_si128((const __m128i *)lanes[mask]), _mm_set1_epi32(e));
        _mm_storeu_si128((__m128i *)(cand + c), at);
        c += count[mask];
    }
#endif
    for (; e < last; e++) {
        cand[c] = e;
        c += x[e] >= bound;
    }
    return c;
}

/* How many of the candidates (cv, cand)[0..c) come before candidate i (cv padded to whole
 * vectors with NaN, cand with INT32_MAX). */
static inline int32_t colibri_rank(const float *cv, const int32_t *cand, int32_t c, int32_t i)
{
    int32_t q, rank = 0;
    if (cv[i] != cv[i]) { /* a NaN comes after the numbers and after the NaNs of lower id */
        for (q = 0; q < c; q++)
            rank += cv[q] == cv[q] || cand[q] < cand[i];
        return rank;
    }
#ifdef COLIBRI_SSE2
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
    rank = _mm_cvtsi128_si32(before);
#else
#ifdef COLIBRI_NEON
    if (colibri_neon_on()) {
        float32x4_t v = vdupq_n_f32(cv[i]);
        int32x4_t id = vdupq_n_s32(cand[i]), before = vdupq_n_s32(0);
        for (q = 0; q < c; q += 4) {
            float32x4_t w = vld1q_f32(cv + q);
            uint32x4_t tie = vandq_u32(vceqq_f32(w, v), vcltq_s32(vld1q_s32(cand + q), id));
            before = vsubq_s32(before, vreinterpretq_s32_u32(vorrq_u32(vcgtq_f32(w, v), tie)));
        }
        return vaddvq_s32(before);
    }
#endif
    for (q = 0; q < c; q++)
        rank += colibri_before(cv[q], cand[q], cv[i], cand[i]);
#endif
    return rank;
}

/* The k best of the candidates cand[0..c) (ids into key; any order), c >= k, into vals/ids
 * in top-k order. Up to COLIBRI_RANK_MAX candidates each one's rank is counted (how many
 * come before it) and it goes to that slot: no data-dependent branch. cv: c + 3 floats of
 * scratch; cand needs 3 spare slots; vals, ids: k + 1 slots (the last one takes the rest). */
static inline void colibri_select(const float *key, int32_t *cand, int32_t c, int32_t k, float *cv,
                                  float *vals, int32_t *ids)
{
    int32_t i, n = 0;
    if (c > COLIBRI_RANK_MAX) {
        for (i = 0; i < c; i++)
            colibri_push(vals, ids, &n, k, key[cand[i]], cand[i]);
        return;
    }
    for (i = 0; i < c; i++)
        cv[i] = key[cand[i]];
    for (; i & 3; i++) {
        cv[i] = NAN;
        cand[i] = INT32_MAX;
    }
    for (i = 0; i < c; i++) {
        int32_t rank = colibri_rank(cv, cand, c, i);
        rank = rank < k ? rank : k;
        vals[rank] = cv[i];
        ids[rank] = cand[i];
    }
}

/* scores = sigmoid(x), keys = scores + bias (x + bias when on_logits; no keys without a
 * bias); returns nonzero when x holds a NaN. */
static inline int colibri_sigmoid_keys(const float *x, int32_t E, const float *bias, int on_logits,
                                       float *scores, float *keys)
{
    int32_t e = 0;
    int nan = 0;
#ifdef COLIBRI_SSE2
    __m128 unordered = _mm_setzero_ps();
    for (; e + 4 <= E; e += 4) {
        __m128 v = _mm_loadu_ps(x + e);
        __m128 s = colibri_sigmoid4(v);
        unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
        _mm_storeu_ps(scores + e, s);
        if (bias != NULL)
            _mm_storeu_ps(keys + e, _mm_add_ps(on_logits ? v : s, _mm_loadu_ps(bias + e)));
    }
    nan = _mm_movemask_ps(unordered);
#endif
#ifdef COLIBRI_NEON
    if (colibri_neon_on()) {
        uint32x4_t unordered = vdupq_n_u32(0);
        for (; e + 4 <= E; e += 4) {
            float32x4_t v = vld1q_f32(x + e);
            float32x4_t s = colibri_sigmoid4n(v);
            unordered = vorrq_u32(unordered, colibri_unord4n(v));
            vst1q_f32(scores + e, s);
            if (bias != NULL)
                vst1q_f32(keys + e, vaddq_f32(on_logits ? v : s, vld1q_f32(bias + e)));
        }
        nan = vmaxvq_u32(unordered) != 0;
    }
#endif
    for (; e < E; e++) {
        nan |= x[e] != x[e];
        scores[e] = colibri_sigmoid(x[e]);
        if (bias != NULL)
            keys[e] = (on_logits ? x[e] : scores[e]) + bias[e];
    }
    return nan;
}

/* Whether this CPU runs the AVX-512F code compiled in (0 when none was, or COLIBRI_SIMD
 * caps the path below avx512). */
static inline int colibri_cpu_has_avx512(void)
{
#ifdef COLIBRI_AVX512
    int path = colibri_simd_path();
    return path == COLIBRI_PATH_AVX512 || path == COLIBRI_PATH_AVX512_BF16;
#else
    return 0;
#endif
}

/* Whether this CPU runs the AVX2 code compiled in (0 when none was, or COLIBRI_SIMD caps
 * the path below avx2). */
static inline int colibri_cpu_has_avx2(void)
{
#ifdef COLIBRI_AVX2
    int path = colibri_simd_path();
    return path >= COLIBRI_PATH_AVX2 && path != COLIBRI_PATH_NEON;
#else
    return 0;
#endif
}

#ifdef COLIBRI_AVX2
/* merged top two of lane pairs (lo, hi) picked from two rows' registers by a shuffle */
#define COLIBRI_FOLD(max, min, shuffle, a1, b1, a2, b2, ilo, ihi, oa, ob)        \
    do {                                                                         \
        __typeof__(a1) lo_ = shuffle(a1, a2, ilo), hi_ = shuffle(a1, a2, ihi);   \
        __typeof__(a1) blo_ = shuffle(b1, b2, ilo), bhi_ = shuffle(b1, b2, ihi); \
        ob = max(min(lo_, hi_), max(blo_, bhi_));                                \
        oa = max(lo_, hi_);                                                      \
    } while (0)
#endif

#ifdef COLIBRI_AVX512
/* colibri_exp4 and colibri_sigmoid4 on 16 lanes: the same IEEE results bit for bit, in
 * fewer operations (checked for every float in the tests). n is rounded by roundscale, which
 * gives the integer the magic-number add and subtract round to (|n| <= 150 here); the final
 * p * 2^n1 * 2^n2 is scalef's p * 2^n: both scalings are exact but the last, so each result
 * is p * 2^n rounded once (subnormal results included), or inf for both. */
COLIBRI_AVX512_FN static inline __m512 colibri_exp16(__m512 x)
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

COLIBRI_AVX512_FN static inline __m512 colibri_sigmoid16(__m512 x)
{
    __m512i sign = _mm512_set1_epi32((int32_t)0x80000000);
    __m512 z = colibri_exp16(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign)));
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

COLIBRI_AVX512_FN static inline __mmask16 colibri_tail16(int32_t left)
{
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

COLIBRI_AVX512_FN static inline int colibri_top2_values16(const float *x, int32_t E, float *first,
                                                          float *second)
{
    const __m512 none = _mm512_set1_ps(-INFINITY);
    __m512 a = none, b = none;
    __mmask16 unordered = 0;
    int32_t e;
    for (e = 0; e < E; e += 16) {
        __m512 v = _mm512_mask_loadu_ps(none, colibri_tail16(E - e), x + e);
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
COLIBRI_AVX512_FN static inline void colibri_span_masks16(const float *x, int32_t n, __m512 v1,
                                                          __m512 v2, uint64_t *k1, uint64_t *k2)
{
    int32_t e;
    *k1 = *k2 = 0;
    for (e = 0; e < n; e += 16) {
        __mmask16 m = colibri_tail16(n - e);
        __m512 v = _mm512_maskz_loadu_ps(m, x + e);
        *k1 |= (uint64_t)_mm512_mask_cmp_ps_mask(m, v, v1, _CMP_EQ_OQ) << e;
        *k2 |= (uint64_t)_mm512_mask_cmp_ps_mask(m, v, v2, _CMP_EQ_OQ) << e;
    }
}

COLIBRI_AVX512_FN static inline void colibri_top2_ids16(const float *x, int32_t E, float m1,
                                                        float m2, int32_t *ids)
{
    const __m512 v1 = _mm512_set1_ps(m1), v2 = _mm512_set1_ps(m2);
    int32_t base, i1 = -1, i2 = -1;
    for (base = 0; base < E; base += 64) {
        uint64_t k1, k2;
        colibri_span_masks16(x + base, E - base < 64 ? E - base : 64, v1, v2, &k1, &k2);
        if (colibri_top2_claim(k1, k2, base, &i1, &i2))
            break;
    }
    ids[0] = i1;
    ids[1] = i2;
}

/* The top two of 16 sets of 16 lanes (a[i], b[i]: each lane's best and second in set i),
 * folded pairwise: each shuffle step merges two sets' registers into one, so the cross-lane
 * work is shared, not done per set. m1, m2: lane i holds set i's best and second. */
COLIBRI_AVX512_FN static inline void colibri_fold16(__m512 *a, __m512 *b, __m512 *m1, __m512 *m2)
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

/* colibri_sigmoid_keys, 16 logits at a time (2x at E=256: the score pass dominates
 * DeepSeek-V3 routing); the SSE2 code takes the last E mod 16. */
COLIBRI_AVX512_FN static inline int colibri_sigmoid_keys16(const float *x, int32_t E,
                                                           const float *bias, int on_logits,
                                                           float *scores, float *keys)
{
    int32_t e = 0;
    __mmask16 unordered = 0;
    for (; e + 16 <= E; e += 16) {
        __m512 v = _mm512_loadu_ps(x + e);
        __m512 s = colibri_sigmoid16(v);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        _mm512_storeu_ps(scores + e, s);
        if (bias != NULL)
            _mm512_storeu_ps(keys + e, _mm512_add_ps(on_logits ? v : s, _mm512_loadu_ps(bias + e)));
    }
    return (unordered != 0)
           | colibri_sigmoid_keys(x + e, E - e, bias != NULL ? bias + e : NULL, on_logits,
                                  scores + e, keys + e);
}
#endif

#ifdef COLIBRI_AVX2
/* colibri_exp4 and colibri_sigmoid4 on 8 lanes: the same IEEE operations in the same order. */
COLIBRI_AVX2_FN static inline __m256 colibri_exp8(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(COLIBRI_EXP_LO));
    x = _mm256_min_ps(x, _mm256_set1_ps(COLIBRI_EXP_HI));
    __m256 magic = _mm256_set1_ps(COLIBRI_ROUND_MAGIC);
    __m256 n =
        _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(COLIBRI_LOG2E)), magic), magic);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(COLIBRI_LN2_HI)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(COLIBRI_LN2_LO)));
    __m256 p = _mm256_set1_ps(COLIBRI_EXP_P5);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(COLIBRI_EXP_P4));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(COLIBRI_EXP_P3));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(COLIBRI_EXP_P2));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(COLIBRI_EXP_P1));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(COLIBRI_EXP_P0));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r),
                      _mm256_set1_ps(1.0f));
    __m256i ni = _mm256_cvttps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1);
    __m256i n2 = _mm256_sub_epi32(ni, n1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

COLIBRI_AVX2_FN static inline __m256 colibri_sigmoid8(__m256 x)
{
    __m256 z = colibri_exp8(_mm256_or_ps(x, _mm256_set1_ps(-0.0f))); /* exp(-|x|) */
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 is_pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    return _mm256_div_ps(_mm256_blendv_ps(z, one, is_pos), _mm256_add_ps(one, z));
}

/* colibri_sigmoid_keys, 8 logits at a time; the SSE2 code takes the last E mod 8. */
COLIBRI_AVX2_FN static inline int colibri_sigmoid_keys8(const float *x, int32_t E,
                                                        const float *bias, int on_logits,
                                                        float *scores, float *keys)
{
    int32_t e = 0;
    __m256 unordered = _mm256_setzero_ps();
    for (; e + 8 <= E; e += 8) {
        __m256 v = _mm256_loadu_ps(x + e);
        __m256 s = colibri_sigmoid8(v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        _mm256_storeu_ps(scores + e, s);
        if (bias != NULL)
            _mm256_storeu_ps(keys + e, _mm256_add_ps(on_logits ? v : s, _mm256_loadu_ps(bias + e)));
    }
    return (_mm256_movemask_ps(unordered) != 0)
           | colibri_sigmoid_keys(x + e, E - e, bias != NULL ? bias + e : NULL, on_logits,
                                  scores + e, keys + e);
}

/* colibri_exp_shifted with 8-lane exponentials, summed as the SSE2 code sums them: one
 * 4-lane accumulator taking each vector's low half, then its high half. */
COLIBRI_AVX2_FN static inline float colibri_exp_shifted8(const float *x, float m, float *out,
                                                         int32_t E)
{
    int32_t e = 0;
    float sum, lanes[4];
    __m256 mm = _mm256_set1_ps(m);
    __m128 acc = _mm_setzero_ps();
    for (; e + 8 <= E; e += 8) {
        __m256 v = colibri_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + e), mm));
        _mm256_storeu_ps(out + e, v);
        acc = _mm_add_ps(acc, _mm256_castps256_ps128(v));
        acc = _mm_add_ps(acc, _mm256_extractf128_ps(v, 1));
    }
    if (e + 4 <= E) {
        __m128 v = colibri_exp4(_mm_sub_ps(_mm_loadu_ps(x + e), _mm_set1_ps(m)));
        _mm_storeu_ps(out + e, v);
        acc = _mm_add_ps(acc, v);
        e += 4;
    }
    _mm_storeu_ps(lanes, acc);
    sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; e < E; e++) {
        out[e] = colibri_exp(x[e] - m);
        sum += out[e];
    }
    return sum;
}

/* scores = sqrt(softplus(x)) with the exponentials 8 at a time (log1pf stays libm's). */
COLIBRI_AVX2_FN static inline void colibri_sqrtsoftplus8(const float *x, int32_t E, float *scores)
{
    int32_t e = 0;
    for (; e + 8 <= E; e += 8)
        _mm256_storeu_ps(scores + e, colibri_exp8(_mm256_loadu_ps(x + e)));
    for (e = 0; e < E; e++) {
        float ex = e < (E & ~7) ? scores[e] : colibri_exp(x[e]);
        scores[e] = sqrtf(x[e] > 20.0f ? x[e] : log1pf(ex));
    }
}

/* colibri_top2_values on 8 lanes (two sets of lanes, as the SSE2 code), E >= 16. */
COLIBRI_AVX2_FN static inline int colibri_top2_values8(const float *x, int32_t E, float *first,
                                                       float *second)
{
    int32_t e = 0;
    float m1, m2;
    __m256 a = _mm256_set1_ps(-INFINITY), b = a, a2 = a, b2 = a;
    __m256 unordered = _mm256_setzero_ps();
    for (; e + 16 <= E; e += 16) {
        __m256 v = _mm256_loadu_ps(x + e), w = _mm256_loadu_ps(x + e + 8);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, w, _CMP_UNORD_Q));
        b = _mm256_max_ps(_mm256_min_ps(v, a), b);
        a = _mm256_max_ps(v, a);
        b2 = _mm256_max_ps(_mm256_min_ps(w, a2), b2);
        a2 = _mm256_max_ps(w, a2);
    }
    if (e + 8 <= E) {
        __m256 v = _mm256_loadu_ps(x + e);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        b = _mm256_max_ps(_mm256_min_ps(v, a), b);
        a = _mm256_max_ps(v, a);
        e += 8;
    }
    b = _mm256_max_ps(_mm256_min_ps(a, a2), _mm256_max_ps(b, b2));
    a = _mm256_max_ps(a, a2);
    {
        /* the two halves, then lane pairs twice */
        __m128 lo = _mm256_castps256_ps128(a), hi = _mm256_extractf128_ps(a, 1);
        __m128 blo = _mm256_castps256_ps128(b), bhi = _mm256_extractf128_ps(b, 1);
        __m128 s = _mm_max_ps(_mm_min_ps(lo, hi), _mm_max_ps(blo, bhi));
        __m128 f = _mm_max_ps(lo, hi), f2, s2;
        f2 = _mm_shuffle_ps(f, f, _MM_SHUFFLE(1, 0, 3, 2));
        s2 = _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2));
        s = _mm_max_ps(_mm_min_ps(f, f2), _mm_max_ps(s, s2));
        f = _mm_max_ps(f, f2);
        f2 = _mm_shuffle_ps(f, f, _MM_SHUFFLE(2, 3, 0, 1));
        s2 = _mm_shuffle_ps(s, s, _MM_SHUFFLE(2, 3, 0, 1));
        s = _mm_max_ps(_mm_min_ps(f, f2), _mm_max_ps(s, s2));
        f = _mm_max_ps(f, f2);
        m1 = _mm_cvtss_f32(f);
        m2 = _mm_cvtss_f32(s);
    }
    int nan = _mm256_movemask_ps(unordered);
    for (; e < E; e++) {
        float v = x[e];
        nan |= v != v;
        m2 = v > m2 ? (v > m1 ? m1 : v) : m2;
        m1 = v > m1 ? v : m1;
    }
    *first = m1;
    *second = m2;
    return nan;
}

/* colibri_top2_ids with 8-lane equality masks. */
COLIBRI_AVX2_FN static inline void colibri_top2_ids8(const float *x, int32_t E, float m1, float m2,
                                                     int32_t *ids)
{
    const __m256 v1 = _mm256_set1_ps(m1), v2 = _mm256_set1_ps(m2);
    int32_t base, e, i1 = -1, i2 = -1;
    for (base = 0; base < E; base += 64) {
        const float *span = x + base;
        int32_t n = E - base < 64 ? E - base : 64;
        uint64_t k1 = 0, k2 = 0;
        for (e = 0; e + 8 <= n; e += 8) {
            __m256 v = _mm256_loadu_ps(span + e);
            k1 |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, v1, _CMP_EQ_OQ)) << e;
            k2 |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, v2, _CMP_EQ_OQ)) << e;
        }
        for (; e < n; e++) {
            k1 |= (uint64_t)(span[e] == m1) << e;
            k2 |= (uint64_t)(span[e] == m2) << e;
        }
        if (colibri_top2_claim(k1, k2, base, &i1, &i2))
            break;
    }
    ids[0] = i1;
    ids[1] = i2;
}

/* colibri_lane_bound on 8 lanes, E >= 16: for k <= 8 the smallest lane maximum (8 distinct
 * elements reach it), a tighter bound than 4 lanes give; the same candidates survive
 * selection, so the same answers. */
COLIBRI_AVX2_FN static inline float colibri_lane_bound8(const float *x, int32_t E, int32_t k,
                                                        int *nan)
{
    int32_t e = 0;
    __m256 a = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    (void)k; /* k <= COLIBRI_BOUND_MAX_K = 8 */
    for (; e + 8 <= E; e += 8) {
        __m256 v = _mm256_loadu_ps(x + e);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        a = _mm256_max_ps(v, a);
    }
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_min_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_min_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    *nan |= _mm256_movemask_ps(unordered);
    for (; e < E; e++)
        *nan |= x[e] != x[e];
    return _mm_cvtss_f32(m);
}

/* colibri_compact comparing 8 keys at a time (each half's ids stored by the 4-lane table). */
COLIBRI_AVX2_FN static inline int32_t colibri_compact8(const float *x, int32_t first, int32_t last,
                                                       float bound, int32_t *cand, int32_t c)
{
    static const int32_t lanes[16][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0},
                                         {2, 0, 0, 0}, {0, 2, 0, 0}, {1, 2, 0, 0}, {0, 1, 2, 0},
                                         {3, 0, 0, 0}, {0, 3, 0, 0}, {1, 3, 0, 0}, {0, 1, 3, 0},
                                         {2, 3, 0, 0}, {0, 2, 3, 0}, {1, 2, 3, 0}, {0, 1, 2, 3}};
    static const signed char count[16] = {0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4};
    int32_t e = first;
    __m256 b = _mm256_set1_ps(bound);
    for (; e + 8 <= last; e += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + e), b, _CMP_GE_OQ));
        int lo = mask & 15, hi = mask >> 4;
        _mm_storeu_si128(
            (__m128i *)(cand + c),
            _mm_add_epi32(_mm_loadu_si128((const __m128i *)lanes[lo]), _mm_set1_epi32(e)));
        c += count[lo];
        _mm_storeu_si128(
            (__m128i *)(cand + c),
            _mm_add_epi32(_mm_loadu_si128((const __m128i *)lanes[hi]), _mm_set1_epi32(e + 4)));
        c += count[hi];
    }
    return colibri_compact(x, e, last, bound, cand, c);
}
#endif /* COLIBRI_AVX2 */

/* colibri_sigmoid_keys of a row of r's experts, 16 lanes wide where r allows. */
static inline int colibri_row_sigmoid_keys(const colibri_router_t *r, const float *x, float *scores,
                                           float *keys)
{
#ifdef COLIBRI_AVX512
    if (r->use_avx512)
        return colibri_sigmoid_keys16(x, r->num_experts, r->bias, r->bias_on_logits, scores, keys);
#endif
#ifdef COLIBRI_AVX2
    if (r->use_avx2)
        return colibri_sigmoid_keys8(x, r->num_experts, r->bias, r->bias_on_logits, scores, keys);
#endif
    return colibri_sigmoid_keys(x, r->num_experts, r->bias, r->bias_on_logits, scores, keys);
}

/* colibri_top2_values / colibri_top2_ids of a row of r's experts, 16 lanes wide where r
 * allows and E >= 16 (E=26: 20% faster, E=256: 25%; E=8 is faster on 4 lanes). */
static inline int colibri_row_top2_values(const colibri_router_t *r, const float *x, float *first,
                                          float *second)
{
#ifdef COLIBRI_AVX512
    if (r->use_avx512 && r->num_experts >= 16)
        return colibri_top2_values16(x, r->num_experts, first, second);
#endif
#ifdef COLIBRI_AVX2
    if (r->use_avx2 && r->num_experts >= 16)
        return colibri_top2_values8(x, r->num_experts, first, second);
#endif
    return colibri_top2_values(x, r->num_experts, first, second);
}

static inline void colibri_row_top2_ids(const colibri_router_t *r, const float *x, float m1,
                                        float m2, int32_t *ids)
{
#ifdef COLIBRI_AVX512
    if (r->use_avx512 && r->num_experts >= 16) {
        colibri_top2_ids16(x, r->num_experts, m1, m2, ids);
        return;
    }
#endif
#ifdef COLIBRI_AVX2
    if (r->use_avx2 && r->num_experts >= 16) {
        colibri_top2_ids8(x, r->num_experts, m1, m2, ids);
        return;
    }
#endif
    colibri_top2_ids(x, r->num_experts, m1, m2, ids);
}

/* colibri_lane_bound / colibri_compact of a row, 8 lanes wide where r allows. */
static inline float colibri_row_lane_bound(const colibri_router_t *r, const float *x, int32_t E,
                                           int32_t k, int *nan)
{
#ifdef COLIBRI_AVX2
    if (r->use_avx2 && E >= 16)
        return colibri_lane_bound8(x, E, k, nan);
#endif
    (void)r;
    return colibri_lane_bound(x, E, k, nan);
}

static inline int32_t colibri_row_compact(const colibri_router_t *r, const float *x, int32_t first,
                                          int32_t last, float bound, int32_t *cand, int32_t c)
{
#ifdef COLIBRI_AVX2
    if (r->use_avx2)
        return colibri_compact8(x, first, last, bound, cand, c);
#endif
    (void)r;
    return colibri_compact(x, first, last, bound, cand, c);
}

/* Whether x[0..E) holds a NaN. */
static inline int colibri_has_nan(const float *x, int32_t E)
{
    int32_t e = 0;
    int nan = 0;
#ifdef COLIBRI_SSE2
    __m128 unordered = _mm_setzero_ps();
    for (; e + 4 <= E; e += 4) {
        __m128 v = _mm_loadu_ps(x + e);
        unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
    }
    nan = _mm_movemask_ps(unordered);
#endif
#ifdef COLIBRI_NEON
    if (colibri_neon_on()) {
        uint32x4_t unordered = vdupq_n_u32(0);
        for (; e + 4 <= E; e += 4)
            unordered = vorrq_u32(unordered, colibri_unord4n(vld1q_f32(x + e)));
        nan = vmaxvq_u32(unordered) != 0;
    }
#endif
    for (; e < E; e++)
        nan |= x[e] != x[e];
    return nan;
}

/* Softmax of the row into out[E]; returns 0, or COLIBRI_ROW_ALL_NEG_INF when undefined.
 * +inf logits share the whole mass equally (the limit of softmax). wide: 8-lane
 * exponentials (the same bits). */
static inline int colibri_softmax_wide(const float *x, int32_t E, float *out, int wide)
{
    int32_t e;
    float m = -INFINITY, sum = 0.0f;
    for (e = 0; e < E; e++)
        m = x[e] > m ? x[e] : m;
    if (m == -INFINITY)
        return COLIBRI_ROW_ALL_NEG_INF;
    if (m == INFINITY) {
        for (e = 0; e < E; e++) {
            out[e] = x[e] == INFINITY ? 1.0f : 0.0f;
            sum += out[e];
        }
    } else {
#ifdef COLIBRI_AVX2
        sum = wide ? colibri_exp_shifted8(x, m, out, E) : colibri_exp_shifted(x, m, out, E);
#else
        sum = colibri_exp_shifted(x, m, out, E);
#endif
    }
    (void)wide;
    float inv = 1.0f / sum;
    for (e = 0; e < E; e++)
        out[e] *= inv;
    return COLIBRI_OK;
}

static inline int colibri_softmax(const float *x, int32_t E, float *out)
{
    return colibri_softmax_wide(x, E, out, 0);
}

static inline float colibri_score(int scoring, float x)
{
    return scoring == COLIBRI_SIGMOID ? colibri_sigmoid(x) : colibri_sqrtsoftplus(x);
}

/* Weights of the chosen experts tid[0..k) of row x (scores: the row's scores, or NULL when
 * the keys were the logits), into weights/ids. scratch: as for colibri_route_row. */
static inline int colibri_weights(const colibri_router_t *r, const float *x, const float *scores,
                                  const int32_t *tid, void *scratch, int32_t *ids, float *weights)
{
    const int32_t E = r->num_experts, k = r->top_k;
    int32_t j;
    int normalized = 0;
    const int have_scores = scores != NULL;
    /* the scratch's scores area, free when scores == NULL */
    float *softmax = (float *)((char *)scratch + colibri_scratch_layout(r).scores);

    /* Weights from the unbiased scores of the chosen experts. */
    if (have_scores) {
        for (j = 0; j < k; j++)
            weights[j] = scores[tid[j]];
    } else if (r->scoring == COLIBRI_SOFTMAX && r->normalize) {
        /* renormalised softmax over the k chosen = exp(x - max chosen) / sum; the keys are
         * the logits here, so the first chosen is the max */
        const float m = x[tid[0]];
        if (m == -INFINITY)
            return COLIBRI_ROW_ALL_NEG_INF;
        if (m == INFINITY) {
            for (j = 0; j < k; j++)
                weights[j] = x[tid[j]] == INFINITY ? 1.0f : 0.0f;
        } else if (r->norm_p == 1.0f) {
            /* the common case, done here: terms in (0, 1], the first is exp(0) = 1 */
            float sum = 1.0f;
            weights[0] = 1.0f;
            colibri_exp_gathered(x, tid + 1, k - 1, m, weights + 1);
            for (j = 1; j < k; j++)
                sum += weights[j];
            sum += r->norm_eps;
            for (j = 0; j < k; j++)
                weights[j] /= sum;
            normalized = 1;
        } else {
            colibri_exp_gathered(x, tid, k, m, weights);
        }
    } else if (r->scoring == COLIBRI_SOFTMAX) {
        if (colibri_softmax_wide(x, E, softmax, r->use_avx2) != COLIBRI_OK)
            return COLIBRI_ROW_ALL_NEG_INF;
        for (j = 0; j < k; j++)
            weights[j] = softmax[tid[j]];
    } else {
        for (j = 0; j < k; j++)
            weights[j] = colibri_score(r->scoring, x[tid[j]]);
    }

    if (r->normalize && !normalized) {
        /* weights are >= 0: divide by their p-norm, computed on w / max so that no power
         * overflows (sqrt-softplus of 3e38 squared would) */
        float largest = 0.0f, norm = 0.0f;
        int32_t infinite = 0;
        for (j = 0; j < k; j++) {
            infinite += weights[j] == INFINITY;
            largest = weights[j] > largest ? weights[j] : largest;
        }
        if (infinite) {
            /* sqrt-softplus of +inf: the infinite weights share the unit norm equally */
            float share = r->norm_p == 1.0f ? 1.0f / (float)infinite
                                            : powf((float)infinite, -1.0f / r->norm_p);
            for (j = 0; j < k; j++)
                weights[j] = weights[j] == INFINITY ? share : 0.0f;
        } else if (largest > 0.0f) {
            if (r->norm_p == 1.0f) {
                for (j = 0; j < k; j++)
                    norm += weights[j];
                norm += r->norm_eps;
                for (j = 0; j < k; j++) /* divide: 1 / a subnormal sum would overflow */
                    weights[j] /= norm;
            } else if (r->norm_eps == 0.0f) {
                for (j = 0; j < k; j++)
                    norm += colibri_pow_p(weights[j] / largest, r->norm_p);
                norm = colibri_root_p(norm, r->norm_p);
                for (j = 0; j < k; j++)
                    weights[j] = weights[j] / largest / norm;
            } else {
                for (j = 0; j < k; j++)
                    norm += colibri_pow_p(weights[j] / largest, r->norm_p);
                norm = largest * colibri_root_p(norm, r->norm_p) + r->norm_eps;
                for (j = 0; j < k; j++)
                    weights[j] /= norm;
            }
        }
    }
    for (j = 0; j < k; j++) {
        float w = weights[j];
        if (r->expert_scale != NULL)
            w *= r->expert_scale[tid[j]];
        weights[j] = w * r->scale;
        ids[j] = tid[j];
    }
    return COLIBRI_OK;
}

/* Route one row. x: [E] float32 logits; scratch: colibri_scratch_bytes(r) bytes, 4-aligned;
 * ids, weights: [k]. Returns COLIBRI_OK or a row status (nothing useful written then). */
static inline int colibri_route_row(const colibri_router_t *r, const float *x, void *scratch,
                                    int32_t *ids, float *weights)
{
    const int32_t E = r->num_experts, k = r->top_k;
    const int32_t G = r->num_groups > 1 ? r->num_groups : 1;
    const colibri_scratch_t s = colibri_scratch_layout(r);
    char *mem = (char *)scratch;
    float *scores = (float *)(mem + s.scores);
    float *keys = (float *)(mem + s.keys);
    float *grouped = (float *)(mem + s.grouped);
    float *cv = (float *)(mem + s.cand_keys);
    int32_t *cand = (int32_t *)(mem + s.cand);
    float *gscore = (float *)(mem + s.group_scores);
    float *grunner = (float *)(mem + s.group_runners);
    float *gval = (float *)(mem + s.kept_scores);
    int32_t *gid = (int32_t *)(mem + s.kept);
    float *tval = (float *)(mem + s.top_keys);
    int32_t *tid = (int32_t *)(mem + s.top);
    int32_t e, j, g, c = 0;
    int nan = 0;
    float bound = -INFINITY;

    /* Selection keys: the logits, unless a bias or top-2-sum group scores need true scores. */
    const float *key = x;
    const int have_scores = r->bias != NULL || (G > 1 && r->group_score == COLIBRI_GROUP_TOP2_SUM);
    if (G == 1 && !have_scores && k <= 2 && E >= 2) {
        float m1, m2;
        if (colibri_row_top2_values(r, x, &m1, &m2))
            return COLIBRI_ROW_NAN;
        colibri_row_top2_ids(r, x, m1, m2, tid);
        return colibri_weights(r, x, NULL, tid, scratch, ids, weights);
    }
    if (have_scores && r->scoring == COLIBRI_SIGMOID) {
        nan = colibri_row_sigmoid_keys(r, x, scores, keys);
        key = r->bias != NULL ? keys : scores;
    } else if (have_scores) {
        if (colibri_has_nan(x, E))
            return COLIBRI_ROW_NAN;
        if (r->scoring == COLIBRI_SOFTMAX) {
            if (colibri_softmax_wide(x, E, scores, r->use_avx2) != COLIBRI_OK)
                return COLIBRI_ROW_ALL_NEG_INF;
        } else {
#ifdef COLIBRI_AVX2
            if (r->use_avx2)
                colibri_sqrtsoftplus8(x, E, scores);
            else
#endif
#ifdef COLIBRI_NEON
                if (colibri_neon_on())
                colibri_sqrtsoftplus4n(x, E, scores);
            else
#endif
                for (e = 0; e < E; e++)
                    scores[e] = colibri_sqrtsoftplus(x[e]);
        }
        key = scores;
        if (r->bias != NULL) {
            const float *base = r->bias_on_logits ? x : scores;
            for (e = 0; e < E; e++)
                keys[e] = base[e] + r->bias[e];
            key = keys;
        }
    } else if (G == 1 && k > COLIBRI_BOUND_MAX_K) {
        nan = colibri_has_nan(x, E); /* (group scores check every key for NaN) */
    }

    if (G > 1) {
        /* group scores from each group's best two keys; keep the topk_groups best */
        const int32_t ng = r->topk_groups;
        const float *gkey = key;
        if (!r->groups_in_order) {
            for (e = 0; e < E; e++)
                grouped[e] = key[r->group_members[e]];
            gkey = grouped;
        }
        for (g = 0; g < G; g++) {
            float m1, m2;
            int32_t first = r->group_start[g];
            nan |= colibri_top2_values(gkey + first, r->group_start[g + 1] - first, &m1, &m2);
            grunner[g] = m2;
            gscore[g] = r->group_score == COLIBRI_GROUP_TOP2_SUM ? m1 + m2 : m1;
            cand[g] = g;
        }
        if (nan)
            return COLIBRI_ROW_NAN;
        colibri_select(gscore, cand, G, ng, cv, gval, gid);
        /* the kept groups' best two are 2 ng distinct keys, all >= the smallest runner-up */
        if (k <= 2 * ng) {
            bound = INFINITY;
            for (j = 0; j < ng; j++)
                bound = grunner[gid[j]] < bound ? grunner[gid[j]] : bound;
        }
        for (j = 0; j < ng; j++) {
            int32_t first = r->group_start[gid[j]], last = r->group_start[gid[j] + 1];
            if (r->groups_in_order) {
                c = colibri_row_compact(r, key, first, last, bound, cand, c);
            } else {
                for (e = first; e < last; e++) {
                    cand[c] = r->group_members[e];
                    c += key[cand[c]] >= bound;
                }
            }
        }
    } else {
        if (k <= COLIBRI_BOUND_MAX_K)
            bound = colibri_row_lane_bound(r, key, E, k, &nan);
        if (nan)
            return COLIBRI_ROW_NAN;
        c = colibri_row_compact(r, key, 0, E, bound, cand, 0);
    }
    if (c < k) /* the caller validates k against the smallest groups: never happens */
        return COLIBRI_ROW_SHORT;
    colibri_select(key, cand, c, k, cv, tval, tid);
    return colibri_weights(r, x, have_scores ? scores : NULL, tid, scratch, ids, weights);
}

/* The 8-row path. Plain routing (the keys are the logits: no bias, no group limit) with
 * k <= 2 takes each row's top two by value (colibri_top2_values, colibri_top2_ids), then
 * the softmax weights of 8 rows at once: their exponentials in two vectors instead of
 * eight dependent scalar chains. The same IEEE operations in the same order as
 * colibri_weights, so the answers are colibri_route_row's, bit for bit. */
static inline int colibri_rows8_eligible(const colibri_router_t *r)
{
    return r->top_k <= 2 && r->num_experts >= 2 && r->bias == NULL && r->num_groups <= 1;
}

/* Route rows x + i stride, i < 8 (float32, stride in floats, 4-byte aligned); row i's
 * results go to ids + i k, weights + i k. Returns COLIBRI_OK, or nonzero when a row fails
 * (NaN, undefined softmax): route those rows one by one to name it. */
static inline int colibri_route_rows8(const colibri_router_t *r, const float *x, int64_t stride,
                                      void *scratch, int32_t *ids, float *weights)
{
    const int32_t k = r->top_k;
    int32_t i, tid[16];
    float first[8], second[8];
    int finite = 1;
    int nan = 0;
    for (i = 0; i < 8; i++) /* eight independent chains, then the ids: they overlap */
        nan |= colibri_row_top2_values(r, x + i * stride, first + i, second + i);
    if (nan)
        return COLIBRI_ROW_NAN;
    for (i = 0; i < 8; i++) {
        colibri_row_top2_ids(r, x + i * stride, first[i], second[i], tid + 2 * i);
        finite &= first[i] > -INFINITY && first[i] < INFINITY;
    }
#if defined(COLIBRI_SSE2) || defined(COLIBRI_NEON)
    if (k == 2 && finite && r->scoring == COLIBRI_SOFTMAX && r->normalize &&
#ifdef COLIBRI_NEON
        colibri_neon_on() &&
#endif
        r->norm_p == 1.0f) {
        /* colibri_weights' renormalised softmax: 1 / sum and exp(x1 - x0) / sum, with
         * sum = (1 + exp(x1 - x0)) + eps */
        float w0[8], w1[8];
#ifdef COLIBRI_SSE2
        __m128 one = _mm_set1_ps(1.0f), eps = _mm_set1_ps(r->norm_eps);
        for (i = 0; i < 8; i += 4) {
            __m128 e = colibri_exp4(_mm_sub_ps(_mm_loadu_ps(second + i), _mm_loadu_ps(first + i)));
            __m128 sum = _mm_add_ps(_mm_add_ps(one, e), eps);
            _mm_storeu_ps(w0 + i, _mm_div_ps(one, sum));
            _mm_storeu_ps(w1 + i, _mm_div_ps(e, sum));
        }
#else
        float32x4_t one = vdupq_n_f32(1.0f), eps = vdupq_n_f32(r->norm_eps);
        for (i = 0; i < 8; i += 4) {
            float32x4_t e = colibri_exp4n(vsubq_f32(vld1q_f32(second + i), vld1q_f32(first + i)));
            float32x4_t sum = vaddq_f32(vaddq_f32(one, e), eps);
            vst1q_f32(w0 + i, vdivq_f32(one, sum));
            vst1q_f32(w1 + i, vdivq_f32(e, sum));
        }
#endif
        for (i = 0; i < 8; i++) {
            float a = w0[i], b = w1[i];
            if (r->expert_scale != NULL) {
                a *= r->expert_scale[tid[2 * i]];
                b *= r->expert_scale[tid[2 * i + 1]];
            }
            weights[2 * i] = a * r->scale;
            weights[2 * i + 1] = b * r->scale;
            ids[2 * i] = tid[2 * i];
            ids[2 * i + 1] = tid[2 * i + 1];
        }
        return COLIBRI_OK;
    }
#endif
    for (i = 0; i < 8; i++) {
        int status = colibri_weights(r, x + i * stride, NULL, tid + 2 * i, scratch, ids + i * k,
                                     weights + i * k);
        if (status != COLIBRI_OK)
            return status;
    }
    return COLIBRI_OK;
}

/* The block path: the 8-row path's commonest case (k = 2, softmax renormalised over the two
 * with p = 1, no bias, no groups) on 16 rows (AVX-512F) or 8 rows (AVX2) at once. Each row's
 * best two per lane, then the rows' lanes folded pairwise: every shuffle step merges two
 * rows' registers into one, so the cross-lane work is shared instead of done per row, and
 * lane j ends holding one row's top two. Ids from equality masks, then one exponential for
 * all the block's weights: colibri_route_rows8's operations in its order, the same bits. */
static inline int colibri_block_eligible(const colibri_router_t *r)
{
    return colibri_rows8_eligible(r) && r->top_k == 2 && r->scoring == COLIBRI_SOFTMAX
           && r->normalize && r->norm_p == 1.0f;
}

#ifdef COLIBRI_AVX512
/* 16 rows. Returns COLIBRI_OK, COLIBRI_ROW_NAN (route the rows one by one to name it), or -1
 * when a row's best logit is infinite (colibri_route_rows8 takes such blocks). */
COLIBRI_AVX512_FN static inline int colibri_route_rows16(const colibri_router_t *r, const float *x,
                                                         int64_t stride, int32_t *ids,
                                                         float *weights)
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
            v = _mm512_mask_loadu_ps(none, colibri_tail16(E - e), row + e);
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
    colibri_fold16(a, b, &m1, &m2);
    if ((_mm512_cmp_ps_mask(m1, none, _CMP_GT_OQ)
         & _mm512_cmp_ps_mask(m1, _mm512_set1_ps(INFINITY), _CMP_LT_OQ))
        != 0xffff)
        return -1;
    _mm512_storeu_ps(first, m1);
    _mm512_storeu_ps(second, m2);
    if (E <= 64) { /* one span holds both values: no claim loop (1.1x a row) */
        for (i = 0; i < 16; i++) {
            uint64_t k1, k2;
            colibri_span_masks16(x + i * stride, E, _mm512_set1_ps(first[i]),
                                 _mm512_set1_ps(second[i]), &k1, &k2);
            ids[2 * i] = colibri_ctz64(k1);
            ids[2 * i + 1] = colibri_ctz64(k2 & ~((uint64_t)1 << ids[2 * i]));
        }
    } else {
        for (i = 0; i < 16; i++)
            colibri_top2_ids16(x + i * stride, E, first[i], second[i], ids + 2 * i);
    }
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 ex = colibri_exp16(_mm512_sub_ps(m2, m1));
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
#endif

#ifdef COLIBRI_AVX2
/* 8 rows; returns as colibri_route_rows16. */
COLIBRI_AVX2_FN static inline int colibri_route_rows8x8(const colibri_router_t *r, const float *x,
                                                        int64_t stride, int32_t *ids,
                                                        float *weights)
{
    const int32_t E = r->num_experts;
    const __m256 none = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(E % 8), lane);
    __m256 a[8], b[8], unordered = _mm256_setzero_ps();
    float first[8], second[8];
    int32_t i, e;
    for (i = 0; i < 8; i++) {
        const float *row = x + i * stride;
        __m256 ai = none, bi = none, v;
        for (e = 0; e + 8 <= E; e += 8) {
            v = _mm256_loadu_ps(row + e);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            bi = _mm256_max_ps(_mm256_min_ps(v, ai), bi);
            ai = _mm256_max_ps(v, ai);
        }
        if (e < E) { /* the last E mod 8, the other lanes -inf */
            v = _mm256_blendv_ps(none, _mm256_maskload_ps(row + e, tail),
                                 _mm256_castsi256_ps(tail));
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            bi = _mm256_max_ps(_mm256_min_ps(v, ai), bi);
            ai = _mm256_max_ps(v, ai);
        }
        a[i] = ai;
        b[i] = bi;
    }
    if (_mm256_movemask_ps(unordered))
        return COLIBRI_ROW_NAN;
    for (i = 0; i < 4; i++)
        COLIBRI_FOLD(_mm256_max_ps, _mm256_min_ps, _mm256_permute2f128_ps, a[2 * i], b[2 * i],
                     a[2 * i + 1], b[2 * i + 1], 0x20, 0x31, a[i], b[i]);
    for (i = 0; i < 2; i++)
        COLIBRI_FOLD(_mm256_max_ps, _mm256_min_ps, _mm256_shuffle_ps, a[2 * i], b[2 * i],
                     a[2 * i + 1], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0), _MM_SHUFFLE(3, 2, 3, 2),
                     a[i], b[i]);
    COLIBRI_FOLD(_mm256_max_ps, _mm256_min_ps, _mm256_shuffle_ps, a[0], b[0], a[1], b[1],
                 _MM_SHUFFLE(2, 0, 2, 0), _MM_SHUFFLE(3, 1, 3, 1), a[0], b[0]);
    /* lane j holds row (0 2 4 6 1 3 5 7)[j] */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 m1 = _mm256_permutevar8x32_ps(a[0], order), m2 = _mm256_permutevar8x32_ps(b[0], order);
    if (_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(m1, none, _CMP_GT_OQ),
                                         _mm256_cmp_ps(m1, _mm256_set1_ps(INFINITY), _CMP_LT_OQ)))
        != 0xff)
        return -1;
    _mm256_storeu_ps(first, m1);
    _mm256_storeu_ps(second, m2);
    for (i = 0; i < 8; i++)
        colibri_top2_ids8(x + i * stride, E, first[i], second[i], ids + 2 * i);
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 ex = colibri_exp8(_mm256_sub_ps(m2, m1));
    __m256 sum = _mm256_add_ps(_mm256_add_ps(one, ex), _mm256_set1_ps(r->norm_eps));
    __m256 w0 = _mm256_div_ps(one, sum), w1 = _mm256_div_ps(ex, sum);
    __m256 lo = _mm256_unpacklo_ps(w0, w1), hi = _mm256_unpackhi_ps(w0, w1);
    _mm256_storeu_ps(weights, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(weights + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    for (i = 0; i < 16; i++) { /* as colibri_route_rows8: a *= expert_scale[id], a *= scale */
        if (r->expert_scale != NULL)
            weights[i] *= r->expert_scale[ids[i]];
        weights[i] *= r->scale;
    }
    return COLIBRI_OK;
}
#endif

/* Rows in one colibri_route_block call: 16 (AVX-512F), 8 (AVX2 or the 8-row path). */
static inline int32_t colibri_block_rows(const colibri_router_t *r)
{
#ifdef COLIBRI_AVX512
    if (r->use_avx512 && colibri_block_eligible(r))
        return 16;
#endif
    (void)r;
    return 8;
}

/* Route colibri_block_rows(r) rows as colibri_route_rows8 does (same arguments, same
 * results; scratch is not needed on the block kernels). */
static inline int colibri_route_block(const colibri_router_t *r, const float *x, int64_t stride,
                                      void *scratch, int32_t *ids, float *weights)
{
    int status = -1;
#ifdef COLIBRI_AVX512
    if (r->use_avx512 && colibri_block_eligible(r)) {
        status = colibri_route_rows16(r, x, stride, ids, weights);
        if (status < 0) { /* an infinite logit: the scalar weights' rules */
            status = colibri_route_rows8(r, x, stride, scratch, ids, weights);
            if (status == COLIBRI_OK)
                status =
                    colibri_route_rows8(r, x + 8 * stride, stride, scratch, ids + 16, weights + 16);
        }
        return status;
    }
#endif
#ifdef COLIBRI_AVX2
    if (r->use_avx2 && colibri_block_eligible(r))
        status = colibri_route_rows8x8(r, x, stride, ids, weights);
#endif
    if (status < 0)
        status = colibri_route_rows8(r, x, stride, scratch, ids, weights);
    return status;
}

#endif /* COLIBRI_ROUTE_H */
