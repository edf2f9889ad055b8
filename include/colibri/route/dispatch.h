/*
 * The one place that picks an instruction set per call: each colibri_row_* runs a primitive
 * on the widest kernel the router allows (AVX-512F, then AVX2, then the build's base), and
 * the predicates say which driver a router takes. The base itself (SSE2, NEON or plain C)
 * is fixed when compiling (route/fallback.h); NEON's own run-time switch is in route/neon.h.
 */
#ifndef COLIBRI_ROUTE_DISPATCH_H
#define COLIBRI_ROUTE_DISPATCH_H

#ifndef COLIBRI_ROUTE_H
#error "include colibri/route.h, not its parts"
#endif

static inline int colibri_cpu_has_avx512(void)
{
#ifdef COLIBRI_AVX512
    int path = colibri_simd_path();
    return path == COLIBRI_PATH_AVX512 || path == COLIBRI_PATH_AVX512_BF16;
#else
    return 0;
#endif
}

static inline int colibri_cpu_has_avx2(void)
{
#ifdef COLIBRI_AVX2
    int path = colibri_simd_path();
    return path >= COLIBRI_PATH_AVX2 && path != COLIBRI_PATH_NEON;
#else
    return 0;
#endif
}

/* colibri_sigmoid_keys of a row of r's experts, 16 lanes wide where r allows. */
static inline int colibri_row_sigmoid_keys(const colibri_router_t *r, const float *x, float *scores,
                                           float *keys)
{
#ifdef COLIBRI_AVX512
    if (r->use_avx512)
        return colibri_sigmoid_keys_avx512(x, r->num_experts, r->bias, r->bias_on_logits, scores,
                                           keys);
#endif
#ifdef COLIBRI_AVX2
    if (r->use_avx2)
        return colibri_sigmoid_keys_avx2(x, r->num_experts, r->bias, r->bias_on_logits, scores,
                                         keys);
#endif
    return colibri_sigmoid_keys(x, r->num_experts, r->bias, r->bias_on_logits, scores, keys);
}

/* colibri_exp_shifted, 8 lanes wide when wide (r->use_avx2). */
static inline float colibri_row_exp_shifted(int wide, const float *x, float m, float *out,
                                            int32_t E)
{
#ifdef COLIBRI_AVX2
    if (wide)
        return colibri_exp_shifted_avx2(x, m, out, E);
#endif
    (void)wide;
    return colibri_exp_shifted(x, m, out, E);
}

/* colibri_sqrtsoftplus_row, 8 lanes wide where r allows. */
static inline void colibri_row_sqrtsoftplus(const colibri_router_t *r, const float *x, int32_t E,
                                            float *scores)
{
#ifdef COLIBRI_AVX2
    if (r->use_avx2) {
        colibri_sqrtsoftplus_row_avx2(x, E, scores);
        return;
    }
#endif
    (void)r;
    colibri_sqrtsoftplus_row(x, E, scores);
}

/* colibri_top2_values / colibri_top2_ids of a row of r's experts, 16 lanes wide where r
 * allows and E >= 16 (below that, 4 lanes are faster). */
static inline int colibri_row_top2_values(const colibri_router_t *r, const float *x, float *first,
                                          float *second)
{
#ifdef COLIBRI_AVX512
    if (r->use_avx512 && r->num_experts >= 16)
        return colibri_top2_values_avx512(x, r->num_experts, first, second);
#endif
#ifdef COLIBRI_AVX2
    if (r->use_avx2 && r->num_experts >= 16)
        return colibri_top2_values_avx2(x, r->num_experts, first, second);
#endif
    return colibri_top2_values(x, r->num_experts, first, second);
}

static inline void colibri_row_top2_ids(const colibri_router_t *r, const float *x, float m1,
                                        float m2, int32_t *ids)
{
#ifdef COLIBRI_AVX512
    if (r->use_avx512 && r->num_experts >= 16) {
        colibri_top2_ids_avx512(x, r->num_experts, m1, m2, ids);
        return;
    }
#endif
#ifdef COLIBRI_AVX2
    if (r->use_avx2 && r->num_experts >= 16) {
        colibri_top2_ids_avx2(x, r->num_experts, m1, m2, ids);
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
        return colibri_lane_bound_avx2(x, E, k, nan);
#endif
    (void)r;
    return colibri_lane_bound(x, E, k, nan);
}

static inline int32_t colibri_row_compact(const colibri_router_t *r, const float *x, int32_t first,
                                          int32_t last, float bound, int32_t *cand, int32_t c)
{
#ifdef COLIBRI_AVX2
    if (r->use_avx2)
        return colibri_compact_avx2(x, first, last, bound, cand, c);
#endif
    (void)r;
    return colibri_compact(x, first, last, bound, cand, c);
}

/* The 8-row path: plain routing (the keys are the logits: no bias, no group limit) with
 * k <= 2 (route/rows.h). */
static inline int colibri_rows8_eligible(const colibri_router_t *r)
{
    return r->top_k <= 2 && r->num_experts >= 2 && r->bias == NULL && r->num_groups <= 1;
}

/* The block kernels: the 8-row path's commonest case (k = 2, softmax renormalised over the
 * two with p = 1, no bias, no groups). */
static inline int colibri_block_eligible(const colibri_router_t *r)
{
    return colibri_rows8_eligible(r) && r->top_k == 2 && r->scoring == COLIBRI_SOFTMAX
           && r->normalize && r->norm_p == 1.0f;
}

static inline int32_t colibri_block_rows(const colibri_router_t *r)
{
#ifdef COLIBRI_AVX512
    if (r->use_avx512 && colibri_block_eligible(r))
        return 16;
#endif
    (void)r;
    return 8;
}

/* The widest block kernel r allows on colibri_block_rows(r) rows: its status (-1: a row's
 * best logit is infinite), or -1 when none applies. */
static inline int colibri_row_block(const colibri_router_t *r, const float *x, int64_t stride,
                                    int32_t *ids, float *weights)
{
#ifdef COLIBRI_AVX512
    if (r->use_avx512 && colibri_block_eligible(r))
        return colibri_route_block_avx512(r, x, stride, ids, weights);
#endif
#ifdef COLIBRI_AVX2
    if (r->use_avx2 && colibri_block_eligible(r))
        return colibri_route_block_avx2(r, x, stride, ids, weights);
#endif
    (void)r;
    (void)x;
    (void)stride;
    (void)ids;
    (void)weights;
    return -1;
}

#endif /* COLIBRI_ROUTE_DISPATCH_H */
