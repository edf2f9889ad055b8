/*
 * colibri's per-token router: one fused pass over a row of E gate logits picks the
 * top-k experts and their weights. Plain C99 (no VLAs), header-only,
 * usable from C without Python (SSE2 where the target has it, plain C elsewhere). The batch loop (OpenMP) lives in colibri/_core.pyx.
 *
 * Semantics (docs: README "Routing"):
 *   scores   = score(logits)              softmax | sigmoid | sqrt(softplus)
 *   keys     = scores + bias              (bias: selection only, may be NULL)
 *   groups   : keep the topk_groups best groups by max / top-2-sum of keys; experts of
 *              dropped groups are never chosen (never a 0.0 fill that a negative key loses to)
 *   ids      = top-k of keys over allowed experts, descending; equal keys -> lower id
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

#include "colibri/half.h"

#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#include <emmintrin.h>
#define COLIBRI_SSE2 1
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
    float norm_p;               /* 1: divide by the sum; p: by the p-norm (DBRX) */
    float scale;                /* multiplies the final weights */
    const float *bias;          /* [E] selection-only bias, or NULL */
    const float *expert_scale;  /* [E] per-expert factor after renormalisation, or NULL */
    int32_t num_groups;         /* <= 1: no group limit */
    int32_t topk_groups;
    int32_t group_score;
    const int32_t *group_start;   /* [G + 1] offsets into group_members */
    const int32_t *group_members; /* [E] expert ids, group by group */
} colibri_router_t;

/* Bytes of per-thread scratch one row needs (aligned to 64). */
static inline size_t colibri_scratch_bytes(const colibri_router_t *r)
{
    size_t E = (size_t)r->num_experts, G = (size_t)(r->num_groups > 1 ? r->num_groups : 1);
    size_t k = (size_t)r->top_k;
    size_t bytes = 4 * (E          /* decoded row */
                        + 2 * E    /* scores, keys */
                        + 2 * G    /* group scores, group top list */
                        + 2 * G    /* group ids */
                        + 2 * k)   /* top-k values and ids */
                   + E;            /* allowed mask */
    return (bytes + 63) & ~(size_t)63;
}

/* Decode one row of E logits (any supported dtype, any element stride) to float32.
 * Returns the row itself when it already is contiguous float32. */
static inline const float *colibri_load_row(const char *row, int dtype, int64_t stride,
                                            int32_t E, float *buf)
{
    int32_t e;
    switch (dtype) {
    case COLIBRI_F32:
        if (stride == 1)
            return (const float *)row;
        for (e = 0; e < E; e++)
            buf[e] = ((const float *)row)[e * stride];
        break;
    case COLIBRI_F64:
        for (e = 0; e < E; e++)
            buf[e] = (float)((const double *)row)[e * stride];
        break;
    case COLIBRI_F16:
        for (e = 0; e < E; e++)
            buf[e] = colibri_half_to_float(((const uint16_t *)row)[e * stride]);
        break;
    default: /* COLIBRI_BF16 */
        for (e = 0; e < E; e++)
            buf[e] = colibri_bf16_to_float(((const uint16_t *)row)[e * stride]);
        break;
    }
    return buf;
}

static inline float colibri_sigmoid(float x)
{
    if (x >= 0.0f)
        return 1.0f / (1.0f + expf(-x));
    float z = expf(x);
    return z / (1.0f + z);
}

static inline float colibri_sqrtsoftplus(float x)
{
    /* softplus as torch computes it: x above 20, log1p(exp(x)) below */
    return sqrtf(x > 20.0f ? x : log1pf(expf(x)));
}

/* Insert (v, i) into the descending list (vals, ids) of length *n <= cap. Indices arrive in
 * ascending order, so an equal value stays behind the ones already there (lower id wins). */
static inline void colibri_push(float *vals, int32_t *ids, int32_t *n, int32_t cap,
                                float v, int32_t i)
{
    int32_t j = *n;
    if (j == cap) {
        if (!(v > vals[cap - 1]))
            return;
        j = cap - 1;
    } else {
        *n = j + 1;
    }
    while (j > 0 && v > vals[j - 1]) {
        vals[j] = vals[j - 1];
        ids[j] = ids[j - 1];
        j--;
    }
    vals[j] = v;
    ids[j] = i;
}

