"""Rotary position embedding of rows, transformers' rotate-half formula, in place.

``y = round(round(x * cos) + round(rotate_half(x) * sin))`` with ``rotate_half(x) =
[-x[d/2:], x[:d/2]]``: each product rounded to the storage type before the sum, as torch's
elementwise operations on half-precision tensors round each result (float32: no rounding), so
the rows equal transformers' ``apply_rotary_pos_emb`` bit for bit.
"""

from colibri.layer._half cimport check_kind, value_t

from colibri.layer._ffn import path_index


def rope(value_t[:, ::1] x, const value_t[::1] cos, const value_t[::1] sin, int kind,
         path=None):
    """Rotate each row of ``x`` ``[R, d]`` (``d`` even) in place by ``cos``, ``sin`` ``[d]``:
    float32 (``kind`` 0), or the uint16 bits of ``kind``'s half type. ``path``: a SIMD path
    this CPU runs (None: the dispatched one; every path: the same bits)."""
    cdef Py_ssize_t R = x.shape[0], d = x.shape[1]
    if d % 2 or cos.shape[0] != d or sin.shape[0] != d:
        raise ValueError(
            f"rope(): x is [{R}, {d}], cos [{cos.shape[0]}] and sin [{sin.shape[0]}]; the row "
            f"length must be even and cos, sin [{d}]"
        )
    check_kind(<const value_t *>NULL, kind, "rope()")
    if R == 0 or d == 0:
        return
    cdef int p = path_index(path)
    with nogil:
        rope_rows(&x[0, 0], &cos[0], &sin[0], R, d, kind, p)
