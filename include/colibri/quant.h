/*
 * colibri's quantized weights: the block formats of GGUF files (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K,
 * IQ4_XS, MXFP4) read as stored, dequantized exactly, and multiplied against activations
 * quantized to int8 blocks of 32 (q8 rows), for the gated-FFN expert kernel.
 *
 * A weight row of K values is K / block(type) blocks of bytes(type) bytes, as GGUF stores it.
 * An activation row of K floats becomes a q8 row: per block of 32, a float scale d
 * (max |x| / 127), 32 int8 values round(x / d) (ties away from zero) and their int32 sum (the min terms of Q4_K and
 * Q5_K use it). The product of a weight row and a q8 row is, per block of 32, an integer dot
 * product (exact in int32 and in float) times the block's float scales; the blocks' terms are
 * summed into 8 float lanes, block j into lane j % 8, in block order, and the lanes are
 * reduced as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). Every SIMD path computes
 * the same integers and sums the terms in this order: every path gives the same bits.
 *
 * The scalar path is the contract, written here; the SIMD paths only compute the per-block
 * integer sums faster. Plain C99, header-only.
 *
 * COLIBRI_MXFP4_OSS is MXFP4 as gpt-oss stores it: a block is 16 bytes of e2m1 pairs, value
 * 2i in byte i's low nibble and 2i + 1 in its high one, and the e8m0 scales are a separate
 * array (one byte a block, `e`). The kernels read a block as MXFP4's (value i low, i + 16
 * high) and take the q8 activations in the matching order (colibri_q8_oss_order: a block's
 * even values, then its odd ones): the same integer dot products, one kernel for both. An
 * e8m0 scale byte 0xFF (NaN in the OCP MX format) gives NaN.
 */
#ifndef COLIBRI_QUANT_H
#define COLIBRI_QUANT_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "colibri/cpu.h"
#include "colibri/half.h"

/* Block formats (GGUF's names; the numbers are colibri's, not ggml's type ids). */
enum {
    COLIBRI_Q8_0 = 0,
    COLIBRI_Q4_0 = 1,
    COLIBRI_Q4_K = 2,
    COLIBRI_Q5_K = 3,
    COLIBRI_Q6_K = 4,
    COLIBRI_IQ4_XS = 5,
    COLIBRI_MXFP4 = 6,
    COLIBRI_MXFP4_OSS = 7, /* gpt-oss's MXFP4: values interleaved, scales apart (see above) */
    COLIBRI_Q4_0X8 = 8,    /* Q4_0 rows interleaved by eight (colibri's layout, see below) */
    COLIBRI_Q_COUNT = 9
};

/* Whether a type is MXFP4 (its levels e2m1, doubled), as GGUF or as gpt-oss stores it. */
#define COLIBRI_Q_E2M1(type) ((type) == COLIBRI_MXFP4 || (type) == COLIBRI_MXFP4_OSS)

/* Values per block, and bytes per block, of each format. */
static const int32_t colibri_q_block[COLIBRI_Q_COUNT] = {32, 32, 256, 256, 256, 256, 32, 32, 32};
static const int32_t colibri_q_bytes[COLIBRI_Q_COUNT] = {34, 18, 144, 176, 210, 136, 17, 16, 18};

/* Bytes of one row of K values of `type` (K a multiple of its block). */
static inline int64_t colibri_q_row_bytes(int32_t type, int32_t K)
{
    return (int64_t)(K / colibri_q_block[type]) * colibri_q_bytes[type];
}

/* The q8 activations' block, and the lanes the blocks' terms are summed in. */
#define COLIBRI_Q8_BLOCK 32
#define COLIBRI_Q_LANES 8

/* IQ4_NL's 16 levels (IQ4_XS's values), and MXFP4's e2m1 levels doubled. */
static const int8_t colibri_iq4_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                              1,    13,   25,  38,  53,  69,  89,  113};
static const int8_t colibri_mxfp4_levels[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                                0, -1, -2, -3, -4, -6, -8, -12};

static inline float colibri_q_f16(const uint8_t *p)
{
    return colibri_half_to_float((uint16_t)(p[0] | (p[1] << 8)));
}

