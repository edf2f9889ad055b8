/*
 * colibri/quant.h's weight-row products on x86-64: AVX2 (maddubs) and AVX-512 VNNI (vpdpbusd
 * on 512-bit vectors, two blocks of 32 each). Both compute each block of 32's integer dot
 * product exactly, eight blocks at once (their partial sums reduced to eight totals in one
 * tree, then one convert and one multiply-add of the eight terms), and sum the blocks' float
 * terms into the contract's 8 lanes in block order: the same bits as colibri_q_dot_scalar.
 * Every float16 scale is read with F16C inline: a call into non-VEX code from these loops
 * costs an SSE/AVX transition on Intel (20x slower K types). Included by colibri/quant.h.
 */
#ifndef COLIBRI_QUANT_X86_H
#define COLIBRI_QUANT_X86_H

#include <immintrin.h>

#define COLIBRI_Q_AVX2 __attribute__((target("avx2,fma,f16c")))
#define COLIBRI_Q_INLINE inline __attribute__((always_inline))
#define COLIBRI_Q_VNNI \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* A float16 scale by F16C: colibri_q_f16's value, inlined (no call into non-VEX code). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE float colibri_q_f16_x86(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

/* The 32 nibbles of 32 bytes, low (shift 0) or high (shift 4). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_nibbles32(const uint8_t *p, int shift)
{
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(15));
}

/* Weight sub-block j (of 32) of block b -> its 32 levels (colibri_q_level's values; Q6_K's
 * plus 32, unsigned: they multiply the q8 values in one maddubs). Q4_0, IQ4_XS and MXFP4:
 * colibri_q_unpack2_avx2. */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_unpack_avx2(int type, const uint8_t *b,
                                                                     int32_t j)
{
    switch (type) {
    case COLIBRI_Q8_0:
        return _mm256_loadu_si256((const __m256i *)(b + 2));
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
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)); /* unsigned: the level + 32 */
    }
    }
}

/* Whether a type's unpacked levels are never negative (Q4_K 0..15, Q5_K 0..31, Q4_0's
 * nibbles before the offset of 8): they multiply the signed q8 values as unsigned bytes. */
#define COLIBRI_Q_UNSIGNED(type) \
    ((type) == COLIBRI_Q4_K || (type) == COLIBRI_Q5_K || (type) == COLIBRI_Q4_0)

/* Eight int32 partial sums of lv * x (|lv| <= 128, |x| <= 127: no int16 saturation). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_madd_avx2(int type, __m256i lv, __m256i x)
{
    __m256i p;
    if (COLIBRI_Q_UNSIGNED(type) || COLIBRI_Q_E2M1(type)) /* levels (+ 12) <= 31 */
        p = _mm256_maddubs_epi16(lv, x);
    else if (type == COLIBRI_Q6_K) /* (level + 32) q - 32 q, per 2 values (|.| < 2^14) */
        p = _mm256_sub_epi16(_mm256_maddubs_epi16(lv, x),
                             _mm256_maddubs_epi16(_mm256_set1_epi8(32), x));
    else
        p = _mm256_maddubs_epi16(_mm256_sign_epi8(lv, lv), _mm256_sign_epi8(x, lv));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* 16 bytes at p0, then 16 bytes at p1. */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_load2x16(const void *p0, const void *p1)
{
    return _mm256_set_m128i(_mm_loadu_si128((const __m128i *)p1),
                            _mm_loadu_si128((const __m128i *)p0));
}

/* Whether a type keeps a block of 32's levels as the nibbles of 16 bytes (values 0..15 low,
 * 16..31 high): AVX2 pairs two blocks' low nibbles, and their high ones, in a vector. */
#define COLIBRI_Q_NIBBLES16(type) \
    ((type) == COLIBRI_Q4_0 || (type) == COLIBRI_IQ4_XS || COLIBRI_Q_E2M1(type))

/* Where a block of 32's 16 bytes of nibbles start in it (Q4_0, MXFP4: after the scale). */
#define COLIBRI_Q_NIBBLES_AT(type) ((type) == COLIBRI_Q4_0 ? 2 : (type) == COLIBRI_MXFP4 ? 1 : 0)

