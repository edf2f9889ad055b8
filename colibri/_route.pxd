# Declarations of include/colibri/route.h, once: the router struct, its enums, the scratch
# layout and the kernels.
# A routing option is a field of Config (routing/_config.py), of colibri_router_t (route.h
# and here) and of the kernel; Router._configure (_core.pyx) copies Config into the struct.

from libc.stdint cimport int32_t, int64_t


cdef extern from "colibri/route.h" nogil:
    ctypedef struct colibri_router_t:
        int32_t num_experts
        int32_t top_k
        int32_t scoring
        int32_t normalize
        float norm_p
        float norm_eps
        float scale
        const float *bias
        int32_t bias_on_logits
        const float *expert_scale
        int32_t num_groups
        int32_t topk_groups
        int32_t group_score
        const int32_t *group_start
        const int32_t *group_members
        int32_t groups_in_order
        int32_t use_avx512
        int32_t use_avx2

    ctypedef struct colibri_scratch_t:
        size_t row
        size_t scores
        size_t keys
        size_t grouped
        size_t cand_keys
        size_t cand
        size_t group_scores
        size_t group_runners
        size_t kept_scores
        size_t kept
        size_t top_keys
        size_t top
        size_t block_ids
        size_t block_weights
        size_t bytes

    enum:
        COLIBRI_SOFTMAX
        COLIBRI_SIGMOID
        COLIBRI_SQRTSOFTPLUS
        COLIBRI_GROUP_MAX
        COLIBRI_GROUP_TOP2_SUM
        COLIBRI_F32
        COLIBRI_F64
        COLIBRI_F16
        COLIBRI_BF16
        COLIBRI_OK
        COLIBRI_ROW_NAN
        COLIBRI_ROW_ALL_NEG_INF
        COLIBRI_ROW_SHORT

    colibri_scratch_t colibri_scratch_layout(const colibri_router_t *r) noexcept
    size_t colibri_scratch_bytes(const colibri_router_t *r) noexcept
    void colibri_prefetch(const void *p, size_t n) noexcept
    int colibri_cpu_has_avx512() noexcept
    int colibri_cpu_has_avx2() noexcept
    const float *colibri_load_row(const char *row, int dtype, int64_t stride, int32_t E,
                                  float *buf) noexcept
    int colibri_route_row(const colibri_router_t *r, const float *x, void *scratch,
                          int32_t *ids, float *weights) noexcept
    int colibri_rows8_eligible(const colibri_router_t *r) noexcept
    int colibri_route_rows8(const colibri_router_t *r, const float *x, int64_t stride,
                            void *scratch, int32_t *ids, float *weights) noexcept
    int32_t colibri_block_rows(const colibri_router_t *r) noexcept
    int colibri_route_block(const colibri_router_t *r, const float *x, int64_t stride,
                            void *scratch, int32_t *ids, float *weights) noexcept
