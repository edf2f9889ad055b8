# half.h's conversions (colibri's one home for float16 / bfloat16 in C), for the layer's
# compiled modules to cimport.

from libc.stdint cimport uint16_t


cdef extern from "colibri/half.h" nogil:
    enum:
        COLIBRI_W_F16
        COLIBRI_W_BF16
    float colibri_bf16_to_float(uint16_t h) noexcept
    float colibri_half_to_float(uint16_t h) noexcept
    float colibri_half_to_float_fast(uint16_t h) noexcept
    uint16_t colibri_float_to_bf16(float f) noexcept
    uint16_t colibri_float_to_half(float f) noexcept
