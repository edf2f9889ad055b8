# RMSNorm's row loop (colibri/layer/_norm.pyx states the formula; include/colibri/rows.h runs
# it), for the layer's compiled modules to cimport: rms_norm() and the fused decoding step.

from colibri.layer._half cimport value_t


cdef extern from "colibri/rows.h" nogil:
    void colibri_norm_rows(const void *x, const void *w, Py_ssize_t T, Py_ssize_t n, float eps,
                           void *y, int kind, int path) noexcept


cdef inline void norm_rows(const value_t *x, const value_t *w, Py_ssize_t T, Py_ssize_t n,
                           float eps, value_t *y, int kind, int path) noexcept nogil:
    colibri_norm_rows(x, w, T, n, eps, y, kind, path)