/* Whether any of key[0..8) is above threshold (NaN never is). */
static inline int colibri_any_above8(const float *key, float threshold)
{
#ifdef COLIBRI_SSE2
    __m128 t = _mm_set1_ps(threshold);
    __m128 above = _mm_or_ps(_mm_cmpgt_ps(_mm_loadu_ps(key), t),
                             _mm_cmpgt_ps(_mm_loadu_ps(key + 4), t));
    return _mm_movemask_ps(above);
#else
    int any = 0, j;
    for (j = 0; j < 8; j++)
        any |= key[j] > threshold;
    return any;
#endif
}

/* Top-k of key[0..E) over the allowed experts (allowed == NULL: all) into vals/ids,
 * descending, equal keys to the lower id. Returns how many were found (min(k, allowed)). */
static inline int32_t colibri_topk(const float *key, const unsigned char *allowed, int32_t E,
                                   int32_t k, float *vals, int32_t *ids)
{
    int32_t n = 0, e = 0;
    /* fill the first k slots, then only a key above the k-th best gets in */
    for (; e < E && n < k; e++)
        if (allowed == NULL || allowed[e])
            colibri_push(vals, ids, &n, k, key[e], e);
    if (n < k)
        return n;
    float threshold = vals[k - 1];
    if (allowed == NULL) {
        /* blocks of 8 with no key above the threshold (the common case) cost one
         * vectorised compare and one well-predicted branch */
        for (; e + 8 <= E; e += 8) {
            int32_t j;
            if (!colibri_any_above8(key + e, threshold))
                continue;
            for (j = 0; j < 8; j++) {
                if (key[e + j] > threshold) {
                    colibri_push(vals, ids, &n, k, key[e + j], e + j);
                    threshold = vals[k - 1];
                }
            }
        }
        for (; e < E; e++) {
            if (key[e] > threshold) {
                colibri_push(vals, ids, &n, k, key[e], e);
                threshold = vals[k - 1];
            }
        }
    } else {
        for (; e < E; e++) {
            if (allowed[e] && key[e] > threshold) {
                colibri_push(vals, ids, &n, k, key[e], e);
                threshold = vals[k - 1];
            }
        }
    }
    return n;
}

/* Softmax of the row into out[E]; returns 0, or COLIBRI_ROW_ALL_NEG_INF when undefined.
 * +inf logits share the whole mass equally (the limit of softmax). */
static inline int colibri_softmax(const float *x, int32_t E, float *out)
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
        for (e = 0; e < E; e++) {
            out[e] = expf(x[e] - m);
            sum += out[e];
        }
    }
    float inv = 1.0f / sum;
    for (e = 0; e < E; e++)
        out[e] *= inv;
    return COLIBRI_OK;
}

static inline float colibri_score(int scoring, float x)
{
    return scoring == COLIBRI_SIGMOID ? colibri_sigmoid(x) : colibri_sqrtsoftplus(x);
}

/* Route one row. x: [E] float32 logits; scratch: colibri_scratch_bytes(r) bytes, 4-aligned;
 * ids, weights: [k]. Returns COLIBRI_OK or a row status (nothing useful written then). */
