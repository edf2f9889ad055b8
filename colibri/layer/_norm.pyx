"""RMSNorm over rows, transformers' formula, for decode-size inputs.

``y = w * round(x * (1 / sqrt(mean(x^2) + eps)))``: ``x`` read as float32, the mean of its
squares summed exactly in double and rounded once to float32, ``round`` to the storage type
(bfloat16 / float16 round to nearest even; float32 as is), then one product with the weight
rounded to the storage type. torch sums the float32 squares in its own order, so the two
means can differ in float32's last place; the outputs then differ by at most one unit in the
last place of the storage type, and rarely.
"""

from colibri.layer._half cimport COLIBRI_W_BF16, COLIBRI_W_F16, check_kind, value_t

from colibri.layer._ffn import path_index

# How values are stored: float32 (plain), or 16-bit bits of half.h's kinds.
KIND_PLAIN = 0
KIND_FLOAT16 = COLIBRI_W_F16
KIND_BFLOAT16 = COLIBRI_W_BF16


def rms_norm(const value_t[:, ::1] x, const value_t[::1] weight, float eps,
             value_t[:, ::1] out, int kind, path=None):
    """``out = weight * round(x * (1 / sqrt(mean(x^2, axis=1) + eps)))`` row by row.

    ``x``, ``out`` ``[T, n]`` and ``weight`` ``[n]``: float32 (``kind`` 0), or the uint16 bits
    of ``kind``'s half type. ``out`` may be ``x``. ``path``: a SIMD path this CPU runs (None:
    the dispatched one; every path: the same bits).
    """
    cdef Py_ssize_t T = x.shape[0], n = x.shape[1]
    if weight.shape[0] != n or out.shape[0] != T or out.shape[1] != n:
        raise ValueError(
            f"rms_norm(): x is [{T}, {n}], weight [{weight.shape[0]}] and out "
            f"[{out.shape[0]}, {out.shape[1]}]; weight must be [{n}] and out [{T}, {n}]"
        )
    check_kind(<const value_t *>NULL, kind, "rms_norm()")
    if T == 0 or n == 0:
        return
    cdef int p = path_index(path)
    with nogil:
        norm_rows(&x[0, 0], &weight[0], T, n, eps, &out[0, 0], kind, p)
