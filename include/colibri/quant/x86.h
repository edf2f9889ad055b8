/*
 * colibri/quant.h's weight-row products on x86-64: AVX2 (maddubs) and AVX-512 VNNI (vpdpbusd
 * on 256-bit vectors). Both compute each block of 32's integer dot product exactly, eight
 * blocks at once, and sum the blocks' float terms into the contract's 8 lanes in block
 * order: the same bits as colibri_q_dot_scalar. Included by colibri/quant.h.
 */
#ifndef COLIBRI_QUANT_X86_H
#define COLIBRI_QUANT_X86_H

#include <immintrin.h>

#define COLIBRI_Q_AVX2 __attribute__((target("avx2,fma,f16c")))
#define COLIBRI_Q_INLINE inline __attribute__((always_inline))
#define COLIBRI_Q_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))

/* 16 bytes -> 32 nibbles: the low nibbles first, then the high ones. */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_nibbles16(const uint8_t *p)
{
    __m128i v = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* The 32 nibbles of 32 bytes, low (shift 0) or high (shift 4). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_nibbles32(const uint8_t *p, int shift)
{
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(15));
}

COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_lookup(const int8_t *table, __m256i idx)
{
    __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
    return _mm256_shuffle_epi8(t, idx);
}

/* Weight sub-block j (of 32) of block b -> its 32 levels (colibri_q_level's values). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_unpack_avx2(int type, const uint8_t *b,
                                                                     int32_t j)
{
    switch (type) {
    case COLIBRI_Q8_0:
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    case COLIBRI_Q4_0: /* the nibbles as they are: the body takes 8 x the block's q8 sum off */
        return colibri_q_nibbles16(b + 2);
    case COLIBRI_MXFP4:
        return colibri_q_lookup(colibri_mxfp4_levels, colibri_q_nibbles16(b + 1));
    case COLIBRI_IQ4_XS:
        return colibri_q_lookup(colibri_iq4_levels, colibri_q_nibbles16(b + 8 + 16 * j));
    case COLIBRI_Q4_K:
        return colibri_q_nibbles32(b + 16 + 32 * (j >> 1), (j & 1) << 2);
    case COLIBRI_Q5_K: {
        __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 16));
        hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
        return _mm256_or_si256(colibri_q_nibbles32(b + 48 + 32 * (j >> 1), (j & 1) << 2),
                               _mm256_slli_epi16(hi, 4));
    }
    default: { /* COLIBRI_Q6_K */
        const int32_t h = j >> 2;
        __m256i lo = colibri_q_nibbles32(b + 64 * h + 32 * (j & 1), ((j >> 1) & 1) << 2);
        __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        hi = _mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * (j & 3)));
        hi = _mm256_and_si256(hi, _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    }
    }
}

/* Whether a type's unpacked levels are never negative (Q4_K 0..15, Q5_K 0..31, Q4_0's
 * nibbles before the offset of 8): they multiply the signed q8 values as unsigned bytes. */
#define COLIBRI_Q_UNSIGNED(type) \
    ((type) == COLIBRI_Q4_K || (type) == COLIBRI_Q5_K || (type) == COLIBRI_Q4_0)

