/*
 * colibri's one home for half-precision conversions in C: IEEE half (float16) and bfloat16
 * to float32, exactly (every 16-bit value maps to the float32 it denotes, NaN and inf
 * included), and float32 to each, rounded to nearest even. Plain C, no intrinsics.
 */
#ifndef COLIBRI_HALF_H
#define COLIBRI_HALF_H

#include <stdint.h>
#include <string.h>

/* Which half format 16-bit storage holds, wherever colibri reads or writes it. */
enum { COLIBRI_W_F16 = 1, COLIBRI_W_BF16 = 2 };

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

/* IEEE half -> float32 (exact; NaN payloads kept), branch-light so that loops over it
 * vectorize: rebias the exponent; inf/NaN get the rest of the bias; zero/subnormals are
 * renormalised by an (exact) float subtraction. */
static inline float colibri_half_to_float(uint16_t h)
{
    const uint32_t exp_mask = 0x7c00u << 13;
    uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
    uint32_t exp = o & exp_mask;
    float f;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == exp_mask) {
        o += (uint32_t)(128 - 16) << 23;
    } else if (exp == 0) {
        const uint32_t magic_bits = 113u << 23;
        float magic;
        o += 1u << 23;
        memcpy(&f, &o, sizeof f);
        memcpy(&magic, &magic_bits, sizeof magic);
        f -= magic;
        memcpy(&o, &f, sizeof o);
    }
    o |= ((uint32_t)h & 0x8000u) << 16;
    memcpy(&f, &o, sizeof f);
    return f;
}

/* float32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t colibri_float_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* float32 -> IEEE half, round to nearest even, overflow to inf, subnormals exact; NaN stays
 * a (quiet) NaN with the top bits of its payload. */
static inline uint16_t colibri_float_to_half(float f)
{
    uint32_t x, ax, sign;
    memcpy(&x, &f, sizeof x);
    sign = (x >> 16) & 0x8000u;
    ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf / NaN */
        return (uint16_t)(sign | 0x7c00u
                          | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
    if (ax >= 0x477ff000u) /* rounds to >= 65520: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) { /* below 2^-14: half subnormal or zero */
        uint32_t e, m, shift, r, rem, halfway;
        if (ax < 0x33000000u) /* <= 2^-25: rounds to zero */
            return (uint16_t)sign;
        e = ax >> 23;
        m = (ax & 0x7fffffu) | 0x800000u;
        shift = 126u - e;
        r = m >> shift;
        rem = m & ((1u << shift) - 1u);
        halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (r & 1u)))
            r++;
        return (uint16_t)(sign | r);
    }
    ax += 0xfffu + ((ax >> 13) & 1u);
    ax -= 0x38000000u; /* exponent bias 127 -> 15 */
    return (uint16_t)(sign | (ax >> 13));
}

#endif /* COLIBRI_HALF_H */
