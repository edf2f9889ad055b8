/*
 * colibri's gated-FFN expert kernel for quantized weights (colibri/quant.h), for a few rows:
 *
 *     y[r] = down @ (act(gate @ x[r]) * (up @ x[r]))      r < n (1 to ~16 rows)
 *
 * gate, up: I rows of H values, down: H rows of I values, each row whole blocks of one
 * quantized type as stored (any row stride, in bytes). x arrives as q8 rows (colibri_q8_row),
 * quantized once per layer and shared by every expert of the layer; h = act(gate x) * (up x)
 * is quantized the same way, 32 values at a time, by the chunk that computes them. Two
 * passes over chunks of output rows (colibri/pool.h runs them on the caller and its
 * helpers): gate and up (the activation fused), then down. Every path gives the same bits
 * (colibri/quant.h's summation order), whatever the threads.
 *
 * gpt-oss's experts (act COLIBRI_QFFN_ACT_GPT_OSS, weights COLIBRI_MXFP4_OSS): gate and up
 * are the even and odd rows of one gate_up matrix (ldg = ldu = two rows; their scales' rows
 * likewise), with biases, and the clamped SwiGLU
 *
 *     g = min(gate x + bg, limit), u = clamp(up x + bu, -limit, limit)
 *     h = (u + 1) * g * sigmoid(alpha * g),   y = down h + bd
 *
 * x's and h's q8 rows are in colibri_q8_oss_order's order.
 */
#ifndef COLIBRI_QFFN_H
#define COLIBRI_QFFN_H

#include <stddef.h>
#include <stdint.h>

#include "colibri/ffn.h"
#include "colibri/pool.h"
#include "colibri/quant.h"

typedef struct {
    int32_t n, H, I;   /* rows (<= COLIBRI_FFN_MAX_ROWS), hidden size, intermediate size */
    int32_t type;      /* gate's and up's COLIBRI_Q8_0 ... (colibri/quant.h) */
    int32_t down_type; /* down's (GGUF files mix them: Q4_K gate and up, Q6_K down) */
    int32_t act;       /* COLIBRI_ACT_* */
    int32_t path;      /* COLIBRI_PATH_* (one this CPU runs) */
    const float *xd;   /* q8 of x: d [n, H / 32], q [n, H], s [n, H / 32], rows contiguous */
    const int8_t *xq;
    const int32_t *xs;
    const uint8_t *gate, *up; /* I rows of H values; row strides ldg, ldu in bytes */
    int64_t ldg, ldu;
    const uint8_t *down; /* H rows of I values; row stride ldd in bytes */
    int64_t ldd;
    float *h;  /* scratch [n, I] */
    float *hd; /* scratch: q8 of h, d [n, I / 32], q [n, I], s [n, I / 32] */
    int8_t *hq;
    int32_t *hs;
    float *y; /* [n, H], row stride ldy */
    int64_t ldy;
    /* COLIBRI_MXFP4_OSS only: gate's, up's and down's e8m0 scales, row strides in bytes */
    const uint8_t *ge, *ue, *de;
    int64_t lge, lue, lde;
    /* COLIBRI_QFFN_ACT_GPT_OSS only: gate's and up's biases (float32 [I], stride ldb), down's
     * [H], the SwiGLU's alpha and limit */
    const float *bg, *bu, *bd;
    int64_t ldb;
    float alpha, limit;
    /* set by colibri_qffn_run_many: output rows of one chunk of the pool, in each pass */
    int32_t gate_up_rows, down_rows;
} colibri_qffn_t;

/* act: gpt-oss's clamped SwiGLU with biases (a number past ffn.h's COLIBRI_ACT_*). */
#define COLIBRI_QFFN_ACT_GPT_OSS 16

/* Output rows gate/up computes at a time: whole blocks of h's q8 rows. */
#define COLIBRI_QFFN_CHUNK 32

/* y[o * ldo + r * ldy] = w_o . x_r for o < rows (w_o = w + o * ldw bytes, its scales
 * e + o * lde for COLIBRI_MXFP4_OSS) and r < n, the q8 rows x (d, q, s) of K values, 4 q8
 * rows at a time. */
static inline void colibri_qffn_dot(const colibri_qffn_t *f, int type, const uint8_t *w,
                                    int64_t ldw, const uint8_t *e, int64_t lde, int32_t rows,
                                    int32_t K, const float *d, const int8_t *q, const int32_t *s,
                                    float *y, int64_t ldo, int64_t ldy)
{
    const int32_t G = K / 32;
    int32_t r;
    for (r = 0; r < f->n; r += COLIBRI_Q_ROW_BLOCK) {
        int32_t nb = f->n - r < COLIBRI_Q_ROW_BLOCK ? f->n - r : COLIBRI_Q_ROW_BLOCK;
        colibri_q_dot_rows(f->path, type, w, ldw, e, lde, rows, K, d + (size_t)r * G,
                           q + (size_t)r * K, s + (size_t)r * G, nb, y + r * ldy, ldo, ldy);
    }
}

/* h[:, o0:o1] = act(gate x) * (up x), then its q8 blocks (o0, o1 multiples of 32, o1 - o0 <=
 * COLIBRI_QFFN_CHUNK): gate's rows into h, up's into a buffer, then combined. */
