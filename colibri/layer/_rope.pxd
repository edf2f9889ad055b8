# The rotary embedding's row loop (colibri/layer/_rope.pyx states the formula), for the
# layer's compiled modules to cimport: rope() and the fused decoding step run this one loop.

from colibri.layer._half cimport load_value, store_value, value_t


cdef inline void rope_rows(value_t *x, const value_t *cos, const value_t *sin, Py_ssize_t R,
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