/* Those types' sub-blocks k and k + 1 (k even) of the eight from b0: lo = values 0..15 of
 * both, hi = values 16..31 of both (colibri_q_level's levels; Q4_0's nibbles as they are, the
 * body takes 8 x the block's q8 sum off; MXFP4's plus 12, unsigned). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE void
colibri_q_unpack2_avx2(int type, const uint8_t *b0, int32_t k, __m256i *lo, __m256i *hi)
{
    const size_t bytes = (size_t)colibri_q_bytes[type];
    const __m256i m = _mm256_set1_epi8(15);
    __m256i v;
    if (type == COLIBRI_IQ4_XS) /* one block of 256: 16 bytes per sub-block, contiguous */
        v = _mm256_loadu_si256((const __m256i *)(b0 + 8 + 16 * k));
    else
        v = colibri_q_load2x16(b0 + k * bytes + COLIBRI_Q_NIBBLES_AT(type),
                               b0 + (k + 1) * bytes + COLIBRI_Q_NIBBLES_AT(type));
    *lo = _mm256_and_si256(v, m);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    if (type != COLIBRI_Q4_0) {
        const int8_t *levels = COLIBRI_Q_E2M1(type) ? colibri_mxfp4_levels : colibri_iq4_levels;
        __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)levels));
        if (COLIBRI_Q_E2M1(type))
            t = _mm256_add_epi8(t, _mm256_set1_epi8(12));
        *lo = _mm256_shuffle_epi8(t, *lo);
        *hi = _mm256_shuffle_epi8(t, *hi);
    }
}

/* Q6_K's int8 scales of sub-blocks j..j+3 (j = 0 or 4): halves 0, then halves 1. */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_q6_scales4(const uint8_t *b, int32_t j)
{
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(b + 192)), order);
    return _mm256_cvtepi8_epi32(j ? _mm_srli_si128(sc, 8) : sc);
}

/* Sub-blocks g..g+7 (b0: the block of sub-block g) times nb q8 rows (q: sub-block g's values
 * in row 0, rows K apart; s: its sum, rows G apart) -> each row's eight integer dots, in order
 * (Q4_0: of the nibbles; MXFP4's and Q6_K's offsets taken off here). Eight vectors of partial
 * sums per row, summed by a tree of hadd; a Q6_K sub-block's halves are scaled half way down
 * the tree (4 sub-blocks per multiply). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE void colibri_q_totals8_avx2(int type, const uint8_t *b0,
                                                                   const int8_t *q, int32_t K,
                                                                   const int32_t *s, int32_t G,
                                                                   int32_t nb, __m256i *total)
{
    const int32_t subs = colibri_q_block[type] / 32;
    __m256i p[COLIBRI_Q_ROW_BLOCK][8];
    int32_t k, r;
    if (COLIBRI_Q_NIBBLES16(type)) { /* p[r][k / 2]: [4 sums of block k | 4 of block k + 1] */
        _Pragma("GCC unroll 4") for (k = 0; k < 8; k += 2)
        {
            __m256i lo, hi;
            colibri_q_unpack2_avx2(type, b0, k, &lo, &hi);
            for (r = 0; r < nb; r++) {
                const int8_t *x = q + (size_t)r * K + 32 * k;
                const __m256i x0 = colibri_q_load2x16(x, x + 32);
                const __m256i x1 = colibri_q_load2x16(x + 16, x + 48);
                if (type == COLIBRI_Q4_0 || COLIBRI_Q_E2M1(type)) /* pairs < 2^13: add first */
                    p[r][k / 2] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x0),
                                                                     _mm256_maddubs_epi16(hi, x1)),
                                                    _mm256_set1_epi16(1));
                else
                    p[r][k / 2] = _mm256_add_epi32(colibri_q_madd_avx2(type, lo, x0),
                                                   colibri_q_madd_avx2(type, hi, x1));
            }
        }
    } else {
        _Pragma("GCC unroll 8") for (k = 0; k < 8; k++)
        {
            const uint8_t *b = subs == 1 ? b0 + (size_t)k * colibri_q_bytes[type] : b0;
            __m256i lv = colibri_q_unpack_avx2(type, b, subs == 1 ? 0 : k);
            for (r = 0; r < nb; r++)
                p[r][k] = colibri_q_madd_avx2(
                    type, lv, _mm256_loadu_si256((const __m256i *)(q + (size_t)r * K + 32 * k)));
        }
    }
    for (r = 0; r < nb; r++) {
        __m256i *v = p[r], lo, hi;
        if (COLIBRI_Q_NIBBLES16(type)) { /* [0, 2, 4, 6 | 1, 3, 5, 7] -> in order */
            lo = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            total[r] = _mm256_permutevar8x32_epi32(lo, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        } else {
            lo = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            hi = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
            if (type == COLIBRI_Q6_K) { /* [halves 0 | halves 1] of sub-blocks 0..3, 4..7 */
                lo = _mm256_mullo_epi32(lo, colibri_q_q6_scales4(b0, 0));
                hi = _mm256_mullo_epi32(hi, colibri_q_q6_scales4(b0, 4));
            }
            total[r] = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                        _mm256_permute2x128_si256(lo, hi, 0x31));
        }
        if (COLIBRI_Q_E2M1(type)) { /* sum (level + 12) q - 12 sum q */
            __m256i sum = _mm256_loadu_si256((const __m256i *)(s + (size_t)r * G));
            total[r] = _mm256_sub_epi32(total[r], _mm256_mullo_epi32(sum, _mm256_set1_epi32(12)));
        }
    }
}

