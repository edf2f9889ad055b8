/*
 * colibri's linear layer for half-precision weights, for a few rows at a time:
 *
 *     y[r, o] = W[o] . x[r] (+ bias[o])      r < n, o < out
 *
 * W [out, in] in float16 or bfloat16 (each row contiguous, any row stride), x [n, in] and
 * y [n, out] float32, bias float32 [out] or none. The dot products are the FFN kernel's
 * (colibri/ffn.h: colibri_dot_rows, every SIMD path), so W is read once, in its stored
 * dtype, at the speed memory delivers it; chunks of output rows run on colibri's pool
 * (colibri/pool.h). Each output element is computed by one thread in a fixed order: the
 * bits do not depend on the thread count.
 */
#ifndef COLIBRI_LINEAR_H
#define COLIBRI_LINEAR_H

#include "colibri/ffn.h"

typedef struct {
    int32_t n, in_dim, out_dim; /* rows, input and output features */
    int32_t kind;               /* COLIBRI_W_F16 or COLIBRI_W_BF16 */
    int32_t path;               /* COLIBRI_PATH_* (one this CPU runs) */
    const float *x;             /* [n, in], row stride ldx */
    int64_t ldx;
    const uint16_t *w; /* [out, in], row stride ldw (elements) */
    int64_t ldw;
    const float *bias; /* [out] or NULL */
    uint16_t *xs;      /* scratch for the bf16 path: [2, n, in] */
    float *y;          /* [n, out], row stride ldy */
    int64_t ldy;
    int32_t rows; /* set by colibri_linear_run: output rows of one chunk of the pool */
} colibri_linear_t;

/* Bytes of scratch l->xs needs (0 unless the bf16 path runs). */
static inline size_t colibri_linear_split_bytes(const colibri_linear_t *l)
{
    if (!colibri_uses_split(l->path, l->kind))
        return 0;
    return 2 * sizeof(uint16_t) * (size_t)l->n * (size_t)l->in_dim;
}

static void colibri_linear_chunk(void *arg, int32_t c)
{
    const colibri_linear_t *l = (const colibri_linear_t *)arg;
    const int32_t rows = l->rows;
    const int32_t o1 = (c + 1) * rows < l->out_dim ? (c + 1) * rows : l->out_dim;
    int32_t o, r;
    for (o = c * rows; o < o1; o++) {
        colibri_dot_rows(l->path, l->kind, l->n, l->w + o * l->ldw, l->in_dim, l->x, l->ldx, l->xs,
                         l->y + o, l->ldy);
        if (l->bias != NULL)
            for (r = 0; r < l->n; r++)
                l->y[r * l->ldy + o] += l->bias[o];
    }
}

/* The whole layer on up to `threads` threads; l->xs must hold colibri_linear_split_bytes(l)
 * bytes. */
static inline void colibri_linear_run(colibri_linear_t *l, int threads)
{
    const int64_t row = 2 * (int64_t)l->in_dim;
    if (l->n < 1 || l->out_dim < 1)
        return;
    if (colibri_uses_split(l->path, l->kind))
        colibri_split_rows(l->x, l->ldx, l->n, l->in_dim, l->xs);
    l->rows = colibri_pool_chunk_rows(colibri_pool_chunk_bytes(row * l->out_dim, threads), row, 1);
    colibri_pool_run(colibri_linear_chunk, (void *)l, (l->out_dim + l->rows - 1) / l->rows,
                     threads);
}

/* Several layers of one input and one kind (a decoder layer's q, k and v projections) in
 * one pool run, their chunks in one index space sized from their bytes together; first must
 * hold count + 1 entries (scratch), l[0].xs colibri_linear_split_bytes(&l[0]) bytes (shared:
 * the input split once). Each output row's value is colibri_linear_run's. */
static inline void colibri_linear_run_many(colibri_linear_t *l, int32_t count, int32_t *first,
                                           int threads)
{
    int64_t total = 0;
    int32_t j;
    if (count < 1 || l[0].n < 1)
        return;
    if (colibri_uses_split(l[0].path, l[0].kind))
        colibri_split_rows(l[0].x, l[0].ldx, l[0].n, l[0].in_dim, l[0].xs);
    for (j = 0; j < count; j++)
        total += 2 * (int64_t)l[j].in_dim * (l[j].out_dim > 0 ? l[j].out_dim : 0);
    first[0] = 0;
    for (j = 0; j < count; j++) {
        l[j].xs = l[0].xs;
        l[j].rows = colibri_pool_chunk_rows(colibri_pool_chunk_bytes(total, threads),
                                            2 * (int64_t)l[j].in_dim, 1);
        first[j + 1] =
            first[j] + (l[j].out_dim > 0 ? (l[j].out_dim + l[j].rows - 1) / l[j].rows : 0);
    }
    colibri_pool_run_many(colibri_linear_chunk, l, sizeof *l, count, first, threads);
}

#endif /* COLIBRI_LINEAR_H */