/* Eight int32 partial sums of lv * q (|lv| <= 128, |q| <= 127: no int16 saturation). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_dot32_avx2(int type, __m256i lv,
                                                                    const int8_t *q)
{
    __m256i x = _mm256_loadu_si256((const __m256i *)q), p;
    if (COLIBRI_Q_UNSIGNED(type))
        p = _mm256_maddubs_epi16(lv, x);
    else
        p = _mm256_maddubs_epi16(_mm256_sign_epi8(lv, lv), _mm256_sign_epi8(x, lv));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

COLIBRI_Q_VNNI static COLIBRI_Q_INLINE __m256i colibri_q_dot32_vnni(int type, __m256i lv,
                                                                    const int8_t *q)
{
    __m256i x = _mm256_loadu_si256((const __m256i *)q);
    if (COLIBRI_Q_UNSIGNED(type))
        return _mm256_dpbusd_epi32(_mm256_setzero_si256(), lv, x);
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(lv),
                               _mm256_sign_epi8(x, lv));
}

/* Eight vectors of partial sums -> their eight totals, in order. */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_totals8(const __m256i *v)
{
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* Partial sums of a Q6_K sub-block: its two halves times their int8 scales. */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_q6_scaled(__m256i p, const uint8_t *b,
                                                                   int32_t j)
{
    __m256i s = _mm256_set_m128i(_mm_set1_epi32((int8_t)b[192 + 2 * j + 1]),
                                 _mm_set1_epi32((int8_t)b[192 + 2 * j]));
    return _mm256_mullo_epi32(p, s);
}

/* Eight consecutive sub-blocks' scales and mins (colibri_q_scale's values), from g on. */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE void colibri_q_scales8(int type, const uint8_t *w, int32_t g,
                                                              __m256 *scale, __m256 *min)
{
    const int32_t bytes = colibri_q_bytes[type];
    const uint8_t *b = w + (size_t)(g / (colibri_q_block[type] / 32)) * (size_t)bytes;
    int32_t k, sc[8];
    uint16_t h[8];
    *min = _mm256_setzero_ps();
    switch (type) {
    case COLIBRI_Q8_0:
    case COLIBRI_Q4_0: /* eight blocks' float16 scales: F16C */
        for (k = 0; k < 8; k++)
            memcpy(&h[k], b + (size_t)k * (size_t)bytes, 2);
        *scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        return;
    case COLIBRI_MXFP4:
        for (k = 0; k < 8; k++)
            sc[k] = b[(size_t)k * (size_t)bytes] < 2 ? 0x00200000 << b[(size_t)k * (size_t)bytes]
                                                     : (b[(size_t)k * (size_t)bytes] - 1) << 23;
        *scale = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)sc));
        return;
    case COLIBRI_Q4_K:
    case COLIBRI_Q5_K: { /* the 12 packed bytes -> 8 scales and 8 mins of 6 bits, 4 at a time */
        uint32_t v[3], packed[4];
        memcpy(v, b + 4, 12);
        packed[0] = v[0] & 0x3f3f3f3fu;                                        /* sc 0..3 */
        packed[1] = (v[2] & 0x0f0f0f0fu) | (((v[0] >> 6) & 0x03030303u) << 4); /* sc 4..7 */
        packed[2] = v[1] & 0x3f3f3f3fu;                                        /* m 0..3 */
        packed[3] = ((v[2] >> 4) & 0x0f0f0f0fu) | (((v[1] >> 6) & 0x03030303u) << 4);
        *scale = _mm256_mul_ps(
            _mm256_set1_ps(colibri_q_f16(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)packed))));
        *min = _mm256_mul_ps(_mm256_set1_ps(colibri_q_f16(b + 2)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                 _mm_loadl_epi64((const __m128i *)(packed + 2)))));
        return;
    }
    case COLIBRI_Q6_K:
        *scale = _mm256_set1_ps(colibri_q_f16(b + 208));
        return;
    default: { /* COLIBRI_IQ4_XS */
        uint32_t high = (uint32_t)(b[2] | (b[3] << 8));
        for (k = 0; k < 8; k++)
            sc[k] =
                (((b[4 + (k >> 1)] >> ((k & 1) << 2)) & 15) | (((high >> (2 * k)) & 3) << 4)) - 32;
        *scale = _mm256_mul_ps(_mm256_set1_ps(colibri_q_f16(b)),
                               _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)sc)));
        return;
    }
    }
}

/* The typed body with the type, and for one row the row count, as constants. */
#define COLIBRI_Q_TYPED(name, T)                        \
    do {                                                \
        if (nb == 1)                                    \
            name##_typed(T, w, K, d, q, s, 1, y, ldy);  \
        else                                            \
            name##_typed(T, w, K, d, q, s, nb, y, ldy); \
        return;                                         \
    } while (0)