/* AVX-512 VNNI: the nibbles of 16 bytes at p0, then of 16 bytes at p1 (low ones first). */
COLIBRI_Q_VNNI static COLIBRI_Q_INLINE __m512i colibri_q_nibbles2x16(const uint8_t *p0,
                                                                     const uint8_t *p1)
{
    __m512i v = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p0))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p1)), 1);
    v = _mm512_srlv_epi32(v, _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4));
    return _mm512_and_si512(v, _mm512_set1_epi8(15));
}

/* AVX-512 VNNI: sub-blocks k and k + 1 (k even) of the eight from b0 as one vector of
 * unsigned bytes: the levels, plus 128 where they can be negative (Q6_K's: plus 32). */
COLIBRI_Q_VNNI static COLIBRI_Q_INLINE __m512i colibri_q_unpack2_vnni(int type, const uint8_t *b0,
                                                                      int32_t k)
{
    const int32_t bytes = colibri_q_bytes[type];
    const uint8_t *b1 = b0 + (size_t)(k + 1) * (size_t)bytes;
    b0 += (size_t)k * (size_t)bytes; /* blocks of 32: blocks k and k + 1 */
    switch (type) {
    case COLIBRI_Q8_0:
        return _mm512_xor_si512(
            _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1),
            _mm512_set1_epi8((char)0x80));
    case COLIBRI_Q4_0:
        return colibri_q_nibbles2x16(b0 + 2, b1 + 2);
    case COLIBRI_MXFP4:
    case COLIBRI_MXFP4_OSS:
    case COLIBRI_IQ4_XS: {
        const int8_t *levels = COLIBRI_Q_E2M1(type) ? colibri_mxfp4_levels : colibri_iq4_levels;
        __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)levels));
        t = _mm512_xor_si512(t, _mm512_set1_epi8((char)0x80));
        if (COLIBRI_Q_E2M1(type))
            return _mm512_shuffle_epi8(t, colibri_q_nibbles2x16(b0 + COLIBRI_Q_NIBBLES_AT(type),
                                                                b1 + COLIBRI_Q_NIBBLES_AT(type)));
        b0 -= (size_t)k * (size_t)bytes; /* one block of 256: its sub-blocks k and k + 1 */
        return _mm512_shuffle_epi8(t, colibri_q_nibbles2x16(b0 + 8 + 16 * k, b0 + 24 + 16 * k));
    }
    default:
        break;
    }
    b0 -= (size_t)k * (size_t)bytes; /* one block of 256: its sub-blocks k and k + 1 */
    if (type == COLIBRI_Q4_K || type == COLIBRI_Q5_K) { /* 32 bytes' low nibbles, high ones */
        const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
        const uint8_t *qs = b0 + (type == COLIBRI_Q4_K ? 16 : 48) + 16 * k;
        __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qs));
        v = _mm512_and_si512(_mm512_srlv_epi32(v, shift), _mm512_set1_epi8(15));
        if (type == COLIBRI_Q5_K) { /* bit k, then bit k + 1, of the 32 high-bit bytes */
            __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b0 + 16)));
            h = _mm512_srlv_epi32(
                h, _mm512_add_epi32(_mm512_srli_epi32(shift, 2), _mm512_set1_epi32(k)));
            v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi8(1)), 4));
        }
        return v;
    }
    { /* COLIBRI_Q6_K, unsigned (levels + 32): 64 low-bit bytes, 32 high-bit bytes */
        const int32_t h = k >> 2, hs = 2 * (k & 3);
        __m512i lo = _mm512_loadu_si512((const void *)(b0 + 64 * h));
        __m512i hi =
            _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b0 + 128 + 32 * h)));
        lo = _mm512_and_si512(_mm512_srli_epi32(lo, ((k >> 1) & 1) << 2), _mm512_set1_epi8(15));
        hi = _mm512_srlv_epi32(hi,
                               _mm512_setr_epi32(hs, hs, hs, hs, hs, hs, hs, hs, hs + 2, hs + 2,
                                                 hs + 2, hs + 2, hs + 2, hs + 2, hs + 2, hs + 2));
        hi = _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi8(3)), 4);
        return _mm512_or_si512(lo, hi);
    }
}