/* MXFP4's E8M0 scale, halved (its levels are doubled): 2^(e - 128), exact. */
static inline float colibri_e8m0_half(uint8_t e)
{
    return colibri_bits_to_float(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

/* gpt-oss's e8m0 scale, halved: colibri_e8m0_half's, NaN for 0xFF (the OCP MX format's NaN). */
static inline float colibri_e8m0_oss(uint8_t e)
{
    return e == 0xFF ? colibri_bits_to_float(0x7FC00000u) : colibri_e8m0_half(e);
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes. */
static inline void colibri_q_k_scale_min(const uint8_t *s, int j, int32_t *sc, int32_t *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- the integer value of element e of one block, and a block's dequantization ------- */

/* Q4_K / Q5_K / Q6_K / IQ4_XS sub-block j (of 32) element l's integer level. */
static inline int32_t colibri_q_level(int type, const uint8_t *b, int32_t j, int32_t l)
{
    switch (type) {
    case COLIBRI_Q8_0:
        return (int8_t)b[2 + l];
    case COLIBRI_Q4_0:
        return ((b[2 + (l & 15)] >> ((l >> 4) << 2)) & 15) - 8;
    case COLIBRI_MXFP4:
        return colibri_mxfp4_levels[(b[1 + (l & 15)] >> ((l >> 4) << 2)) & 15];
    case COLIBRI_MXFP4_OSS: /* MXFP4's order over the q8 values colibri_q8_oss_order gives */
        return colibri_mxfp4_levels[(b[l & 15] >> ((l >> 4) << 2)) & 15];
    case COLIBRI_Q4_K:
        return (b[16 + 32 * (j >> 1) + l] >> ((j & 1) << 2)) & 15;
    case COLIBRI_Q5_K:
        return ((b[48 + 32 * (j >> 1) + l] >> ((j & 1) << 2)) & 15) | (((b[16 + l] >> j) & 1) << 4);
    case COLIBRI_Q6_K: {
        int32_t e = 32 * j + l, h = e >> 7, r = e & 127;
        int32_t lo = (b[64 * h + (r & 63)] >> ((r >> 6) << 2)) & 15;
        int32_t hi = (b[128 + 32 * h + (r & 31)] >> ((r >> 5) << 1)) & 3;
        return (lo | (hi << 4)) - 32;
    }
    default: /* COLIBRI_IQ4_XS */
        return colibri_iq4_levels[(b[8 + 16 * j + (l & 15)] >> ((l >> 4) << 2)) & 15];
    }
}

/* Whether a type's values have a min taken off (value = scale * level - min). */
#define COLIBRI_Q_HAS_MIN(type) ((type) == COLIBRI_Q4_K || (type) == COLIBRI_Q5_K)

/* Sub-block j's float scale (and, for Q4_K / Q5_K, its min), as GGUF's dequantization
 * forms them: value = scale * level - min. Q6_K's scale is per 16: here, of half `half`.
 * COLIBRI_MXFP4_OSS: b is the block's scale byte (in the separate array). */
static inline float colibri_q_scale(int type, const uint8_t *b, int32_t j, int half, float *min)
{
    int32_t sc, m;
    *min = 0.0f;
    switch (type) {
    case COLIBRI_Q8_0:
    case COLIBRI_Q4_0:
        return colibri_q_f16(b);
    case COLIBRI_MXFP4:
        return colibri_e8m0_half(b[0]);
    case COLIBRI_MXFP4_OSS:
        return colibri_e8m0_oss(b[0]);
    case COLIBRI_Q4_K:
    case COLIBRI_Q5_K:
        colibri_q_k_scale_min(b + 4, j, &sc, &m);
        *min = colibri_q_f16(b + 2) * (float)m;
        return colibri_q_f16(b) * (float)sc;
    case COLIBRI_Q6_K:
        return colibri_q_f16(b + 208) * (float)(int8_t)b[192 + 2 * j + half];
    default: { /* COLIBRI_IQ4_XS */
        uint32_t high = (uint32_t)(b[2] | (b[3] << 8));
        int32_t ls = ((b[4 + (j >> 1)] >> ((j & 1) << 2)) & 15) | (((high >> (2 * j)) & 3) << 4);
        return colibri_q_f16(b) * (float)(ls - 32);
    }
    }
}

/* Weight sub-block j (of 32) of block b -> its 32 integer levels (all fit int8). */
static inline void colibri_q_unpack(int type, const uint8_t *b, int32_t j, int8_t *lv)
{
    int32_t l;
    for (l = 0; l < 32; l++)
        lv[l] = (int8_t)colibri_q_level(type, b, j, l);
}

/* One block of `type` at b -> block(type) floats, the values GGUF's dequantization gives
 * (not COLIBRI_MXFP4_OSS, whose scale is apart). */
static inline void colibri_q_dequantize_block(int type, const uint8_t *b, float *out)
{
    int32_t subs = colibri_q_block[type] / 32, j, l;
    int8_t lv[32];
    for (j = 0; j < subs; j++) {
        float min, min1, scale[2];
        scale[0] = colibri_q_scale(type, b, j, 0, &min);
        scale[1] = colibri_q_scale(type, b, j, 1, &min1);
        colibri_q_unpack(type, b, j, lv);
        for (l = 0; l < 32; l++)
            out[32 * j + l] = scale[l >> 4] * (float)lv[l] - min;
    }
}

/* ---- q8 activations -------------------------------------------------------------------- */

/* x [K] (K a multiple of 32) -> d [K / 32], q [K], s [K / 32]. A block holding inf or NaN
 * gets q = 0 and d = its max |x| (inf or NaN), so its terms are NaN, as a float product's. */
static inline void colibri_q8_row(const float *x, int32_t K, float *d, int8_t *q, int32_t *s)
{
    int32_t j, l;
    for (j = 0; j < K / 32; j++) {
        const float *xb = x + 32 * j;
        float amax = 0.0f;
        int32_t sum = 0, finite;
        for (l = 0; l < 32; l++) {
            float a = fabsf(xb[l]);
            amax = (a > amax || a != a) ? a : amax;
        }
        d[j] = amax / 127.0f;
        finite = d[j] > 0.0f && d[j] <= 3.4e38f; /* |x / d| <= 127: no overflow */
        for (l = 0; l < 32; l++) {
            int32_t v = finite ? (int32_t)roundf(xb[l] / d[j]) : 0;
            q[32 * j + l] = (int8_t)v;
            sum += v;
        }
        s[j] = sum;
    }
}

/* A q8 row's values q [K] -> the order COLIBRI_MXFP4_OSS weights take: in each block of 32,
 * the even values, then the odd ones (d and s are unchanged). */
static inline void colibri_q8_oss_order(int8_t *q, int32_t K)
{
    int8_t t[32];
    int32_t j, i;
    for (j = 0; j < K; j += 32) {
        for (i = 0; i < 16; i++) {
            t[i] = q[j + 2 * i];
            t[16 + i] = q[j + 2 * i + 1];
        }
        memcpy(q + j, t, 32);
    }
}

/* ---- one block of 32's integer dot product and its float term ---------------------------- */

/* The integer dot of unpacked levels lv with q8 values q: sum lv * q; for Q6_K, the two
 * halves' sums times their int8 scales. Exact: |result| < 2^24, so exact in float too. */
static inline int32_t colibri_q_isum(int type, const uint8_t *b, int32_t j, const int8_t *lv,
                                     const int8_t *q)
{
    int32_t l, sum[2] = {0, 0};
    for (l = 0; l < 32; l++)
        sum[l >> 4] += lv[l] * q[l];
    if (type == COLIBRI_Q6_K)
        return (int8_t)b[192 + 2 * j] * sum[0] + (int8_t)b[192 + 2 * j + 1] * sum[1];
    return sum[0] + sum[1];
}

/* The float term of sub-block j given its integer dot `isum` and the q8 block (d, s); b: the
 * block (COLIBRI_MXFP4_OSS: its scale byte). */
static inline float colibri_q_term(int type, const uint8_t *b, int32_t j, int32_t isum, float d,
                                   int32_t s)
{
    float min, scale;
    if (type == COLIBRI_Q6_K)
        return (colibri_q_f16(b + 208) * d) * (float)isum;
    scale = colibri_q_scale(type, b, j, 0, &min);
    if (!COLIBRI_Q_HAS_MIN(type)) /* min 0: taking (0 d) s off changes no finite sum's bits */
        return (scale * d) * (float)isum;
    return (scale * d) * (float)isum - (min * d) * (float)s;
}

/* The 8 lanes' fixed reduction. */
static inline float colibri_q_lanes_sum(const float *a)
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* Most q8 rows one weight row is multiplied with at once. */
#define COLIBRI_Q_ROW_BLOCK 4

/* Rows of K values of `type` whose blocks fill about `bytes` (a chunk of a pool's work: long
 * enough that each thread streams its own weights), whole multiples of 8 (COLIBRI_Q4_0X8's
 * groups), at least 8. */
static inline int32_t colibri_q_chunk_rows(int32_t type, int32_t K, int64_t bytes)
{
    int64_t row = colibri_q_row_bytes(type, K);
    int64_t rows = (bytes / (row > 0 ? row : 1)) & ~(int64_t)7;
    return rows < 8 ? 8 : (int32_t)rows;
}

/* ---- COLIBRI_Q4_0X8: Q4_0 rows interleaved by eight ------------------------------------
 *
 * A matrix of Q4_0 rows (a multiple of 8 of them) repacked so that one vector holds eight
 * rows' values: rows 8g..8g+7 form group g, ldw bytes a row as in Q4_0 (group g starts at
 * w + 8 g ldw), and a group's block i (144 bytes at 144 i) is the eight rows' float16 scales
 * (16 bytes, row r's at 2r), then 4 x 32 bytes: vector v's 4 bytes at 4r are bytes 4v..4v+3
 * of row r's 16 bytes of nibbles. The x86 kernel multiplies a block of eight rows with one
 * int32 lane a row, the q8 values broadcast: no shuffles, no reduction across lanes, each
 * row's terms still summed in colibri_q_dot_scalar's order (the same bits as Q4_0). */

/* Row r's Q4_0 block (18 bytes, b) from its group's block gb. */
static inline void colibri_q4_0x8_block(const uint8_t *gb, int32_t r, uint8_t *b)
{
    int32_t v;
    memcpy(b, gb + 2 * r, 2);
    for (v = 0; v < 4; v++)
        memcpy(b + 2 + 4 * v, gb + 16 + 32 * v + 4 * r, 4);
}

/* Repack `rows` (a multiple of 8) Q4_0 rows of K values (w, row stride ldw bytes) into out
 * (rows x K / 32 x 18 bytes, rows contiguous). */
static inline void colibri_q4_0x8_pack(const uint8_t *w, int64_t ldw, int32_t rows, int32_t K,
                                       uint8_t *out)
{
    const int32_t G = K / 32;
    int32_t g, i, r, v;
    for (g = 0; g < rows / 8; g++)
        for (i = 0; i < G; i++) {
            uint8_t *o = out + ((size_t)g * G + i) * 144;
            for (r = 0; r < 8; r++) {
                const uint8_t *b = w + (size_t)(8 * g + r) * ldw + (size_t)i * 18;
                memcpy(o + 2 * r, b, 2);
                for (v = 0; v < 4; v++)
                    memcpy(o + 16 + 32 * v + 4 * r, b + 2 + 4 * v, 4);
            }
        }
}

/* The bytes holding the scale of block i of a row: the block itself, or for
 * COLIBRI_MXFP4_OSS byte i of the row's scales e. */
static inline const uint8_t *colibri_q_scale_at(int type, const uint8_t *w, const uint8_t *e,
                                                int32_t i)
{
    if (type == COLIBRI_MXFP4_OSS)
        return e + i;
    return w + (size_t)i * (size_t)colibri_q_bytes[type];
}

/* y[r * ldy] = w . x_r for one weight row w (K values of `type`; e: its scales for
 * COLIBRI_MXFP4_OSS, else unused) and nb <= 4 q8 rows (d + r * K / 32, q + r * K,
 * s + r * K / 32): the contract every path matches. */
static inline void colibri_q_dot_scalar(int type, const uint8_t *w, const uint8_t *e, int32_t K,
                                        const float *d, const int8_t *q, const int32_t *s,
                                        int32_t nb, float *y, int64_t ldy)
{
    float lanes[COLIBRI_Q_ROW_BLOCK][COLIBRI_Q_LANES];
    int8_t lv[32];
    const int32_t subs = colibri_q_block[type] / 32, blocks = K / colibri_q_block[type];
    const int32_t G = K / 32;
    int32_t i, j, r;
    memset(lanes, 0, sizeof lanes);
    for (i = 0; i < blocks; i++) {
        const uint8_t *b = w + (size_t)i * (size_t)colibri_q_bytes[type];
        for (j = 0; j < subs; j++) {
            int32_t g = i * subs + j;
            colibri_q_unpack(type, b, j, lv);
            for (r = 0; r < nb; r++) {
                int32_t isum = colibri_q_isum(type, b, j, lv, q + (size_t)r * K + 32 * g);
                lanes[r][g % COLIBRI_Q_LANES] += colibri_q_term(
                    type, colibri_q_scale_at(type, w, e, i), j, isum, d[r * G + g], s[r * G + g]);
            }
        }
    }
    for (r = 0; r < nb; r++)
        y[r * ldy] = colibri_q_lanes_sum(lanes[r]);
}

/* colibri_q_dot_scalar for row r of a COLIBRI_Q4_0X8 group g (its blocks unpacked). */
static inline void colibri_q4_0x8_dot_scalar(const uint8_t *g, int32_t r, int32_t K, const float *d,
                                             const int8_t *q, const int32_t *s, int32_t nb,
                                             float *y, int64_t ldy)
{
    float lanes[COLIBRI_Q_ROW_BLOCK][COLIBRI_Q_LANES];
    uint8_t b[18];
    int8_t lv[32];
    const int32_t G = K / 32;
    int32_t i, j;
    memset(lanes, 0, sizeof lanes);
    for (i = 0; i < G; i++) {
        colibri_q4_0x8_block(g + (size_t)i * 144, r, b);
        colibri_q_unpack(COLIBRI_Q4_0, b, 0, lv);
        for (j = 0; j < nb; j++)
            lanes[j][i % COLIBRI_Q_LANES] +=
                colibri_q_term(COLIBRI_Q4_0, b, 0,
                               colibri_q_isum(COLIBRI_Q4_0, b, 0, lv, q + (size_t)j * K + 32 * i),
                               d[j * G + i], s[j * G + i]);
    }
    for (j = 0; j < nb; j++)
        y[j * ldy] = colibri_q_lanes_sum(lanes[j]);
}

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include "colibri/quant/x86.h"
/* Whether COLIBRI_Q4_0X8 has its x86 kernel here: callers repack Q4_0 where it does. */
#define COLIBRI_Q4_0X8_FAST 1
#else
#define COLIBRI_Q4_0X8_FAST 0
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include "colibri/quant/neon.h"
#endif

/* y[o * ldo + r * ldy] = w_o . x_r for `rows` weight rows w_o = w + o * ldw (bytes; for
 * COLIBRI_MXFP4_OSS their scales e + o * lde, else e unused; COLIBRI_Q4_0X8: w a group's start,
 * rows a multiple of 8) and nb <= 4 q8 rows, on SIMD path
 * `path` (a COLIBRI_PATH_* this CPU runs): colibri_q_dot_scalar's bits. One call per many
 * rows: the x86 paths loop inside their target code. */
static inline void colibri_q_dot_rows(int path, int type, const uint8_t *w, int64_t ldw,
                                      const uint8_t *e, int64_t lde, int32_t rows, int32_t K,
                                      const float *d, const int8_t *q, const int32_t *s, int32_t nb,
                                      float *y, int64_t ldo, int64_t ldy)
{
    int32_t o;
#ifdef COLIBRI_QUANT_X86_H
    static int vnni = -1;
    const int stream = path == COLIBRI_PATH_AVX2; /* the prefetch hint (quant/x86.h) */
    if (type == COLIBRI_Q4_0X8 && path >= COLIBRI_PATH_AVX2 && path <= COLIBRI_PATH_AVX512_BF16) {
        colibri_q4_0x8_dot_avx2(w, ldw, rows, K, d, q, s, nb, y, ldo, ldy, stream);
        return;
    }
    if (path == COLIBRI_PATH_AVX512 || path == COLIBRI_PATH_AVX512_BF16) {
        if (vnni < 0) /* racing first calls compute the same value */
            vnni = colibri_cpu_has_avx512vnni();
        if (vnni) {
            colibri_q_dot_vnni(type, w, ldw, e, lde, rows, K, d, q, s, nb, y, ldo, ldy, stream);
            return;
        }
    }
    if (path >= COLIBRI_PATH_AVX2 && path <= COLIBRI_PATH_AVX512_BF16) {
        colibri_q_dot_avx2(type, w, ldw, e, lde, rows, K, d, q, s, nb, y, ldo, ldy, stream);
        return;
    }
#endif
    for (o = 0; o < rows; o++) {
        const uint8_t *eo = e == NULL ? NULL : e + o * lde;
        if (type == COLIBRI_Q4_0X8) {
            colibri_q4_0x8_dot_scalar(w + (o & ~7) * ldw, o & 7, K, d, q, s, nb, y + o * ldo, ldy);
            continue;
        }
#ifdef COLIBRI_QUANT_NEON_H
        if (path == COLIBRI_PATH_NEON) {
            colibri_q_dot_neon(type, w + o * ldw, eo, K, d, q, s, nb, y + o * ldo, ldy);
            continue;
        }
#endif
        colibri_q_dot_scalar(type, w + o * ldw, eo, K, d, q, s, nb, y + o * ldo, ldy);
    }
    (void)path;
}

/* colibri_q_dot_rows for one weight row of a GGUF type. */
static inline void colibri_q_dot(int path, int type, const uint8_t *w, int32_t K, const float *d,
                                 const int8_t *q, const int32_t *s, int32_t nb, float *y,
                                 int64_t ldy)
{
    colibri_q_dot_rows(path, type, w, 0, NULL, 0, 1, K, d, q, s, nb, y, 0, ldy);
}

#endif /* COLIBRI_QUANT_H */
