/*
 * colibri's linear layer for block-quantized weights (colibri/quant.h), for a few rows:
 *
 *     y[r, o] = W[o] . x[r] (+ bias[o])      r < n, o < out
 *
 * W [out, in] as stored (each row whole blocks of one type, any row stride in bytes); x
 * arrives as q8 rows (colibri_q8_row: d [n, in / 32], q [n, in], s [n, in / 32]), quantized
 * once by the caller; y [n, out] float32, bias float32 [out] or none. The twin of
 * colibri/linear.h: chunks of output rows run on colibri's pool, the weights read once
 * whatever n, each output summed by one thread in colibri/quant.h's fixed order (the bits
 * do not depend on the thread count or the SIMD path).
 */
#ifndef COLIBRI_QLINEAR_H
#define COLIBRI_QLINEAR_H

#include <stdint.h>

#include "colibri/pool.h"
#include "colibri/quant.h"

typedef struct {
    int32_t n, in_dim, out_dim; /* rows, input and output features */
    int32_t type;               /* COLIBRI_Q8_0 ... (not COLIBRI_MXFP4_OSS) */
    int32_t path;               /* COLIBRI_PATH_* (one this CPU runs) */
    int32_t rows;               /* set by colibri_qlinear_run: output rows per chunk */
    const float *xd;            /* q8 of x, rows contiguous */
    const int8_t *xq;
    const int32_t *xs;
    const uint8_t *w; /* [out] rows of in values, row stride ldw bytes */
    int64_t ldw;
    const float *bias; /* [out] or NULL */
    float *y;          /* [n, out], row stride ldy */
    int64_t ldy;
} colibri_qlinear_t;

static void colibri_qlinear_chunk(void *arg, int32_t c)
{
    const colibri_qlinear_t *l = (const colibri_qlinear_t *)arg;
    const int32_t o0 = c * l->rows;
    const int32_t o1 = o0 + l->rows < l->out_dim ? o0 + l->rows : l->out_dim;
    const int32_t groups = l->in_dim / 32;
    int32_t o, r;
    for (r = 0; r < l->n; r += 4)
        colibri_q_dot_rows(l->path, l->type, l->w + o0 * l->ldw, l->ldw, NULL, 0, o1 - o0,
                           l->in_dim, l->xd + r * groups, l->xq + (int64_t)r * l->in_dim,
                           l->xs + r * groups, l->n - r < 4 ? l->n - r : 4, l->y + r * l->ldy + o0,
                           1, l->ldy);
    if (l->bias != NULL)
        for (r = 0; r < l->n; r++)
            for (o = o0; o < o1; o++)
                l->y[r * l->ldy + o] += l->bias[o];
}

/* The whole layer on up to `threads` threads. */
static inline void colibri_qlinear_run(colibri_qlinear_t *l, int threads)
{
    const int64_t row = colibri_q_row_bytes(l->type, l->in_dim);
    if (l->n < 1 || l->out_dim < 1)
        return;
    /* whole groups of 8 rows (COLIBRI_Q4_0X8's) */
    l->rows = colibri_pool_chunk_rows(colibri_pool_chunk_bytes(row * l->out_dim, threads), row, 8);
    colibri_pool_run(colibri_qlinear_chunk, (void *)l, (l->out_dim + l->rows - 1) / l->rows,
                     threads);
}

/* Several layers of one input (a decoder layer's q, k and v projections) in one pool run,
 * their chunks in one index space sized from their bytes together; first must hold count + 1
 * entries (scratch). Each output row's value is colibri_qlinear_run's. */
static inline void colibri_qlinear_run_many(colibri_qlinear_t *l, int32_t count, int32_t *first,
                                            int threads)
{
    int64_t total = 0, row;
    int32_t j;
    for (j = 0; j < count; j++)
        if (l[j].n > 0 && l[j].out_dim > 0)
            total += colibri_q_row_bytes(l[j].type, l[j].in_dim) * l[j].out_dim;
    first[0] = 0;
    for (j = 0; j < count; j++) {
        row = colibri_q_row_bytes(l[j].type, l[j].in_dim);
        l[j].rows = colibri_pool_chunk_rows(colibri_pool_chunk_bytes(total, threads), row, 8);
        first[j + 1] =
            first[j]
            + (l[j].n > 0 && l[j].out_dim > 0 ? (l[j].out_dim + l[j].rows - 1) / l[j].rows : 0);
    }
    colibri_pool_run_many(colibri_qlinear_chunk, l, sizeof *l, count, first, threads);
}

#endif /* COLIBRI_QLINEAR_H */