/* colibri_q_totals8_avx2 with vpdpbusd on 512-bit vectors (two sub-blocks each). Signed levels
 * are offset by 128 into unsigned bytes, and 128 x the q8 block's sum taken off the total;
 * Q6_K's by 32, and 32 x each 4 q8 values' sum taken off the partial sums (its halves have
 * their own scales). The four vectors of partial sums per row are summed by unpacks: 128-bit
 * chunk c of the sum holds the sums of chunk c of sub-blocks 0, 2, 4, 6 (c = 0, 1) or of
 * 1, 3, 5, 7 (c = 2, 3); Q6_K's halves are scaled there, one multiply for all eight. */
COLIBRI_Q_VNNI static COLIBRI_Q_INLINE void colibri_q_totals8_vnni(int type, const uint8_t *b0,
                                                                   const int8_t *q, int32_t K,
                                                                   const int32_t *s, int32_t G,
                                                                   int32_t nb, __m256i *total)
{
    const int offset = !COLIBRI_Q_UNSIGNED(type) && type != COLIBRI_Q6_K;
    __m512i p[COLIBRI_Q_ROW_BLOCK][4];
    int32_t k, r;
    _Pragma("GCC unroll 4") for (k = 0; k < 4; k++)
    {
        __m512i lv = colibri_q_unpack2_vnni(type, b0, 2 * k);
        for (r = 0; r < nb; r++) {
            __m512i x = _mm512_loadu_si512((const void *)(q + (size_t)r * K + 64 * k));
            p[r][k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv, x);
            if (type == COLIBRI_Q6_K) /* (level + 32) q - 32 q, per 4 values */
                p[r][k] = _mm512_sub_epi32(
                    p[r][k], _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(32), x));
        }
    }
    for (r = 0; r < nb; r++) {
        __m512i *v = p[r];
        __m512i t0 =
            _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
        __m512i t1 =
            _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
        __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
        __m512i a, c;
        if (type == COLIBRI_Q6_K) {
            const __m128i order =
                _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
            u = _mm512_mullo_epi32(u, _mm512_cvtepi8_epi32(_mm_shuffle_epi8(
                                          _mm_loadu_si128((const __m128i *)(b0 + 192)), order)));
        }
        a = _mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), u);
        c = _mm512_permutexvar_epi32(
            _mm512_setr_epi32(4, 12, 5, 13, 6, 14, 7, 15, 0, 0, 0, 0, 0, 0, 0, 0), u);
        total[r] = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_castsi512_si256(c));
        if (offset)
            total[r] = _mm256_sub_epi32(
                total[r],
                _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(s + (size_t)r * G)), 7));
    }
}

