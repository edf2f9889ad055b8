# half.h's conversions (colibri's one home for float16 / bfloat16 in C), for the layer's
# compiled modules to cimport.

from libc.stdint cimport uint16_t


cdef extern from "colibri/half.h" nogil:
    enum:
        COLIBRI_W_F16
        COLIBRI_W_BF16
    float colibri_bf16_to_float(uint16_t h) noexcept
    float colibri_half_to_float(uint16_t h) noexcept
    uint16_t colibri_float_to_bf16(float f) noexcept
    uint16_t colibri_float_to_half(float f) noexcept


# Values as the kernels store them: float32, or the uint16 bits of a half kind.
ctypedef fused value_t:
    float
    uint16_t


cdef inline float load_value(const value_t *p, Py_ssize_t i, int kind) noexcept nogil:
    """``p[i]`` as float32 (``kind``: COLIBRI_W_BF16 / COLIBRI_W_F16 for bits)."""
    if value_t is float:
        return p[i]
    elif kind == COLIBRI_W_BF16:
        return colibri_bf16_to_float(p[i])
    else:
        return colibri_half_to_float(p[i])


cdef inline float store_value(value_t *p, Py_ssize_t i, float f, int kind) noexcept nogil:
    """Store ``f`` at ``p[i]`` in the storage type; return the stored value as float32."""
    if value_t is float:
        p[i] = f
        return f
    elif kind == COLIBRI_W_BF16:
        p[i] = colibri_float_to_bf16(f)
        return colibri_bf16_to_float(p[i])
    else:
        p[i] = colibri_float_to_half(f)
        return colibri_half_to_float(p[i])


cdef inline int check_kind(const value_t *values, int kind, str where) except -1:
    """Raise unless ``kind`` names how ``values`` are stored (float32: 0; uint16: a half kind;
    ``values`` only picks the storage type and may be NULL)."""
    if value_t is float:
        if kind != 0:
            raise ValueError(f"{where}: float32 values take kind 0 (got {kind})")
    elif kind != COLIBRI_W_BF16 and kind != COLIBRI_W_F16:
        raise ValueError(f"{where}: uint16 values need a half kind (got {kind})")
    return 0
