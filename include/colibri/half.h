/*
 * IEEE half (float16) and bfloat16 to float32, exactly (every 16-bit value maps
 * to the float32 it denotes, NaN and inf included). Plain C, no intrinsics.
 */
#ifndef COLIBRI_HALF_H
#define COLIBRI_HALF_H

#include <stdint.h>
#include <string.h>

static inline float colibri_bits_to_float(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float colibri_bf16_to_float(uint16_t h)
{
    return colibri_bits_to_float((uint32_t)h << 16);
}

static inline float colibri_half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) /* inf / NaN */
        return colibri_bits_to_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        if (mantissa == 0)
            return colibri_bits_to_float(sign);
        /* subnormal: value = mantissa * 2^-24, exact in float32 */
        float magnitude = (float)mantissa * 5.9604644775390625e-08f;
        return sign ? -magnitude : magnitude;
    }
    return colibri_bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

#endif /* COLIBRI_HALF_H */