/* colibri_q_lanes_sum in the vector: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE float colibri_q_lanes_sum_avx2(__m256 a)
{
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

/* The 4 bytes at p, as stored. */
static inline int colibri_q_u32(const uint8_t *p)
{
    int v;
    memcpy(&v, p, 4);
    return v;
}

/* The first 4 bytes of each of eight consecutive blocks of `bytes` bytes from b, by one
 * gather (gather: fast on AVX-512 CPUs) or by eight loads (microcoded gathers stall Zen 1-3's
 * front end: the AVX2 path's Q4_0 and Q8_0 dots ran 20% slower with it on a Zen 3). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256i colibri_q_first4(const uint8_t *b, int32_t bytes,
                                                                int gather)
{
    __m128i lo, hi;
    int32_t i;
    if (gather)
        return _mm256_i32gather_epi32(
            (const int *)b,
            _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bytes)),
            1);
    lo = _mm_cvtsi32_si128(colibri_q_u32(b));
    hi = _mm_cvtsi32_si128(colibri_q_u32(b + 4 * (size_t)bytes));
    _Pragma("GCC unroll 3") for (i = 1; i < 4; i++)
    {
        lo = _mm_insert_epi32(lo, colibri_q_u32(b + i * (size_t)bytes), i);
        hi = _mm_insert_epi32(hi, colibri_q_u32(b + (i + 4) * (size_t)bytes), i);
    }
    return _mm256_set_m128i(hi, lo);
}

/* colibri_e8m0_half of eight e8m0 bytes (as int32): e < 2 ? 0x00200000 << e : (e - 1) << 23 */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE __m256 colibri_q_e8m0_half8(__m256i e)
{
    __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    __m256i large = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    return _mm256_castsi256_ps(
        _mm256_blendv_epi8(small, large, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
}

/* Eight consecutive sub-blocks' scales and mins (colibri_q_scale's values), from g on (e: the
 * row's scales, for COLIBRI_MXFP4_OSS; gather: colibri_q_first4's). */
COLIBRI_Q_AVX2 static COLIBRI_Q_INLINE void colibri_q_scales8(int type, const uint8_t *w,
                                                              const uint8_t *e, int32_t g,
                                                              int gather, __m256 *scale,
                                                              __m256 *min)
{
    const int32_t bytes = colibri_q_bytes[type];
    const uint8_t *b = w + (size_t)(g / (colibri_q_block[type] / 32)) * (size_t)bytes;
    const __m256i k = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    *min = _mm256_setzero_ps();
    switch (type) {
    case COLIBRI_Q8_0:
    case COLIBRI_Q4_0: { /* eight blocks' float16 scales: F16C */
        __m256i h = _mm256_and_si256(colibri_q_first4(b, bytes, gather), _mm256_set1_epi32(0xffff));
        __m128i h16 = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        *scale = _mm256_cvtph_ps(h16);
        return;
    }
    case COLIBRI_MXFP4:
        *scale = colibri_q_e8m0_half8(
            _mm256_and_si256(colibri_q_first4(b, bytes, gather), _mm256_set1_epi32(0xff)));
        return;
    case COLIBRI_MXFP4_OSS: { /* colibri_e8m0_oss: 0xFF gives NaN */
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(e + g)));
        __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, _mm256_set1_epi32(0xff)));
        *scale = _mm256_blendv_ps(colibri_q_e8m0_half8(v),
                                  _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
        return;
    }
    case COLIBRI_Q4_K:
    case COLIBRI_Q5_K: { /* the 12 packed bytes (v0, v1, v2) -> 8 scales and 8 mins of 6 bits */
        uint32_t dm;
        __m128i v = _mm_loadu_si128((const __m128i *)(b + 4)), lo, hi;
        __m128 f;
        memcpy(&dm, b, 4);
        f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm)); /* d, dmin */
        /* sc 0..3 = v0 & 63, sc 4..7 = (v2 & 15) | (v0 >> 6) << 4, m 0..3 = v1 & 63,
         * m 4..7 = (v2 >> 4) | (v1 >> 6) << 4, bytewise */
        lo = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)),
                            _mm_setr_epi32(0, 0, 0, 4));
        lo = _mm_and_si128(lo, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
        hi = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2);
        hi = _mm_and_si128(hi, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
        lo = _mm_or_si128(lo, hi);
        *scale =
            _mm256_mul_ps(_mm256_broadcastss_ps(f), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
        *min = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(f)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
        return;
    }
    case COLIBRI_Q6_K:
        *scale = _mm256_set1_ps(colibri_q_f16_x86(b + 208));
        return;
    default: { /* COLIBRI_IQ4_XS: sub-block k's nibble of b[4..7], its 2 bits of b[2..3] */
        uint32_t low;
        __m256i ls;
        memcpy(&low, b + 4, 4);
        ls = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32((int)low), _mm256_slli_epi32(k, 2)),
            _mm256_set1_epi32(15));
        ls = _mm256_or_si256(
            ls, _mm256_slli_epi32(
                    _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b[2] | (b[3] << 8)),
                                                       _mm256_add_epi32(k, k)),
                                     _mm256_set1_epi32(3)),
                    4));
        *scale = _mm256_mul_ps(_mm256_set1_ps(colibri_q_f16_x86(b)),
                               _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
        return;
    }
    }
}

