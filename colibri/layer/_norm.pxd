# RMSNorm's row loop (colibri/layer/_norm.pyx states the formula), for the layer's compiled
# modules to cimport: rms_norm() and the fused decoding step run this one loop.

from libc.math cimport sqrtf

from colibri.layer._half cimport load_value, store_value, value_t


cdef inline void norm_rows(const value_t *x, const value_t *w, Py_ssize_t T, Py_ssize_t n,
                           float eps, value_t *y, int kind) noexcept nogil:
    cdef Py_ssize_t _, i
    cdef double s0, s1, s2, s3
    cdef float h, r, v
    for _ in range(T):
        s0 = s1 = s2 = s3 = 0.0  # products of floats are exact in double
        i = 0
        while i + 4 <= n:
            h = load_value(x, i, kind)
            s0 += <double>h * h
            h = load_value(x, i + 1, kind)
            s1 += <double>h * h
            h = load_value(x, i + 2, kind)
            s2 += <double>h * h
            h = load_value(x, i + 3, kind)
            s3 += <double>h * h
            i += 4
        while i < n:
            h = load_value(x, i, kind)
            s0 += <double>h * h
            i += 1
        v = <float>(((s0 + s1) + (s2 + s3)) / <double>n)
        r = 1.0 / sqrtf(v + eps)  # torch's rsqrt: a division by a rounded square root
        for i in range(n):
            h = store_value(y, i, load_value(x, i, kind) * r, kind)
            store_value(y, i, load_value(w, i, kind) * h, kind)
        x += n
        y += n