static inline void colibri_qffn_gate_up(const colibri_qffn_t *f, int32_t o0, int32_t o1)
{
    const int32_t n = f->n, H = f->H, I = f->I;
    float u[COLIBRI_FFN_MAX_ROWS * COLIBRI_QFFN_CHUNK];
    int32_t o, r;
    const int oss = f->type == COLIBRI_MXFP4_OSS;
    colibri_qffn_dot(f, f->type, f->gate + o0 * f->ldg, f->ldg, oss ? f->ge + o0 * f->lge : NULL,
                     f->lge, o1 - o0, H, f->xd, f->xq, f->xs, f->h + o0, 1, I);
    colibri_qffn_dot(f, f->type, f->up + o0 * f->ldu, f->ldu, oss ? f->ue + o0 * f->lue : NULL,
                     f->lue, o1 - o0, H, f->xd, f->xq, f->xs, u, 1, COLIBRI_QFFN_CHUNK);
    for (r = 0; r < n; r++)
        for (o = o0; o < o1; o++) {
            float *h = f->h + r * (int64_t)I + o, up = u[r * COLIBRI_QFFN_CHUNK + o - o0];
            if (f->act == COLIBRI_QFFN_ACT_GPT_OSS) { /* NaN stays NaN, as torch's clamp */
                const float lim = f->limit, g0 = *h + f->bg[o * f->ldb];
                const float g = g0 > lim ? lim : g0;
                up += f->bu[o * f->ldb];
                up = up > lim ? lim : (up < -lim ? -lim : up);
                *h = (up + 1.0f) * (g / (1.0f + expf(-f->alpha * g)));
            } else
                *h = colibri_act(f->act, *h) * up;
        }
    for (r = 0; r < n; r++) {
        int8_t *hq = f->hq + r * (int64_t)I + o0;
        colibri_q8_row(f->h + r * (int64_t)I + o0, o1 - o0, f->hd + r * (int64_t)(I / 32) + o0 / 32,
                       hq, f->hs + r * (int64_t)(I / 32) + o0 / 32);
        if (f->down_type == COLIBRI_MXFP4_OSS)
            colibri_q8_oss_order(hq, o1 - o0);
    }
}

/* y[:, o] = down[o] . h for o in [o0, o1). */
static inline void colibri_qffn_down(const colibri_qffn_t *f, int32_t o0, int32_t o1)
{
    int32_t r, o;
    colibri_qffn_dot(f, f->down_type, f->down + o0 * f->ldd, f->ldd,
                     f->down_type == COLIBRI_MXFP4_OSS ? f->de + o0 * f->lde : NULL, f->lde,
                     o1 - o0, f->I, f->hd, f->hq, f->hs, f->y + o0, 1, f->ldy);
    if (f->act == COLIBRI_QFFN_ACT_GPT_OSS)
        for (r = 0; r < f->n; r++)
            for (o = o0; o < o1; o++)
                f->y[r * f->ldy + o] += f->bd[o];
}

static void colibri_qffn_gate_up_chunk(void *arg, int32_t c)
{
    const colibri_qffn_t *f = (const colibri_qffn_t *)arg;
    const int32_t rows = f->gate_up_rows;
    const int32_t end = (int64_t)(c + 1) * rows < f->I ? (c + 1) * rows : f->I;
    int32_t o;
    for (o = c * rows; o < end; o += COLIBRI_QFFN_CHUNK)
        colibri_qffn_gate_up(f, o, o + COLIBRI_QFFN_CHUNK < end ? o + COLIBRI_QFFN_CHUNK : end);
}

static void colibri_qffn_down_chunk(void *arg, int32_t c)
{
    const colibri_qffn_t *f = (const colibri_qffn_t *)arg;
    const int32_t rows = f->down_rows;
    colibri_qffn_down(f, c * rows, (int64_t)(c + 1) * rows < f->H ? (c + 1) * rows : f->H);
}

/* Several experts' FFNs (same layer: same x) in two pool runs, their chunks in one index
 * space; first must hold count + 1 entries (scratch). Sets each f[j]'s chunk rows. */
static inline void colibri_qffn_run_many(colibri_qffn_t *f, int32_t count, int32_t *first,
                                         int threads)
{
    int32_t j;
    int64_t gate_up = 0, down = 0;
    if (count < 1)
        return;
    for (j = 0; j < count; j++) {
        gate_up += 2 * (int64_t)f[j].I * colibri_q_row_bytes(f[j].type, f[j].H);
        down += (int64_t)f[j].H * colibri_q_row_bytes(f[j].down_type, f[j].I);
    }
    first[0] = 0;
    for (j = 0; j < count; j++) {
        f[j].gate_up_rows =
            colibri_pool_chunk_rows(colibri_pool_chunk_bytes(gate_up, threads),
                                    2 * colibri_q_row_bytes(f[j].type, f[j].H), COLIBRI_QFFN_CHUNK);
        first[j + 1] = first[j] + (f[j].I + f[j].gate_up_rows - 1) / f[j].gate_up_rows;
    }
    colibri_pool_run_many(colibri_qffn_gate_up_chunk, f, sizeof *f, count, first, threads);
    first[0] = 0;
    for (j = 0; j < count; j++) {
        f[j].down_rows = colibri_pool_chunk_rows(colibri_pool_chunk_bytes(down, threads),
                                                 colibri_q_row_bytes(f[j].down_type, f[j].I), 8);
        first[j + 1] = first[j] + (f[j].H + f[j].down_rows - 1) / f[j].down_rows;
    }
    colibri_pool_run_many(colibri_qffn_down_chunk, f, sizeof *f, count, first, threads);
}

#endif /* COLIBRI_QFFN_H */