static inline int colibri_route_row(const colibri_router_t *r, const float *x, void *scratch,
                                    int32_t *ids, float *weights)
{
    const int32_t E = r->num_experts, k = r->top_k;
    const int32_t G = r->num_groups > 1 ? r->num_groups : 1;
    float *scores = (float *)scratch + E; /* the first E floats hold the decoded row */
    float *keys = scores + E;
    float *gval = keys + E;
    int32_t *gid = (int32_t *)(gval + 2 * G);
    float *tval = (float *)(gid + 2 * G);
    unsigned char *allowed = (unsigned char *)(tval + 2 * k);
    int32_t *tid = (int32_t *)(tval + k);
    int32_t e, j, g, n = 0;
    int nan = 0;

    for (e = 0; e < E; e++)
        nan |= x[e] != x[e];
    if (nan)
        return COLIBRI_ROW_NAN;

    /* Selection keys: the logits, unless a bias or top-2-sum group scores need true scores. */
    const float *key = x;
    int have_scores = r->bias != NULL || (G > 1 && r->group_score == COLIBRI_GROUP_TOP2_SUM);
    if (have_scores) {
        if (r->scoring == COLIBRI_SOFTMAX) {
            if (colibri_softmax(x, E, scores) != COLIBRI_OK)
                return COLIBRI_ROW_ALL_NEG_INF;
        } else {
            for (e = 0; e < E; e++)
                scores[e] = colibri_score(r->scoring, x[e]);
        }
        key = scores;
        if (r->bias != NULL) {
            for (e = 0; e < E; e++)
                keys[e] = scores[e] + r->bias[e];
            key = keys;
        }
    }

    if (G > 1) {
        int32_t ng = 0, kg = r->topk_groups;
        for (g = 0; g < G; g++) {
            const int32_t *member = r->group_members + r->group_start[g];
            int32_t size = r->group_start[g + 1] - r->group_start[g];
            float best = -INFINITY, second = -INFINITY;
            for (j = 0; j < size; j++) {
                float v = key[member[j]];
                if (v > best) {
                    second = best;
                    best = v;
                } else if (v > second) {
                    second = v;
                }
            }
            float score = r->group_score == COLIBRI_GROUP_TOP2_SUM ? best + second : best;
            colibri_push(gval, gid, &ng, kg, score, g);
        }
        memset(allowed, 0, (size_t)E);
        for (j = 0; j < ng; j++) {
            g = gid[j];
            for (e = r->group_start[g]; e < r->group_start[g + 1]; e++)
                allowed[r->group_members[e]] = 1;
        }
        n = colibri_topk(key, allowed, E, k, tval, tid);
    } else {
        n = colibri_topk(key, NULL, E, k, tval, tid);
    }
    if (n < k) /* the caller validates k against the smallest groups: never happens */
        return COLIBRI_ROW_SHORT;

    /* Weights from the unbiased scores of the chosen experts. */
    if (have_scores) {
        for (j = 0; j < k; j++)
            weights[j] = scores[tid[j]];
    } else if (r->scoring == COLIBRI_SOFTMAX && r->normalize) {
        /* renormalised softmax over the k chosen = exp(x - max chosen), normalised below */
        float m = -INFINITY;
        for (j = 0; j < k; j++)
            m = x[tid[j]] > m ? x[tid[j]] : m;
        if (m == -INFINITY)
            return COLIBRI_ROW_ALL_NEG_INF;
        for (j = 0; j < k; j++)
            weights[j] = m == INFINITY ? (x[tid[j]] == INFINITY ? 1.0f : 0.0f)
                                       : expf(x[tid[j]] - m);
    } else if (r->scoring == COLIBRI_SOFTMAX) {
        if (colibri_softmax(x, E, scores) != COLIBRI_OK)
            return COLIBRI_ROW_ALL_NEG_INF;
        for (j = 0; j < k; j++)
            weights[j] = scores[tid[j]];
    } else {
        for (j = 0; j < k; j++)
            weights[j] = colibri_score(r->scoring, x[tid[j]]);
    }

    if (r->normalize) {
        float norm = 0.0f;
        int32_t infinite = 0;
        for (j = 0; j < k; j++) {
            infinite += weights[j] == INFINITY;
            norm += r->norm_p == 1.0f ? weights[j] : powf(weights[j], r->norm_p);
        }
        if (infinite) {
            /* sqrt-softplus of +inf: the infinite weights share the unit norm equally */
            float share = r->norm_p == 1.0f ? 1.0f / (float)infinite
                                            : powf((float)infinite, -1.0f / r->norm_p);
            for (j = 0; j < k; j++)
                weights[j] = weights[j] == INFINITY ? share : 0.0f;
        } else if (norm > 0.0f) {
            if (r->norm_p != 1.0f)
                norm = powf(norm, 1.0f / r->norm_p);
            float inv = 1.0f / norm;
            for (j = 0; j < k; j++)
                weights[j] *= inv;
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

#endif /* COLIBRI_ROUTE_H */
