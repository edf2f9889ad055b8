# The half-precision expert kernel (include/colibri/ffn.h), once: its struct and the run of a
# layer's experts over a checked plan, for _ffn.pyx's ffn / ffn_sum and _quant.pyx's Held.

from libc.stdint cimport int32_t, int64_t, uint16_t
from libc.stdlib cimport free, malloc

from colibri.layer._plan cimport add_rows, gather_rows


cdef extern from "colibri/ffn.h" nogil:
    ctypedef struct colibri_ffn_t:
        int32_t n, H, I
        int32_t kind
        int32_t act
        int32_t path
        const float *x
        int64_t ldx
        const uint16_t *gate
        const uint16_t *up
        int64_t ldg, ldu
        const uint16_t *down
        int64_t ldd
        float *h
        uint16_t *xs
        float *y
        int64_t ldy
    enum:
        COLIBRI_FFN_MAX_ROWS
    size_t colibri_ffn_split_bytes(const colibri_ffn_t *f) noexcept
    void colibri_ffn_run(colibri_ffn_t *f, int threads) noexcept
    void colibri_ffn_run_many(colibri_ffn_t *f, int32_t count, int32_t *first,
                              int threads) noexcept


cdef inline const uint16_t *ffn_rows(const uint16_t[:, :] w, int64_t *ld,
                                     str what) except NULL:
    if w.shape[1] > 1 and w.strides[1] != 2:
        raise ValueError(f"expert_ffn(): {what} rows must be contiguous (got strides "
                         f"{(w.strides[0], w.strides[1])}); pass np.ascontiguousarray({what})")
    ld[0] = w.strides[0] // 2
    return &w[0, 0]


cdef inline int ffn_weights(colibri_ffn_t *f, const uint16_t[:, :] gate,
                            const uint16_t[:, :] up, const uint16_t[:, :] down, int kind,
                            int act, int path) except -1:
    """One expert's weights, kind, activation and path into ``f`` (f.I already set and
    checked); x, y and the scratch are the caller's."""
    f.kind = kind
    f.act = act
    f.path = path
    f.gate = ffn_rows(gate, &f.ldg, "gate")
    f.up = ffn_rows(up, &f.ldu, "up")
    f.down = ffn_rows(down, &f.ldd, "down")
    f.xs = NULL
    f.h = NULL
    return 0


cdef inline int ffn_run_sum(colibri_ffn_t *fs, Py_ssize_t count, const int64_t[::1] bounds,
                            const int64_t[::1] rows, const float[::1] scale, int64_t total,
                            const float[:, :] x, float[:, :] y, int num_threads) except -1:
    """``y[rows[i]] += scale[i] * ffn_j(x[rows[i]])`` for i in ``[bounds[j], bounds[j + 1])``:
    the experts ``fs[:count]`` (weights, kind, activation, path, ``n``, ``H``, ``I`` set; the
    plan checked) on their scratch, two passes on the pool for all of them."""
    cdef int64_t H = x.shape[1], offset = 0
    cdef Py_ssize_t j
    cdef size_t hbytes = 0, sbytes = 0
    cdef int32_t *first = <int32_t *>malloc((count + 1) * sizeof(int32_t))
    cdef float *xg = <float *>malloc((total * H + 1) * sizeof(float))
    cdef float *yg = <float *>malloc((total * H + 1) * sizeof(float))
    cdef float *hs = NULL
    cdef char *split
    try:
        if first == NULL or xg == NULL or yg == NULL:
            raise MemoryError()
        for j in range(count):
            fs[j].x = xg + bounds[j] * H
            fs[j].ldx = H
            fs[j].y = yg + bounds[j] * H
            fs[j].ldy = H
            hbytes += <size_t>fs[j].n * fs[j].I * sizeof(float)
            sbytes += colibri_ffn_split_bytes(&fs[j])
        hs = <float *>malloc(hbytes + sbytes + 64)
        if hs == NULL:
            raise MemoryError()
        split = <char *>hs + hbytes
        for j in range(count):
            fs[j].h = hs + offset
            offset += <int64_t>fs[j].n * fs[j].I
            fs[j].xs = NULL
            if colibri_ffn_split_bytes(&fs[j]):
                fs[j].xs = <uint16_t *>split
                split += colibri_ffn_split_bytes(&fs[j])
        with nogil:
            gather_rows(x, rows, total, xg)
            colibri_ffn_run_many(fs, <int32_t>count, first, num_threads)
            add_rows(y, rows, scale, total, yg)
    finally:
        free(first)
        free(xg)
        free(yg)
        free(hs)
    return 0