/* Bytes ahead of the weights in use that the loops prefetch (the rows' streams run on past
 * a row's end into the next row of the same matrix). With `stream` (colibri_q_dot_rows: on
 * CPUs whose path is AVX2), weights read once are fetched non-temporal: on a Zen 3 such
 * lines skip L2 and so the L3 behind it, which then keeps the caller's own working set (the
 * interpreter, the activations) between the kernels, 7-15% a decoded token; on a Zen 4
 * the hint slowed the AVX-512 kernels by half, yet the AVX2 path (Zen 4's default,
 * colibri_cpu_halves512) keeps it: whole Q4_0 / Q8_0 tokens ran faster with it in 3 of 4
 * interleaved pairs each (6.3-8.6 against 6.7-9.4 ms). */
#ifndef COLIBRI_Q_PREFETCH
#define COLIBRI_Q_PREFETCH 2048
#endif
#define COLIBRI_Q_FETCH(p, stream)                         \
    do {                                                   \
        if (stream)                                        \
            _mm_prefetch((const char *)(p), _MM_HINT_NTA); \
        else                                               \
            _mm_prefetch((const char *)(p), _MM_HINT_T0);  \
    } while (0)

/* The typed body over `rows` weight rows, the type, and for one q8 row the row count, as
 * constants. */
#define COLIBRI_Q_TYPED(name, T)                                                   \
    do {                                                                           \
        int32_t o;                                                                 \
        for (o = 0; o < rows; o++) {                                               \
            const uint8_t *wo = w + o * ldw, *eo = e ? e + o * lde : NULL;         \
            if (nb == 1)                                                           \
                name##_typed(T, wo, eo, K, d, q, s, 1, y + o * ldo, ldy, stream);  \
            else                                                                   \
                name##_typed(T, wo, eo, K, d, q, s, nb, y + o * ldo, ldy, stream); \
        }                                                                          \
        return;                                                                    \
    } while (0)

/* The body of both x86 paths: TOTALS8 gives eight sub-blocks' integer dots; GATHER how the
 * scales are read (colibri_q_first4). */
