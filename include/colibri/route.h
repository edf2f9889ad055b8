/*
 * colibri's per-token router: one fused pass over a row of E gate logits picks the
 * top-k experts and their weights. Plain C99 (no VLAs), header-only, usable from C without
 * Python. The batch loop (colibri/pool.h's threads) lives in colibri/_core.pyx.
 *
 * This file is the contract: the router struct and its enums, the scratch layout, and the
 * public functions. The code behind it, one file per instruction set (as ggml-cpu's arch/):
 *   route/generic.h   plain C: every primitive (*_generic) and the scalar helpers
 *   route/sse2.h      x86-64's baseline, 4 lanes
 *   route/neon.h      aarch64, 4 lanes (taken unless COLIBRI_SIMD=scalar)
 *   route/avx2.h      8 lanes, GCC/Clang on x86-64, where the CPU runs it (router.use_avx2)
 *   route/avx512.h    16 lanes, likewise (router.use_avx512)
 *   route/fallback.h  which generic primitive takes the public name where an ISA has none
 *   route/dispatch.h  the one place that picks the widest kernel a router allows
 *   route/rows.h      the row, 8-row and block drivers, built from the primitives
 * One of generic, SSE2 or NEON is the build's base (the unsuffixed primitive names); the
 * AVX2 and AVX-512F kernels come on top, chosen per call (colibri/cpu.h says what the CPU
 * runs; COLIBRI_SIMD caps the path). Every path gives the same bits.
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

/* The instruction sets this build compiles: at most one base (SSE2 or NEON; plain C
 * otherwise), and on x86-64 with GCC or Clang the AVX2 and AVX-512F kernels too. */
#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#define COLIBRI_SSE2 1
#endif
#if !defined(COLIBRI_SSE2) && defined(__aarch64__) && defined(__ARM_NEON)
#define COLIBRI_NEON 1
#endif
#if defined(COLIBRI_SSE2) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define COLIBRI_AVX2 1
#define COLIBRI_AVX512 1
#endif

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

/* ---- the public functions (defined in route/dispatch.h, route/rows.h and the ISA files) - */

/* Whether this CPU runs the AVX-512F (AVX2) code compiled in: 0 when none was, or
 * COLIBRI_SIMD caps the path below avx512 (avx2). */
static inline int colibri_cpu_has_avx512(void);
static inline int colibri_cpu_has_avx2(void);

/* Ask for bytes [p, p + n) to be brought into the cache (a hint; no effect without SSE).
 * The batch driver fetches rows ahead: hardware prefetchers alone leave long rows waiting. */
static inline void colibri_prefetch(const void *p, size_t n);

/* Decode one row of E logits (any supported dtype, any element stride) to float32 in buf
 * (the scratch's .row area). Returns the row itself when it already is contiguous float32. */
static inline const float *colibri_load_row(const char *row, int dtype, int64_t stride, int32_t E,
                                            float *buf);

/* Route one row. x: [E] float32 logits; scratch: colibri_scratch_bytes(r) bytes, 4-aligned;
 * ids, weights: [k]. Returns COLIBRI_OK or a row status (nothing useful written then). */
static inline int colibri_route_row(const colibri_router_t *r, const float *x, void *scratch,
                                    int32_t *ids, float *weights);

/* Whether r routes 8 rows at a time (k <= 2, no bias, no group limit). */
static inline int colibri_rows8_eligible(const colibri_router_t *r);

/* Route rows x + i stride, i < 8 (float32, stride in floats, 4-byte aligned); row i's
 * results go to ids + i k, weights + i k. Returns COLIBRI_OK, or nonzero when a row fails
 * (NaN, undefined softmax): route those rows one by one to name it. */
static inline int colibri_route_rows8(const colibri_router_t *r, const float *x, int64_t stride,
                                      void *scratch, int32_t *ids, float *weights);

/* Rows in one colibri_route_block call: 16 (AVX-512F), 8 (AVX2 or the 8-row path). */
static inline int32_t colibri_block_rows(const colibri_router_t *r);

/* Route colibri_block_rows(r) rows as colibri_route_rows8 does (same arguments, same
 * results). */
static inline int colibri_route_block(const colibri_router_t *r, const float *x, int64_t stride,
                                      void *scratch, int32_t *ids, float *weights);

/* ---- the code, one file per instruction set -------------------------------------------- */

#include "colibri/route/fallback.h"
#include "colibri/route/generic.h"
#if defined(COLIBRI_SSE2)
#include "colibri/route/sse2.h"
#elif defined(COLIBRI_NEON)
#include "colibri/route/neon.h"
#endif
#ifdef COLIBRI_AVX2
#include "colibri/route/avx2.h"
#endif
#ifdef COLIBRI_AVX512
#include "colibri/route/avx512.h"
#endif
#include "colibri/route/dispatch.h"
#include "colibri/route/rows.h"

#endif /* COLIBRI_ROUTE_H */