/* The body of both x86 paths: DOT32 is the 32-value integer dot product. */
#define COLIBRI_Q_DOT_X86(name, target, DOT32)                                                     \
    target static COLIBRI_Q_INLINE void name##_typed(                                              \
        int type, const uint8_t *w, int32_t K, const float *d, const int8_t *q, const int32_t *s,  \
        int32_t nb, float *y, int64_t ldy)                                                         \
    {                                                                                              \
        const int32_t subs = colibri_q_block[type] / 32, G = K / 32, G8 = G & ~7;                  \
        __m256 acc[COLIBRI_Q_ROW_BLOCK];                                                           \
        float lanes[COLIBRI_Q_ROW_BLOCK][COLIBRI_Q_LANES];                                         \
        int8_t lv8[32];                                                                            \
        int32_t g, k, r;                                                                           \
        for (r = 0; r < nb; r++)                                                                   \
            acc[r] = _mm256_setzero_ps();                                                          \
        for (g = 0; g < G8; g += 8) {                                                              \
            __m256i part[COLIBRI_Q_ROW_BLOCK][8], lv[8];                                           \
            __m256 vs, vm;                                                                         \
            _Pragma("GCC unroll 8") for (k = 0; k < 8; k++)                                        \
            {                                                                                      \
                const uint8_t *b = w + (size_t)((g + k) / subs) * (size_t)colibri_q_bytes[type];   \
                lv[k] = colibri_q_unpack_avx2(type, b, (g + k) % subs);                            \
                for (r = 0; r < nb; r++) {                                                         \
                    part[r][k] = DOT32(type, lv[k], q + (size_t)r * K + 32 * (g + k));             \
                    if (type == COLIBRI_Q6_K)                                                      \
                        part[r][k] = colibri_q_q6_scaled(part[r][k], b, (g + k) % subs);           \
                }                                                                                  \
            }                                                                                      \
            colibri_q_scales8(type, w, g, &vs, &vm);                                               \
            for (r = 0; r < nb; r++) {                                                             \
                __m256 xd = _mm256_loadu_ps(d + (size_t)r * G + g);                                \
                __m256i total = colibri_q_totals8(part[r]);                                        \
                __m256 isum;                                                                       \
                if (type == COLIBRI_Q4_0) /* sum (nibble - 8) q = sum nibble q - 8 sum q */        \
                    total = _mm256_sub_epi32(                                                      \
                        total,                                                                     \
                        _mm256_slli_epi32(                                                         \
                            _mm256_loadu_si256((const __m256i *)(s + (size_t)r * G + g)), 3));     \
                isum = _mm256_cvtepi32_ps(total);                                                  \
                __m256 term = _mm256_mul_ps(_mm256_mul_ps(vs, xd), isum);                          \
                if (type != COLIBRI_Q6_K) {                                                        \
                    __m256 xs = _mm256_cvtepi32_ps(                                                \
                        _mm256_loadu_si256((const __m256i *)(s + (size_t)r * G + g)));             \
                    term = _mm256_sub_ps(term, _mm256_mul_ps(_mm256_mul_ps(vm, xd), xs));          \
                }                                                                                  \
                acc[r] = _mm256_add_ps(acc[r], term);                                              \
            }                                                                                      \
        }                                                                                          \
        for (r = 0; r < nb; r++)                                                                   \
            _mm256_storeu_ps(lanes[r], acc[r]);                                                    \
        for (; g < G; g++) { /* 32-value types whose rows are not whole groups of 8 blocks */      \
            const uint8_t *b = w + (size_t)(g / subs) * (size_t)colibri_q_bytes[type];             \
            colibri_q_unpack(type, b, g % subs, lv8);                                              \
            for (r = 0; r < nb; r++) {                                                             \
                int32_t isum = colibri_q_isum(type, b, g % subs, lv8, q + (size_t)r * K + 32 * g); \
                lanes[r][g % COLIBRI_Q_LANES] +=                                                   \
                    colibri_q_term(type, b, g % subs, isum, d[r * G + g], s[r * G + g]);           \
            }                                                                                      \
        }                                                                                          \
        for (r = 0; r < nb; r++)                                                                   \
            y[r * ldy] = colibri_q_lanes_sum(lanes[r]);                                            \
    }                                                                                              \
    /* one copy of the body per type, the type a constant in each */                               \
    target static void name(int type, const uint8_t *w, int32_t K, const float *d,                 \
                            const int8_t *q, const int32_t *s, int32_t nb, float *y, int64_t ldy)  \
    {                                                                                              \
        switch (type) {                                                                            \
        case COLIBRI_Q8_0:                                                                         \
            COLIBRI_Q_TYPED(name, COLIBRI_Q8_0);                                                   \
        case COLIBRI_Q4_0:                                                                         \
            COLIBRI_Q_TYPED(name, COLIBRI_Q4_0);                                                   \
        case COLIBRI_Q4_K:                                                                         \
            COLIBRI_Q_TYPED(name, COLIBRI_Q4_K);                                                   \
        case COLIBRI_Q5_K:                                                                         \
            COLIBRI_Q_TYPED(name, COLIBRI_Q5_K);                                                   \
        case COLIBRI_Q6_K:                                                                         \
            COLIBRI_Q_TYPED(name, COLIBRI_Q6_K);                                                   \
        case COLIBRI_IQ4_XS:                                                                       \
            COLIBRI_Q_TYPED(name, COLIBRI_IQ4_XS);                                                 \
        default:                                                                                   \
            COLIBRI_Q_TYPED(name, COLIBRI_MXFP4);                                                  \
        }                                                                                          \
    }

COLIBRI_Q_DOT_X86(colibri_q_dot_avx2, COLIBRI_Q_AVX2, colibri_q_dot32_avx2)
COLIBRI_Q_DOT_X86(colibri_q_dot_vnni, COLIBRI_Q_VNNI, colibri_q_dot32_vnni)

#endif /* COLIBRI_QUANT_X86_H */
