/*
 * route.h's drivers, built from the primitives (route/generic.h and the ISA headers, picked
 * through route/dispatch.h): the weights of the chosen experts, one row (colibri_route_row),
 * 8 rows (colibri_route_rows8) and a block of rows (colibri_route_block). No instruction set
 * appears here.
 */
#ifndef COLIBRI_ROUTE_ROWS_H
#define COLIBRI_ROUTE_ROWS_H

#ifndef COLIBRI_ROUTE_H
#error "include colibri/route.h, not its parts"
#endif

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
        sum = colibri_row_exp_shifted(wide, x, m, out, E);
    }
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
            colibri_row_sqrtsoftplus(r, x, E, scores);
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
 * eight dependent scalar chains (colibri_top2_softmax8). The same IEEE operations in the
 * same order as colibri_weights, so the answers are colibri_route_row's, bit for bit.
 *
 * Route rows x + i stride, i < 8 (float32, stride in floats, 4-byte aligned); row i's
 * results go to ids + i k, weights + i k. Returns COLIBRI_OK, or nonzero when a row fails
 * (NaN, undefined softmax): route those rows one by one to name it. */
static inline int colibri_route_rows8(const colibri_router_t *r, const float *x, int64_t stride,
                                      void *scratch, int32_t *ids, float *weights)
{
    const int32_t k = r->top_k;
    int32_t i, tid[16];
    float first[8], second[8], w0[8], w1[8];
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
    if (k == 2 && finite && r->scoring == COLIBRI_SOFTMAX && r->normalize && r->norm_p == 1.0f
        && colibri_top2_softmax8(first, second, r->norm_eps, w0, w1)) {
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
    for (i = 0; i < 8; i++) {
        int status = colibri_weights(r, x + i * stride, NULL, tid + 2 * i, scratch, ids + i * k,
                                     weights + i * k);
        if (status != COLIBRI_OK)
            return status;
    }
    return COLIBRI_OK;
}

/* The block path: the 8-row path's commonest case (colibri_block_eligible) on 16 rows
 * (AVX-512F) or 8 rows (AVX2) at once. Each row's best two per lane, then the rows' lanes
 * folded pairwise: every shuffle step merges two rows' registers into one, so the cross-lane
 * work is shared instead of done per row, and lane j ends holding one row's top two. Ids
 * from equality masks, then one exponential for all the block's weights: colibri_route_rows8's
 * operations in its order, the same bits. Without a block kernel, or when a row's best logit
 * is infinite (the scalar weights' rules), the rows go 8 at a time. */
static inline int colibri_route_block(const colibri_router_t *r, const float *x, int64_t stride,
                                      void *scratch, int32_t *ids, float *weights)
{
    const int32_t rows = colibri_block_rows(r), k = r->top_k;
    int status = colibri_row_block(r, x, stride, ids, weights);
    if (status < 0) {
        status = colibri_route_rows8(r, x, stride, scratch, ids, weights);
        if (status == COLIBRI_OK && rows == 16)
            status = colibri_route_rows8(r, x + 8 * stride, stride, scratch, ids + 8 * k,
                                         weights + 8 * k);
    }
    return status;
}

#endif /* COLIBRI_ROUTE_ROWS_H */