#define COLIBRI_Q_DOT_X86(name, target, TOTALS8, GATHER)                                           \
    target static COLIBRI_Q_INLINE void name##_typed(                                              \
        int type, const uint8_t *w, const uint8_t *e, int32_t K, const float *d, const int8_t *q,  \
        const int32_t *s, int32_t nb, float *y, int64_t ldy, int stream)                           \
    {                                                                                              \
        const int32_t subs = colibri_q_block[type] / 32, G = K / 32, G8 = G & ~7;                  \
        __m256 acc[COLIBRI_Q_ROW_BLOCK];                                                           \
        float lanes[COLIBRI_Q_ROW_BLOCK][COLIBRI_Q_LANES];                                         \
        int8_t lv8[32];                                                                            \
        int32_t g, r;                                                                              \
        for (r = 0; r < nb; r++)                                                                   \
            acc[r] = _mm256_setzero_ps();                                                          \
        for (g = 0; g < G8; g += 8) {                                                              \
            __m256i totals[COLIBRI_Q_ROW_BLOCK];                                                   \
            __m256 vs, vm;                                                                         \
            /* 8 blocks of 32 values, or sub-blocks 0..7 of one block of 256 */                    \
            const uint8_t *b0 = w + (size_t)(g / subs) * (size_t)colibri_q_bytes[type];            \
            int32_t at;                                                                            \
            for (at = 0; at < 8 / subs * colibri_q_bytes[type]; at += 64)                          \
                COLIBRI_Q_FETCH(b0 + COLIBRI_Q_PREFETCH + at, stream);                             \
            TOTALS8(type, b0, q + 32 * g, K, s + g, G, nb, totals);                                \
            colibri_q_scales8(type, w, e, g, GATHER, &vs, &vm);                                    \
            for (r = 0; r < nb; r++) {                                                             \
                __m256 xd = _mm256_loadu_ps(d + (size_t)r * G + g);                                \
                __m256i total = totals[r];                                                         \
                __m256 isum;                                                                       \
                if (type == COLIBRI_Q4_0) /* sum (nibble - 8) q = sum nibble q - 8 sum q */        \
                    total = _mm256_sub_epi32(                                                      \
                        total,                                                                     \
                        _mm256_slli_epi32(                                                         \
                            _mm256_loadu_si256((const __m256i *)(s + (size_t)r * G + g)), 3));     \
                isum = _mm256_cvtepi32_ps(total);                                                  \
                __m256 term = _mm256_mul_ps(_mm256_mul_ps(vs, xd), isum);                          \
                if (COLIBRI_Q_HAS_MIN(type)) {                                                     \
                    __m256 xs = _mm256_cvtepi32_ps(                                                \
                        _mm256_loadu_si256((const __m256i *)(s + (size_t)r * G + g)));             \
                    term = _mm256_sub_ps(term, _mm256_mul_ps(_mm256_mul_ps(vm, xd), xs));          \
                }                                                                                  \
                acc[r] = _mm256_add_ps(acc[r], term);                                              \
            }                                                                                      \
        }                                                                                          \
        if (G8 == G) { /* no tail: the lanes summed in their vector */                             \
            for (r = 0; r < nb; r++)                                                               \
                y[r * ldy] = colibri_q_lanes_sum_avx2(acc[r]);                                     \
            return;                                                                                \
        }                                                                                          \
        for (r = 0; r < nb; r++)                                                                   \
            _mm256_storeu_ps(lanes[r], acc[r]);                                                    \
        for (; g < G; g++) { /* 32-value types whose rows are not whole groups of 8 blocks */      \
            const uint8_t *b = w + (size_t)(g / subs) * (size_t)colibri_q_bytes[type];             \
            colibri_q_unpack(type, b, g % subs, lv8);                                              \
            for (r = 0; r < nb; r++) {                                                             \
                int32_t isum = colibri_q_isum(type, b, g % subs, lv8, q + (size_t)r * K + 32 * g); \
                lanes[r][g % COLIBRI_Q_LANES] +=                                                   \
                    colibri_q_term(type, colibri_q_scale_at(type, w, e, g / subs), g % subs, isum, \
                                   d[r * G + g], s[r * G + g]);                                    \
            }                                                                                      \
        }                                                                                          \
        for (r = 0; r < nb; r++)                                                                   \
            y[r * ldy] = colibri_q_lanes_sum(lanes[r]);                                            \
    }                                                                                              \
    /* one copy of the body per type, the type a constant in each, looped over the rows */         \
    target static void name(int type, const uint8_t *w, int64_t ldw, const uint8_t *e,             \
                            int64_t lde, int32_t rows, int32_t K, const float *d, const int8_t *q, \
                            const int32_t *s, int32_t nb, float *y, int64_t ldo, int64_t ldy,      \
                            int stream)                                                            \
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
        case COLIBRI_MXFP4_OSS:                                                                    \
            COLIBRI_Q_TYPED(name, COLIBRI_MXFP4_OSS);                                              \
        default:                                                                                   \
            COLIBRI_Q_TYPED(name, COLIBRI_MXFP4);                                                  \
        }                                                                                          \
    }

