"""colibri's float8 experts (include/colibri/fp8.h): e4m3fn weights with one float32 scale per
128 x 128 block, decoded exactly, multiplied without materialising the weights, in the
kernel's fixed summation order (every SIMD path and thread count: the same bits)."""

from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.stdlib cimport free, malloc

import numpy as np

from colibri._openmp cimport colibri_max_threads
from colibri._pool cimport share_pool
from colibri.layer._plan cimport add_rows, check_plan, gather_rows
from colibri.layer._ffn import ACTIVATIONS, path_index

share_pool()  # one worker pool a process (colibri/_pool.pyx)


cdef extern from "colibri/fp8.h" nogil:
    enum:
        COLIBRI_FP8_BLOCK
        COLIBRI_FFN_MAX_ROWS
    ctypedef struct colibri_fp8_ffn_t:
        int32_t n, H, I, act, path
        const float *x
        int64_t ldx
        const uint8_t *gate
        const uint8_t *up
        int64_t ldg, ldu
        const float *gs
        const float *us
        int64_t lgs, lus
        const uint8_t *down
        int64_t ldd
        const float *ds
        int64_t lds
        float *h
        float *y
        int64_t ldy
    const float *colibri_fp8_table() noexcept
    void colibri_fp8_dot(int path, const uint8_t *w, int32_t K, const float *s, const float *x,
                         int64_t ldx, int32_t n, float *y, int64_t ldy) noexcept
    void colibri_fp8_run_many(const colibri_fp8_ffn_t *f, int32_t count, int32_t *first,
                              int threads) noexcept


#: Rows and columns of one scale block.
BLOCK = COLIBRI_FP8_BLOCK
#: Most rows one expert takes in the kernel.
MAX_ROWS = COLIBRI_FFN_MAX_ROWS


def table():
    """The 256 e4m3fn values, float32 [256], indexed by byte (0x7F and 0xFF: NaN)."""
    cdef const float *t = colibri_fp8_table()
    return np.array([t[i] for i in range(256)], np.float32)


