"""Rotary position embedding of rows, transformers' rotate-half formula, in place.

``y = round(round(x * cos) + round(rotate_half(x) * sin))`` with ``rotate_half(x) =
[-x[d/2:], x[:d/2]]``: each product rounded to the storage type before the sum, as torch's
elementwise operations on half-precision tensors round each result (float32: no rounding), so
the rows equal transformers' ``apply_rotary_pos_emb`` bit for bit.
"""

from colibri.layer._half cimport check_kind, load_value, store_value, value_t


cdef void _rows(value_t *x, const value_t *cos, const value_t *sin, Py_ssize_t R,
                Py_ssize_t d, int kind) noexcept nogil:
    cdef Py_ssize_t _, i, half = d // 2
    cdef float a, b, c, s, lo, hi
    cdef value_t t
    for _ in range(R):
        for i in range(half):
            a = load_value(x, i, kind)  # x[i]: its partner in rotate_half is -x[i + half]
            b = load_value(x, i + half, kind)
            c = load_value(cos, i, kind)
            s = load_value(sin, i, kind)
            lo = store_value(&t, 0, a * c, kind) + store_value(&t, 0, -b * s, kind)
            c = load_value(cos, i + half, kind)
            s = load_value(sin, i + half, kind)
            hi = store_value(&t, 0, b * c, kind) + store_value(&t, 0, a * s, kind)
            store_value(x, i, lo, kind)
            store_value(x, i + half, hi, kind)
        x += d


def rope(value_t[:, ::1] x, const value_t[::1] cos, const value_t[::1] sin, int kind):
    """Rotate each row of ``x`` ``[R, d]`` (``d`` even) in place by ``cos``, ``sin`` ``[d]``:
    float32 (``kind`` 0), or the uint16 bits of ``kind``'s half type."""
    cdef Py_ssize_t R = x.shape[0], d = x.shape[1]
    if d % 2 or cos.shape[0] != d or sin.shape[0] != d:
        raise ValueError(
            f"rope(): x is [{R}, {d}], cos [{cos.shape[0]}] and sin [{sin.shape[0]}]; the row "
            f"length must be even and cos, sin [{d}]"
        )
    check_kind(<const value_t *>NULL, kind, "rope()")
    if R == 0 or d == 0:
        return
    with nogil:
        _rows(&x[0, 0], &cos[0], &sin[0], R, d, kind)
