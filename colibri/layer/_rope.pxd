# The rotary embedding's row loop (colibri/layer/_rope.pyx states the formula;
# include/colibri/rows.h runs it), for the layer's compiled modules to cimport: rope() and the
# fused decoding step.

from colibri.layer._half cimport value_t


cdef extern from "colibri/rows.h" nogil:
    void colibri_rope_rows(void *x, const void *cos, const void *sin, Py_ssize_t R,
                           Py_ssize_t d, int kind, int path) noexcept


cdef inline void rope_rows(value_t *x, const value_t *cos, const value_t *sin, Py_ssize_t R,
                           Py_ssize_t d, int kind, int path) noexcept nogil:
    colibri_rope_rows(x, cos, sin, R, d, kind, path)
