/*
 * Where the build's base instruction set has no version of a primitive, its plain-C version
 * (route/generic.h, *_generic) is compiled under the public name instead (ggml-cpu's
 * arch-fallback.h). Included before route/generic.h. The AVX2 and AVX-512F kernels come on
 * top of the base and are chosen per call: route/dispatch.h falls back for them.
 *
 * The primitives (every base defines them, or takes the generic one here):
 *   colibri_prefetch          cache hint for a span of bytes
 *   colibri_exp_shifted       exp(x - m) of a row and its sum
 *   colibri_exp_gathered      exp(x[ids] - m)
 *   colibri_sqrtsoftplus_row  sqrt(softplus(x)) of a row
 *   colibri_top2_values       the two largest values of a row, and whether it holds a NaN
 *   colibri_top2_ids          their ids
 *   colibri_lane_bound        a value at least k of a row reach (the top-k candidate bound)
 *   colibri_compact           the ids of a row's elements at or above a bound
 *   colibri_rank              a candidate's rank among the candidates
 *   colibri_sigmoid_keys      sigmoid scores and biased keys of a row
 *   colibri_has_nan           whether a row holds a NaN
 *   colibri_top2_softmax8     the top-two softmax weights of 8 rows (generic: none, 0)
 */
#ifndef COLIBRI_ROUTE_FALLBACK_H
#define COLIBRI_ROUTE_FALLBACK_H

#ifndef COLIBRI_ROUTE_H
#error "include colibri/route.h, not its parts"
#endif

#if defined(COLIBRI_SSE2)
#define colibri_sqrtsoftplus_row_generic colibri_sqrtsoftplus_row
#elif defined(COLIBRI_NEON)
#define colibri_prefetch_generic colibri_prefetch
#else
#define colibri_prefetch_generic colibri_prefetch
#define colibri_exp_shifted_generic colibri_exp_shifted
#define colibri_exp_gathered_generic colibri_exp_gathered
#define colibri_sqrtsoftplus_row_generic colibri_sqrtsoftplus_row
#define colibri_top2_values_generic colibri_top2_values
#define colibri_top2_ids_generic colibri_top2_ids
#define colibri_lane_bound_generic colibri_lane_bound
#define colibri_compact_generic colibri_compact
#define colibri_rank_generic colibri_rank
#define colibri_sigmoid_keys_generic colibri_sigmoid_keys
#define colibri_has_nan_generic colibri_has_nan
#define colibri_top2_softmax8_generic colibri_top2_softmax8
#endif

#endif /* COLIBRI_ROUTE_FALLBACK_H */