/* colibri_q_dot_rows for COLIBRI_Q4_0X8 (rows a multiple of 8, w a group's start), on AVX2:
 * per block of a group, 4 loads of 32 bytes give the eight rows' 32 nibbles (one int32 lane
 * a row), unpacked once for the nb q8 rows, each multiplied with the q8 values broadcast 4 at
 * a time; the sums of 8 maddubs stay in int16 (|sum| <= 8 x 2 x 15 x 128 < 2^15). Each row's
 * block term lands in accumulator i % 8 (its lane) in block order, and the accumulators are
 * summed as colibri_q_lanes_sum does: colibri_q_dot_scalar's bits. */
COLIBRI_Q_AVX2 static void colibri_q4_0x8_dot_avx2(const uint8_t *w, int64_t ldw, int32_t rows,
                                                   int32_t K, const float *d, const int8_t *q,
                                                   const int32_t *s, int32_t nb, float *y,
                                                   int64_t ldo, int64_t ldy, int stream)
{
    const int32_t G = K / 32;
    const __m256i m = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    int32_t o, i, j, l, v, r;
    for (o = 0; o + 8 <= rows; o += 8) {
        const uint8_t *g = w + (size_t)o * (size_t)ldw;
        __m256 acc[COLIBRI_Q_ROW_BLOCK][8];
        for (r = 0; r < nb; r++)
            for (l = 0; l < 8; l++)
                acc[r][l] = _mm256_setzero_ps();
        for (i = 0; i < G; i++) {
            const uint8_t *b = g + (size_t)i * 144;
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
            __m256i lo[4], hi[4];
            for (j = 0; j < 144; j += 64) /* streamed when read once, not for more q8 rows */
                COLIBRI_Q_FETCH(b + COLIBRI_Q_PREFETCH + j, stream && nb == 1);
            for (v = 0; v < 4; v++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * v));
                lo[v] = _mm256_and_si256(wv, m);
                hi[v] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m);
            }
            for (r = 0; r < nb; r++) {
                const uint8_t *x = (const uint8_t *)(q + (size_t)r * K) + 32 * i;
                __m256i t = _mm256_setzero_si256();
                for (v = 0; v < 4; v++) {
                    const __m256i xl = _mm256_set1_epi32(colibri_q_u32(x + 4 * v));
                    const __m256i xh = _mm256_set1_epi32(colibri_q_u32(x + 16 + 4 * v));
                    t = _mm256_add_epi16(t, _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], xl),
                                                             _mm256_maddubs_epi16(hi[v], xh)));
                }
                /* sum (nibble - 8) q = sum nibble q - 8 sum q */
                t = _mm256_sub_epi32(_mm256_madd_epi16(t, ones),
                                     _mm256_set1_epi32(s[(size_t)r * G + i] * 8));
                acc[r][i % 8] = _mm256_add_ps(
                    acc[r][i % 8],
                    _mm256_mul_ps(_mm256_mul_ps(scale, _mm256_set1_ps(d[(size_t)r * G + i])),
                                  _mm256_cvtepi32_ps(t)));
            }
        }
        for (r = 0; r < nb; r++) {
            const __m256 *a = acc[r];
            float out[8];
            _mm256_storeu_ps(
                out,
                _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6])),
                              _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]))));
            for (l = 0; l < 8; l++)
                y[(o + l) * ldo + r * ldy] = out[l];
        }
    }
}

COLIBRI_Q_DOT_X86(colibri_q_dot_avx2, COLIBRI_Q_AVX2, colibri_q_totals8_avx2, 0)
COLIBRI_Q_DOT_X86(colibri_q_dot_vnni, COLIBRI_Q_VNNI, colibri_q_totals8_vnni, 1)

#endif /* COLIBRI_QUANT_X86_H */
