# The checks of a layer's plan, once, for the ffn_sum of _ffn.pyx, _quant.pyx and _fp8.pyx:
# which assignments each expert takes (bounds), the rows of x they read and their scales.

from libc.stdint cimport int64_t


cdef extern from "colibri/ffn.h" nogil:
    enum:
        COLIBRI_FFN_MAX_ROWS


cdef inline int64_t check_plan(Py_ssize_t count, int64_t T, const int64_t[::1] bounds,
                               const int64_t[::1] rows, const float[::1] scale) except -1:
    """The number of assignments, ``bounds[count]``, once the plan is checked.

    bounds int64 [count + 1] from 0, 1 to COLIBRI_FFN_MAX_ROWS assignments an expert; rows
    int64 and scale float32 [bounds[count]], rows in [0, T). ValueError naming ffn_sum()
    otherwise.
    """
    cdef Py_ssize_t j
    cdef int64_t i, n, total
    if bounds.shape[0] != count + 1 or bounds[0] != 0:
        raise ValueError(f"ffn_sum(): bounds must be [{count + 1}] from 0")
    for j in range(count):
        n = bounds[j + 1] - bounds[j]
        if n < 1 or n > COLIBRI_FFN_MAX_ROWS:
            raise ValueError(f"ffn_sum(): expert {j} has {n} rows (1 to {COLIBRI_FFN_MAX_ROWS})")
    total = bounds[count]
    if rows.shape[0] != total or scale.shape[0] != total:
        raise ValueError(f"ffn_sum(): rows and scale must be [{total}] (bounds[-1])")
    for i in range(total):
        if rows[i] < 0 or rows[i] >= T:
            raise ValueError(f"ffn_sum(): row {rows[i]} outside x's {T} rows")
    return total


cdef inline void gather_rows(const float[:, :] x, const int64_t[::1] rows, int64_t total,
                             float *xg) noexcept nogil:
    """xg [total, H] = the rows of x that rows[:total] names (checked by check_plan)."""
    cdef int64_t i, k, H = x.shape[1]
    for i in range(total):
        for k in range(H):
            xg[i * H + k] = x[rows[i], k]


cdef inline void add_rows(float[:, :] y, const int64_t[::1] rows, const float[::1] scale,
                          int64_t total, const float *yg) noexcept nogil:
    """y[rows[i]] += scale[i] * yg[i] for i < total (yg [total, H], the experts' outputs)."""
    cdef int64_t i, k, H = y.shape[1]
    for i in range(total):
        for k in range(H):
            y[rows[i], k] += scale[i] * yg[i * H + k]