def scale_shape(rows, cols):
    """The block-scale shape of a ``[rows, cols]`` matrix: ``(ceil(rows/128), ceil(cols/128))``."""
    return (-(-rows // BLOCK), -(-cols // BLOCK))


def _weights(w, what):
    w = np.asarray(w)
    if w.ndim != 2 or (w.dtype != np.uint8 and w.dtype.name != "float8_e4m3fn"):
        raise ValueError(f"{what} must be 2-D e4m3fn bytes (uint8; got {w.dtype} {w.shape})")
    return np.ascontiguousarray(w).view(np.uint8)


def _scales(s, w, what):
    s = np.asarray(s)
    if s.ndim != 2 or tuple(s.shape) != scale_shape(*w.shape):
        raise ValueError(
            f"{what}'s scales must be {list(scale_shape(*w.shape))} (128 x 128 blocks of its "
            f"{list(w.shape)}; got {list(s.shape)})"
        )
    return np.ascontiguousarray(s, np.float32)


def dequantize(w, scale):
    """e4m3fn bytes ``w [rows, cols]`` times their block scales -> float32 [rows, cols].

    Parameters
    ----------
    w : ndarray of uint8 (or ml_dtypes float8_e4m3fn), shape (rows, cols)
    scale : ndarray of float32 (or bfloat16), shape (ceil(rows/128), ceil(cols/128))
    """
    w = _weights(w, "w")
    s = _scales(scale, w, "w")
    t = table()
    full = np.repeat(np.repeat(s, BLOCK, 0)[: w.shape[0]], BLOCK, 1)[:, : w.shape[1]]
    with np.errstate(invalid="ignore", over="ignore"):  # a corrupt scale: the caller checks
        return t[w] * full


def find_nonfinite(w, scale):
    """The first problem that makes ``w``'s values non-finite, or None: ``("scale", i, j)``,
    a block scale that is NaN or infinite, or ``("byte", r, c)``, a NaN byte (0x7F, 0xFF)."""
    w = _weights(w, "w")
    s = _scales(scale, w, "w")
    bad = np.argwhere(~np.isfinite(s))
    if len(bad):
        return ("scale", int(bad[0][0]), int(bad[0][1]))
    bad = np.argwhere((w & 0x7F) == 0x7F)
    if len(bad):
        return ("byte", int(bad[0][0]), int(bad[0][1]))
    return None


def matmul(w, scale, x, path=None):
    """``x @ dequantize(w, scale).T`` in the kernel's summation order.

    Parameters
    ----------
    w : ndarray of uint8, shape (rows, K)
    scale : ndarray of float32, shape (ceil(rows/128), ceil(K/128))
    x : ndarray of float32, shape (n, K)
    path : str, optional
        A SIMD path this CPU runs (tests); None: the dispatched one. Every path gives the
        same bits.

    Returns
    -------
    ndarray of float32, shape (n, rows)
    """
    cdef int p = path_index(path)
    w = _weights(w, "w")
    s = _scales(scale, w, "w")
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [n, {w.shape[1]}] (got {x.shape})")
    cdef const uint8_t[:, ::1] wv = w
    cdef const float[:, ::1] sv = s
    cdef const float[:, ::1] xv = x
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    cdef float[:, ::1] ov = out
    cdef Py_ssize_t o
    cdef int32_t K = <int32_t>w.shape[1], n = <int32_t>x.shape[0]
    if n == 0 or wv.shape[0] == 0:
        return out
    with nogil:
        for o in range(wv.shape[0]):
            colibri_fp8_dot(p, &wv[o, 0], K, &sv[o // COLIBRI_FP8_BLOCK, 0], &xv[0, 0], K, n,
                            &ov[0, o], ov.shape[1])
    return out


def ffn(gate, up, down, scales, x, act="silu", int num_threads=0, path=None):
    """One float8 expert's gated FFN on a few rows: ``down @ (act(gate @ x) * (up @ x))``.

    Parameters
    ----------
    gate, up : ndarray of uint8, shape (I, H)
    down : ndarray of uint8, shape (H, I)
    scales : (gate's, up's, down's) float32 block scales, shapes (ceil(I/128), ceil(H/128))
        twice, then (ceil(H/128), ceil(I/128))
    x : ndarray of float32, shape (n, H), 1 <= n <= 64
    act : str
        One of ``ACTIVATIONS``.
    num_threads : int
        Threads (the caller and pool helpers); 0: all.
    path : str, optional
        A SIMD path this CPU runs; None: the dispatched one (every path: the same bits).

    Returns
    -------
    ndarray of float32, shape (n, H)
    """
    x = np.ascontiguousarray(x, np.float32)
    n = x.shape[0]
    y = np.zeros(x.shape, np.float32)
    ffn_sum(x, [(gate, up, down, *scales)], act, np.array([0, n], np.int64),
            np.arange(n, dtype=np.int64), np.ones(n, np.float32), y, num_threads, path)
    return y


def ffn_sum(const float[:, ::1] x, list experts, act, const int64_t[::1] bounds,
            const int64_t[::1] rows, const float[::1] scale, float[:, ::1] y,
            int num_threads=0, path=None):
    """``y[rows[i]] += scale[i] * ffn_j(x[rows[i]])`` for i in ``[bounds[j], bounds[j + 1])``:
    a layer's float8 experts in one call, two pool runs for all of them.

    Parameters
    ----------
    x : ndarray of float32, shape (T, H), C-contiguous
    experts : list of (gate, up, down, gate_scale, up_scale, down_scale)
        e4m3fn bytes gate, up ``[I, H]`` and down ``[H, I]``, and their float32 block scales
        (:func:`scale_shape`).
    bounds : ndarray of int64, shape (len(experts) + 1,)
        From 0; expert j takes 1 to 64 assignments.
    rows : ndarray of int64, shape (bounds[-1],)
        Rows of x, in [0, T).
    scale : ndarray of float32, shape (bounds[-1],)
    y : ndarray of float32, shape (T, H), C-contiguous
        Added to in place, expert by expert in list order.
    """
    cdef int p = path_index(path)
    cdef int a = ACTIVATIONS.get(act, -1)
    cdef Py_ssize_t count = len(experts), j
    cdef int64_t T = x.shape[0], H = x.shape[1], total, k, I, hsize = 0
    cdef const uint8_t[:, ::1] g, u, d
    cdef const float[:, ::1] gs, us, ds
    if a < 0:
        raise ValueError(f"act must be one of {', '.join(ACTIVATIONS)} (got {act!r})")
    if H < 1 or y.shape[0] != T or y.shape[1] != H:
        raise ValueError(f"ffn_sum(): x must be [T, H] and y like it (got x {[T, H]}, y "
                         f"{[y.shape[0], y.shape[1]]})")
    total = check_plan(count, T, bounds, rows, scale)
    if count == 0:
        return
    held = []  # the contiguous arrays the C structs point into
    for j in range(count):
        gate, up, down, sg, su, sd = experts[j]
        gate, up, down = _weights(gate, "gate"), _weights(up, "up"), _weights(down, "down")
        I = gate.shape[0]
        if I < 1 or gate.shape[1] != H or up.shape != gate.shape or down.shape != (H, I):
            raise ValueError(
                f"expert {j}: gate and up must be [I, {H}] and down [{H}, I] (got "
                f"{list(gate.shape)}, {list(up.shape)}, {list(down.shape)})"
            )
        held.append((gate, up, down, _scales(sg, gate, "gate"), _scales(su, up, "up"),
                     _scales(sd, down, "down")))
    cdef colibri_fp8_ffn_t *f = <colibri_fp8_ffn_t *>malloc(count * sizeof(colibri_fp8_ffn_t))
    cdef int32_t *first = <int32_t *>malloc((count + 1) * sizeof(int32_t))
    cdef float *scratch = NULL
    cdef float *xg
    cdef float *yg
    cdef float *h
    try:
        if f == NULL or first == NULL:
            raise MemoryError()
        for j in range(count):
            g, u, d, gs, us, ds = held[j]
            I = g.shape[0]
            f[j].gate, f[j].up, f[j].down = &g[0, 0], &u[0, 0], &d[0, 0]
            f[j].ldg, f[j].ldu, f[j].ldd = H, H, I
            f[j].gs, f[j].us, f[j].ds = &gs[0, 0], &us[0, 0], &ds[0, 0]
            f[j].lgs, f[j].lus, f[j].lds = gs.shape[1], us.shape[1], ds.shape[1]
            f[j].n, f[j].H, f[j].I = <int32_t>(bounds[j + 1] - bounds[j]), <int32_t>H, <int32_t>I
            f[j].act, f[j].path = a, p
            hsize += f[j].n * I
        scratch = <float *>malloc((2 * total * H + hsize) * sizeof(float) + 64)
        if scratch == NULL:
            raise MemoryError()
        xg = scratch
        yg = xg + total * H
        h = yg + total * H
        k = 0
        for j in range(count):
            f[j].x, f[j].ldx = xg + bounds[j] * H, H
            f[j].y, f[j].ldy = yg + bounds[j] * H, H
            f[j].h = h + k
            k += <int64_t>f[j].n * f[j].I
        if num_threads < 1:
            num_threads = colibri_max_threads()
        with nogil:
            gather_rows(x, rows, total, xg)
            colibri_fp8_run_many(f, <int32_t>count, first, num_threads)
            add_rows(y, rows, scale, total, yg)
    finally:
        free(f)
        free(first)
        free(scratch)
