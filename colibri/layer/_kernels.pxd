# Declarations of the kernels' headers that more than one module calls, once: the linear
# kernels (linear.h: half-precision weights; qlinear.h: rows of quantized blocks), the
# attention over a cache (attention.h) and the q8 quantization of an input row (quant.h).

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t


cdef extern from "colibri/quant.h" nogil:
    void colibri_q8_row(const float *x, int32_t K, float *d, int8_t *q, int32_t *s) noexcept


cdef extern from "colibri/qlinear.h" nogil:
    ctypedef struct colibri_qlinear_t:
        int32_t n, in_dim, out_dim, type, path, rows
        const float *xd
        const int8_t *xq
        const int32_t *xs
        const uint8_t *w
        int64_t ldw
        const float *bias
        float *y
        int64_t ldy
    void colibri_qlinear_run(colibri_qlinear_t *l, int threads) noexcept
    void colibri_qlinear_run_many(colibri_qlinear_t *l, int32_t count, int32_t *first,
                                  int threads) noexcept


cdef extern from "colibri/linear.h" nogil:
    ctypedef struct colibri_linear_t:
        int32_t n, in_dim, out_dim
        int32_t kind
        int32_t path
        const float *x
        int64_t ldx
        const uint16_t *w
        int64_t ldw
        const float *bias
        uint16_t *xs
        float *y
        int64_t ldy
    size_t colibri_linear_split_bytes(const colibri_linear_t *l) noexcept
    void colibri_linear_run(colibri_linear_t *l, int threads) noexcept
    void colibri_linear_run_many(colibri_linear_t *l, int32_t count, int32_t *first,
                                 int threads) noexcept


cdef extern from "colibri/attention.h" nogil:
    ctypedef struct colibri_attend_t:
        const void *q
        const void *k
        const void *v
        const float *mask
        void *out
        int64_t Hq, Hkv, T, L, D, ldk, ldv
        float scale
        int kind
        int threads
    int colibri_attend(const colibri_attend_t *a, int path)
