"""colibri's quantized weight blocks (include/colibri/quant.h): exact dequantization, q8
activations, and weight-row products in the kernels' fixed summation order; ``mxfp4_oss``
(gpt-oss's MXFP4: values interleaved, scales apart) in :func:`matmul` and :func:`ffn_sum`."""

from libc.math cimport isfinite
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport calloc, free, malloc

import numpy as np

from colibri._openmp cimport colibri_max_threads
from colibri._pool cimport share_pool
from colibri.layer._ffn cimport colibri_ffn_t, ffn_run_sum, ffn_weights
from colibri.layer._half cimport (
    COLIBRI_W_BF16,
    COLIBRI_W_F16,
    colibri_bf16_to_float,
    colibri_float_to_bf16,
    colibri_float_to_half,
    colibri_half_to_float,
)
from colibri.layer._kernels cimport colibri_q8_row, colibri_qlinear_run, colibri_qlinear_t
from colibri.layer._plan cimport add_rows, check_plan, gather_rows
from colibri.layer._ffn import path_index

share_pool()  # one worker pool a process (colibri/_pool.pyx)


cdef extern from "colibri/quant.h" nogil:
    enum:
        COLIBRI_Q8_0
        COLIBRI_Q4_0
        COLIBRI_Q4_K
        COLIBRI_Q5_K
        COLIBRI_Q6_K
        COLIBRI_IQ4_XS
        COLIBRI_MXFP4
        COLIBRI_MXFP4_OSS
        COLIBRI_Q4_0X8
        COLIBRI_Q4_0X8_FAST
        COLIBRI_Q_COUNT
    const int32_t colibri_q_block[]
    const int32_t colibri_q_bytes[]
    void colibri_q_dequantize_block(int type, const uint8_t *b, float *out) noexcept
    float colibri_q_scale(int type, const uint8_t *b, int32_t j, int half, float *min) noexcept
    void colibri_q8_oss_order(int8_t *q, int32_t K) noexcept
    void colibri_q4_0x8_pack(const uint8_t *w, int64_t ldw, int32_t rows, int32_t K,
                             uint8_t *out) noexcept
    void colibri_q_dot_rows(int path, int type, const uint8_t *w, int64_t ldw, const uint8_t *e,
                            int64_t lde, int32_t rows, int32_t K, const float *d, const int8_t *q,
                            const int32_t *s, int32_t nb, float *y, int64_t ldo,
                            int64_t ldy) noexcept


cdef extern from "colibri/qffn.h" nogil:
    ctypedef struct colibri_qffn_t:
        int32_t n, H, I, type, down_type, act, path
        const float *xd
        const int8_t *xq
        const int32_t *xs
        const uint8_t *gate
        const uint8_t *up
        int64_t ldg, ldu
        const uint8_t *down
        int64_t ldd
        float *h
        float *hd
        int8_t *hq
        int32_t *hs
        float *y
        int64_t ldy
        const uint8_t *ge
        const uint8_t *ue
        const uint8_t *de
        int64_t lge, lue, lde
        const float *bg
        const float *bu
        const float *bd
        int64_t ldb
        float alpha, limit
    enum:
        COLIBRI_FFN_MAX_ROWS
        COLIBRI_QFFN_ACT_GPT_OSS
    void colibri_qffn_run_many(colibri_qffn_t *f, int32_t count, int32_t *first,
                               int threads) noexcept


TYPES = {
    "q8_0": COLIBRI_Q8_0, "q4_0": COLIBRI_Q4_0, "q4_k": COLIBRI_Q4_K, "q5_k": COLIBRI_Q5_K,
    "q6_k": COLIBRI_Q6_K, "iq4_xs": COLIBRI_IQ4_XS, "mxfp4": COLIBRI_MXFP4,
}  # fmt: skip
#: gpt-oss's MXFP4 (colibri.formats.gpt_oss): blocks of 16 bytes, value 2i in byte i's low
#: nibble and 2i + 1 in its high one, the e8m0 scales a separate uint8 array [rows, K / 32].
#: Only :func:`matmul` (``scales=``) and :func:`ffn_sum` (gpt-oss experts) take it.
MXFP4_OSS = "mxfp4_oss"
#: Q4_0 rows interleaved by eight (quant.h's COLIBRI_Q4_0X8: the same values, eight rows'
#: blocks together, one int32 lane a row in the x86 kernel), rows a multiple of 8:
#: :func:`interleave` makes them; :func:`linear`, the decode step and :class:`Held` take them.
Q4_0X8 = "q4_0x8"
#: Whether Q4_0X8 has its own kernel in this build (x86, GCC or Clang): only then is
#: interleaving worth its copy (1.7-1.9x a Q4_0 row at a time on a Zen 3 core).
INTERLEAVE_FAST = bool(COLIBRI_Q4_0X8_FAST)
TYPE_NAMES = {t: name for name, t in TYPES.items()} | {COLIBRI_MXFP4_OSS: MXFP4_OSS,
                                                       COLIBRI_Q4_0X8: Q4_0X8}
BLOCK = {name: colibri_q_block[t] for name, t in TYPES.items()}
BLOCK_BYTES = {name: colibri_q_bytes[t] for name, t in TYPES.items()}


def _type(qtype, bint scales_apart=True):
    if qtype == MXFP4_OSS and scales_apart:
        return COLIBRI_MXFP4_OSS
    if qtype not in TYPES:
        apart = f" ({MXFP4_OSS} keeps its scales apart: matmul(scales=) and ffn_sum only)"
        raise ValueError(
            f"quantized type must be one of {', '.join(TYPES)} (got {qtype!r})"
            + (apart if qtype == MXFP4_OSS else "")
        )
    return TYPES[qtype]


def linear_type(qtype, int64_t rows):
    """:func:`linear`'s type number of ``qtype``: one of ``TYPES``, or :data:`Q4_0X8` with
    ``rows`` a multiple of 8."""
    if qtype != Q4_0X8:
        return _type(qtype, False)
    if rows % 8:
        raise ValueError(f"{Q4_0X8} weights hold their rows in groups of 8 (got {rows} rows)")
    return COLIBRI_Q4_0X8


def interleave(const uint8_t[:, ::1] w):
    """Q4_0 rows ``[rows, K / 32 * 18]`` uint8 (``rows`` a multiple of 8) as a new array of
    :data:`Q4_0X8` rows of the same shape: the same values, eight rows' blocks together."""
    cdef int32_t K = row_values("q4_0", w.shape[1])
    cdef int32_t rows = <int32_t>w.shape[0]
    linear_type(Q4_0X8, rows)
    packed = np.empty((rows, w.shape[1]), np.uint8)
    cdef uint8_t[:, ::1] out = packed
    if rows:
        with nogil:
            colibri_q4_0x8_pack(&w[0, 0], w.shape[1], rows, K, &out[0, 0])
    return packed


def row_values(qtype, int row_bytes):
    """Values in a row of ``row_bytes`` bytes of ``qtype`` (whole blocks only)."""
    t = COLIBRI_Q4_0X8 if qtype == Q4_0X8 else _type(qtype)
    if row_bytes <= 0 or row_bytes % colibri_q_bytes[t]:
        raise ValueError(
            f"a {qtype} row holds whole blocks of {colibri_q_bytes[t]} bytes (got {row_bytes} "
            "bytes): the tensor is truncated or not of this type"
        )
    return row_bytes // colibri_q_bytes[t] * colibri_q_block[t]


def _rows(qtype, w):
    w = np.asarray(w)
    if w.dtype != np.uint8 or w.ndim != 2:
        raise TypeError(f"quantized rows must be a 2-D uint8 array (got {w.dtype} {w.shape})")
    return np.ascontiguousarray(w), row_values(qtype, w.shape[1])


def dequantize(qtype, w):
    """Rows of ``qtype`` blocks -> float32, exactly the values GGUF's dequantization gives.

    Parameters
    ----------
    qtype : str
        One of ``TYPES``.
    w : ndarray of uint8, shape (rows, row_bytes)

    Returns
    -------
    ndarray of float32, shape (rows, K)
    """
    cdef int t = _type(qtype, False)
    w, K = _rows(qtype, w)
    cdef const uint8_t[:, ::1] wv = w
    out = np.empty((w.shape[0], K), np.float32)
    cdef float[:, ::1] ov = out
    cdef Py_ssize_t r, i, blocks = K // colibri_q_block[t]
    with nogil:
        for r in range(wv.shape[0]):
            for i in range(blocks):
                colibri_q_dequantize_block(
                    t, &wv[r, i * colibri_q_bytes[t]], &ov[r, i * colibri_q_block[t]]
                )
    return out


def nonfinite_block(qtype, w):
    """The byte offset (in ``w``'s rows, row-major) of the first block of ``qtype`` whose
    scales are not finite numbers, or -1.

    Parameters
    ----------
    w : ndarray of uint8, shape (rows, row_bytes)
    """
    cdef int t = _type(qtype, False)
    w, K = _rows(qtype, w)
    cdef const uint8_t[:, ::1] wv = w
    cdef Py_ssize_t r, i, j, blocks = K // colibri_q_block[t], subs = colibri_q_block[t] // 32
    cdef const uint8_t *b
    cdef float scale, low, high
    cdef Py_ssize_t found = -1
    with nogil:
        for r in range(wv.shape[0]):
            for i in range(blocks):
                b = &wv[r, i * colibri_q_bytes[t]]
                for j in range(subs):
                    scale = colibri_q_scale(t, b, <int32_t>j, 0, &low)
                    high = colibri_q_scale(t, b, <int32_t>j, 1, &low)
                    if scale - scale != 0 or high - high != 0 or low - low != 0:
                        found = r * wv.shape[1] + i * colibri_q_bytes[t]
                        break
                if found >= 0:
                    break
            if found >= 0:
                break
    return found


def _activations(x, int K):
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != K or K % 32:
        raise ValueError(
            f"activations must be float32 [n, {K}] with {K} a multiple of 32 "
            f"(got {x.dtype} {x.shape})"
        )
    return np.ascontiguousarray(x)


def quantize_q8(x):
    """float32 [n, K] -> the q8 rows (d [n, K/32] float32, q [n, K] int8, s [n, K/32] int32)."""
    x = np.asarray(x)
    cdef int32_t K = x.shape[1] if x.ndim == 2 else 0
    x = _activations(x, K)
    cdef const float[:, ::1] xv = x
    d = np.empty((x.shape[0], K // 32), np.float32)
    q = np.empty((x.shape[0], K), np.int8)
    s = np.empty((x.shape[0], K // 32), np.int32)
    cdef float[:, ::1] dv = d
    cdef int8_t[:, ::1] qv = q
    cdef int32_t[:, ::1] sv = s
    cdef Py_ssize_t r
    with nogil:
        for r in range(xv.shape[0]):
            colibri_q8_row(&xv[r, 0], K, &dv[r, 0], &qv[r, 0], &sv[r, 0])
    return d, q, s


def _scales(e, int64_t rows, int64_t groups, str what):
    """gpt-oss's e8m0 scales of ``rows`` rows of ``groups`` blocks: a C-contiguous uint8 array."""
    e = np.asarray(e)
    if e.dtype != np.uint8 or e.shape != (rows, groups):
        raise ValueError(
            f"{what}: {MXFP4_OSS} scales must be uint8 [{rows}, {groups}] (one e8m0 byte per "
            f"block of 32 values of each row; got {e.dtype} {list(e.shape)}): the scales are "
            "truncated or do not belong to these blocks"
        )
    return np.ascontiguousarray(e)


def matmul(qtype, w, x, path=None, scales=None):
    """``x @ dequantize(w).T`` with x quantized to q8 rows, summed in the kernels' order.

    Parameters
    ----------
    w : ndarray of uint8, shape (rows, row_bytes)
    x : ndarray of float32, shape (n, K)

    path : str, optional
        A SIMD path this CPU runs (tests); None: the dispatched one. Every path gives the
        same bits.
    scales : ndarray of uint8, shape (rows, K / 32), optional
        ``mxfp4_oss`` only (and required): the e8m0 scales of w's blocks.

    Returns
    -------
    ndarray of float32, shape (n, rows)
    """
    cdef int t = _type(qtype), p = path_index(path)
    cdef int32_t K
    cdef const uint8_t *e = NULL
    cdef const uint8_t[:, ::1] ev
    w, K = _rows(qtype, w)
    d, q, s = quantize_q8(_activations(x, K))
    if (scales is not None) != (t == COLIBRI_MXFP4_OSS):
        raise ValueError(f"matmul(): scales= goes with {MXFP4_OSS} weights, and only with them")
    if t == COLIBRI_MXFP4_OSS:
        ev = _scales(scales, w.shape[0], K // 32, "matmul()")
        if ev.shape[0] and ev.shape[1]:
            e = &ev[0, 0]
        for row in q:
            _oss_order(row)
    cdef const uint8_t[:, ::1] wv = w
    cdef const float[:, ::1] dv = d
    cdef const int8_t[:, ::1] qv = q
    cdef const int32_t[:, ::1] sv = s
    out = np.empty((q.shape[0], w.shape[0]), np.float32)
    cdef float[:, ::1] ov = out
    cdef Py_ssize_t r, n = qv.shape[0]
    cdef int32_t nb
    if wv.shape[0] == 0:
        return out
    with nogil:
        for r in range(0, n, 4):
            nb = <int32_t>min(4, n - r)
            colibri_q_dot_rows(
                p, t, &wv[0, 0], wv.shape[1], e, K // 32, <int32_t>wv.shape[0], K, &dv[r, 0],
                &qv[r, 0], &sv[r, 0], nb, &ov[r, 0], 1, ov.shape[1]
            )
    return out


def linear(qtype, const uint8_t[:, ::1] w, x, y, int num_threads=0,
           const float[::1] bias=None, path=None, int kind=0):
    """y = x @ dequantize(w).T (+ bias): colibri's quantized linear kernel
    (include/colibri/qlinear.h), x quantized to q8 rows once.

    Parameters
    ----------
    qtype : str
        One of ``TYPES``, or :data:`Q4_0X8`.
    w : ndarray of uint8, shape (out, row_bytes)
        Rows of whole ``qtype`` blocks, C-contiguous (as stored in a GGUF file).
    x : ndarray, shape (n, in)
        C-contiguous float32 (``kind`` 0) or the uint16 bits of float16 / bfloat16 (half.h's
        ``COLIBRI_W_F16`` / ``COLIBRI_W_BF16``); ``in`` the values of a row of ``w``.
    y : ndarray, shape (n, out)
        C-contiguous, stored as ``x``, written (half precision: the float32 sums rounded
        once, to nearest even).
    num_threads : int
        Threads (the caller and pool helpers); < 1: colibri's default. The bits do not
        depend on it, nor on ``path``.
    bias : ndarray of float32, shape (out,), optional
        Added in float32.
    path : str, optional
        A SIMD path this CPU runs (tests); None: the dispatched one.
    kind : int
        What ``x`` and ``y`` hold.
    """
    cdef int t = linear_type(qtype, w.shape[0])
    cdef int32_t K = row_values(qtype, w.shape[1])
    cdef const float[:, ::1] xf
    cdef float[:, ::1] yf
    cdef const uint16_t[:, ::1] xb
    cdef uint16_t[:, ::1] yb
    cdef int64_t n, i, total
    cdef float *buf = NULL
    if kind == 0:
        xf, yf = x, y
        n = xf.shape[0]
        _linear_shapes(qtype, K, w, n, xf.shape[1], yf.shape[0], yf.shape[1], bias)
        _linear(t, K, w, &xf[0, 0] if n else NULL, n, &yf[0, 0] if n else NULL, bias,
                path_index(path), num_threads)
        return
    if kind != COLIBRI_W_F16 and kind != COLIBRI_W_BF16:
        raise ValueError(f"linear(): kind must be 0, COLIBRI_W_F16 or COLIBRI_W_BF16 ({kind})")
    xb, yb = x, y
    n = xb.shape[0]
    _linear_shapes(qtype, K, w, n, xb.shape[1], yb.shape[0], yb.shape[1], bias)
    if n == 0 or w.shape[0] == 0:
        return
    buf = <float *>malloc(<size_t>n * (K + w.shape[0]) * sizeof(float))
    if buf == NULL:
        raise MemoryError()
    try:
        with nogil:
            total = n * K
            for i in range(total):
                buf[i] = colibri_bf16_to_float((&xb[0, 0])[i]) if kind == COLIBRI_W_BF16 \
                    else colibri_half_to_float((&xb[0, 0])[i])
        _linear(t, K, w, buf, n, buf + n * K, bias, path_index(path), num_threads)
        with nogil:
            total = n * w.shape[0]
            for i in range(total):
                (&yb[0, 0])[i] = colibri_float_to_bf16(buf[n * K + i]) \
                    if kind == COLIBRI_W_BF16 else colibri_float_to_half(buf[n * K + i])
    finally:
        free(buf)


cdef int _linear_shapes(qtype, int32_t K, const uint8_t[:, ::1] w, int64_t n, int64_t x_in,
                        int64_t y_rows, int64_t y_out, const float[::1] bias) except -1:
    if x_in != K or y_rows != n or y_out != w.shape[0]:
        raise ValueError(
            f"linear(): x [n, in], w [out] rows of in {qtype} values and y [n, out] (got x "
            f"{[n, x_in]}, w {w.shape[0]} rows of {K} values, y {[y_rows, y_out]})"
        )
    if bias is not None and bias.shape[0] != w.shape[0]:
        raise ValueError(f"linear(): bias must be float32 [{w.shape[0]}] (got [{bias.shape[0]}])")
    if n > 0x7fffffff or w.shape[0] > 0x7fffffff:
        raise ValueError("linear(): more than 2^31 - 1 rows")
    return 0


cdef int _linear(int t, int32_t K, const uint8_t[:, ::1] w, const float *x, int64_t n,
                 float *y, const float[::1] bias, int path, int num_threads) except -1:
    """y [n, out] = x [n, K] @ dequantize(w).T (+ bias), rows contiguous (shapes checked)."""
    cdef colibri_qlinear_t f
    f.n = <int32_t>n
    f.in_dim = K
    f.out_dim = <int32_t>w.shape[0]
    f.type = t
    f.path = path
    if f.n == 0 or f.out_dim == 0:
        return 0
    cdef int64_t groups = K // 32
    cdef char *q8 = <char *>malloc(<size_t>f.n * (K + 8 * groups))
    if q8 == NULL:
        raise MemoryError()
    f.xd = <float *>q8
    f.xs = <int32_t *>(q8 + 4 * f.n * groups)
    f.xq = <int8_t *>(q8 + 8 * f.n * groups)
    f.w = &w[0, 0]
    f.ldw = w.shape[1]
    f.bias = &bias[0] if bias is not None else NULL
    f.y = y
    f.ldy = f.out_dim
    if num_threads < 1:
        num_threads = colibri_max_threads()
    cdef int32_t r
    with nogil:
        for r in range(f.n):
            colibri_q8_row(x + <int64_t>r * K, K, <float *>f.xd + r * groups,
                           <int8_t *>f.xq + <int64_t>r * K, <int32_t *>f.xs + r * groups)
        colibri_qlinear_run(&f, num_threads)
    free(q8)
    return 0


def _oss_order(int8_t[::1] q):
    """One q8 row's values, in place, in the order ``mxfp4_oss`` weights take."""
    colibri_q8_oss_order(&q[0], <int32_t>q.shape[0])


#: ``gpt_oss``: gpt-oss's clamped SwiGLU with biases (``mxfp4_oss`` experts, :func:`ffn_sum`).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu": 3,
               "gpt_oss": COLIBRI_QFFN_ACT_GPT_OSS}  # fmt: skip


cdef const uint8_t *_matrix(const uint8_t[:, ::1] w, int t, int32_t rows, int32_t values,
                            str what, Py_ssize_t j) except NULL:
    """The first byte of a checked matrix: ``rows`` rows of ``values`` values of type t."""
    cdef int64_t row_bytes = <int64_t>(values // colibri_q_block[t]) * colibri_q_bytes[t]
    if values % colibri_q_block[t]:
        raise ValueError(
            f"expert {j}: {what}'s rows of {values} values are not whole {TYPE_NAMES[t]} blocks "
            f"of {colibri_q_block[t]}: this shape cannot be stored as {TYPE_NAMES[t]}"
        )
    if w.shape[0] != rows or w.shape[1] != row_bytes:
        raise ValueError(
            f"expert {j}: {what} must be {rows} rows of {values} {TYPE_NAMES[t]} values "
            f"({row_bytes} bytes; whole blocks of {colibri_q_block[t]}) but is "
            f"{w.shape[0]} rows of {w.shape[1]} bytes: expert shapes disagree"
        )
    return &w[0, 0]


cdef int64_t _fill(colibri_qffn_t *f, object mats, int t, int td, int64_t H,
                   Py_ssize_t j) except -1:
    """Point ``f`` at expert j's checked ``(gate, up, down)``: gate and up ``I`` rows of ``H``
    values of type t, down ``H`` rows of ``I`` values of type td; returns ``I``."""
    cdef const uint8_t[:, ::1] g
    cdef const uint8_t[:, ::1] u
    cdef const uint8_t[:, ::1] d
    g, u, d = mats
    cdef int64_t I = g.shape[0]
    if I < 32 or I % 32:
        raise ValueError(f"expert {j}: I={I} must be a positive multiple of 32")
    f.gate = _matrix(g, t, <int32_t>I, <int32_t>H, "gate", j)
    f.up = _matrix(u, t, <int32_t>I, <int32_t>H, "up", j)
    f.down = _matrix(d, td, <int32_t>H, <int32_t>I, "down", j)
    f.ldg, f.ldu, f.ldd = g.shape[1], u.shape[1], d.shape[1]
    return I


cdef tuple _interleave(colibri_qffn_t *f, tuple mats):
    """Point ``f``'s Q4_0 matrices (``mats``: gate, up, down) at copies interleaved by eight
    (:func:`interleave`) where that layout has its kernel; returns the copies."""
    cdef const uint8_t[:, ::1] g
    cdef const uint8_t[:, ::1] u
    cdef const uint8_t[:, ::1] d
    if not INTERLEAVE_FAST:
        return ()
    g = u = d = None
    if f.type == COLIBRI_Q4_0:  # I rows: a multiple of 32
        g, u = interleave(mats[0]), interleave(mats[1])
        f.gate, f.up, f.ldg, f.ldu = &g[0, 0], &u[0, 0], g.shape[1], u.shape[1]
        f.type = COLIBRI_Q4_0X8
    if f.down_type == COLIBRI_Q4_0 and f.H % 8 == 0:
        d = interleave(mats[2])
        f.down, f.ldd = &d[0, 0], d.shape[1]
        f.down_type = COLIBRI_Q4_0X8
    return g, u, d


def ffn(qtype, gate, up, down, x, act="silu", int num_threads=0, path=None, down_type=None):
    """One quantized expert's gated FFN on a few rows: ``down @ (act(gate @ x) * (up @ x))``.

    Parameters
    ----------
    qtype : str
        gate's and up's type, one of ``TYPES``.
    gate, up : ndarray of uint8, shape (I, H row bytes)
    down : ndarray of uint8, shape (H, I row bytes)
    x : ndarray of float32, shape (n, H), 1 <= n <= 64
    act : str
        One of ``ACTIVATIONS``.
    num_threads : int
        Threads (the caller and pool helpers); 0: all.
    path : str, optional
        A SIMD path this CPU runs; None: the dispatched one (every path: the same bits).
    down_type : str, optional
        down's type when it differs from ``qtype``.

    Returns
    -------
    ndarray of float32, shape (n, H)
    """
    x = _activations(x, x.shape[1] if np.ndim(x) == 2 else 0)
    n = x.shape[0]
    y = np.zeros(x.shape, np.float32)
    ffn_sum(x, [(gate, up, down)], qtype, act, np.array([0, n], np.int64),
            np.arange(n, dtype=np.int64), np.ones(n, np.float32), y, num_threads, path,
            down_type)  # fmt: skip
    return y


def ffn_sum(const float[:, ::1] x, list experts, qtype, act, const int64_t[::1] bounds,
            const int64_t[::1] rows, const float[::1] scale, float[:, ::1] y,
            int num_threads=0, path=None, down_type=None, float alpha=1.702, float limit=7.0):
    """``y[rows[i]] += scale[i] * ffn_j(x[rows[i]])`` for i in ``[bounds[j], bounds[j + 1])``:
    a layer's quantized experts in one call, two pool runs for all of them.

    Parameters
    ----------
    x : ndarray of float32, shape (T, H), C-contiguous
    experts : list of (gate, up, down)
        C-contiguous uint8 rows of blocks: gate and up ``I`` rows of ``H`` values of
        ``qtype``, down ``H`` rows of ``I`` values of ``down_type`` (default ``qtype``).
        gpt-oss's experts (``qtype`` ``"mxfp4_oss"``, ``act`` ``"gpt_oss"``): tuples
        ``(gate_up, gate_up_scales, gate_up_bias, down, down_scales, down_bias)`` of uint8
        ``[2I, H / 2]`` (gate the even rows, up the odd ones), uint8 ``[2I, H / 32]``,
        float32 ``[2I]``, uint8 ``[H, I / 2]``, uint8 ``[H, I / 32]``, float32 ``[H]``.
    bounds : ndarray of int64, shape (len(experts) + 1,)
        From 0; expert j takes 1 to 64 assignments.
    rows : ndarray of int64, shape (bounds[-1],)
        Rows of x, in [0, T).
    scale : ndarray of float32, shape (bounds[-1],)
    y : ndarray of float32, shape (T, H), C-contiguous
        Added to in place, expert by expert in list order.
    alpha, limit : float
        gpt-oss's SwiGLU: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``,
        ``g = min(gate, limit)``.
    """
    cdef int t = _type(qtype), p = path_index(path)
    cdef int td = t if down_type is None else _type(down_type)
    cdef int a = ACTIVATIONS.get(act, -1)
    cdef Py_ssize_t count = len(experts), j
    cdef int64_t T = x.shape[0], H = x.shape[1], total, I
    if a < 0:
        raise ValueError(f"act must be one of {', '.join(ACTIVATIONS)} (got {act!r})")
    if H % 32 or H < 32 or y.shape[0] != T or y.shape[1] != H:
        raise ValueError(
            f"ffn_sum(): x must be [T, H] with H a multiple of 32 and y like it (got x "
            f"{[T, H]}, y {[y.shape[0], y.shape[1]]})"
        )
    total = check_plan(count, T, bounds, rows, scale)
    if count == 0:
        return
    cdef bint oss = t == COLIBRI_MXFP4_OSS
    if oss != (a == COLIBRI_QFFN_ACT_GPT_OSS) or (oss and td != t):
        raise ValueError(
            f"ffn_sum(): gpt-oss's experts are {MXFP4_OSS} weights with act 'gpt_oss', both "
            f"or neither (got {qtype!r}, act {act!r}, down_type {down_type!r})"
        )
    cdef colibri_qffn_t *f = <colibri_qffn_t *>calloc(count, sizeof(colibri_qffn_t))
    if f == NULL:
        raise MemoryError()
    try:
        for j in range(count):
            if oss:
                I = _gpt_oss_expert(&f[j], experts[j], H, alpha, limit, j)
                if I < 32 or I % 32:
                    raise ValueError(f"expert {j}: I={I} must be a positive multiple of 32")
            else:
                I = _fill(&f[j], experts[j], t, td, H, j)
            f[j].n, f[j].H, f[j].I = <int32_t>(bounds[j + 1] - bounds[j]), <int32_t>H, <int32_t>I
            f[j].type, f[j].down_type, f[j].act, f[j].path = t, td, a, p
        _run(f, count, bounds, rows, scale, total, x, y, num_threads, oss)
    finally:
        free(f)


cdef int _run(colibri_qffn_t *f, Py_ssize_t count, const int64_t[::1] bounds,
              const int64_t[::1] rows, const float[::1] scale, int64_t total,
              const float[:, ::1] x, float[:, ::1] y, int num_threads, bint oss) except -1:
    """``y[rows[i]] += scale[i] * ffn_j(x[rows[i]])``: the experts ``f[:count]`` (weights,
    sizes, types and rows ``n`` set, the plan checked) on their scratch, two pool runs."""
    cdef int64_t H = x.shape[1], G = H // 32, hsize = 0, i, k = 0
    cdef Py_ssize_t j
    cdef int32_t *first = <int32_t *>malloc((count + 1) * sizeof(int32_t))
    cdef char *scratch = NULL
    cdef float *xg
    cdef float *yg
    cdef float *xd
    cdef int8_t *xq
    cdef int32_t *xs
    cdef float *h
    cdef float *hd
    cdef int8_t *hq
    cdef int32_t *hs
    try:
        if first == NULL:
            raise MemoryError()
        for j in range(count):
            hsize += <int64_t>f[j].n * f[j].I
        # one allocation: xg, yg [total, H]; q8 of xg; h [sum n I] and its q8 (4-byte parts
        # first, so every part stays aligned)
        scratch = <char *>malloc(
            (2 * total * H + total * G + hsize + hsize // 32) * sizeof(float)
            + total * G * sizeof(int32_t) + hsize // 32 * sizeof(int32_t)
            + total * H + hsize + 64
        )  # fmt: skip
        if scratch == NULL:
            raise MemoryError()
        xg = <float *>scratch
        yg = xg + total * H
        xd = yg + total * H
        h = xd + total * G
        hd = h + hsize
        xs = <int32_t *>(hd + hsize // 32)
        hs = xs + total * G
        xq = <int8_t *>(hs + hsize // 32)
        hq = xq + total * H
        for j in range(count):
            f[j].xd = xd + bounds[j] * G
            f[j].xq = xq + bounds[j] * H
            f[j].xs = xs + bounds[j] * G
            f[j].h, f[j].hq = h + k, hq + k
            f[j].hd, f[j].hs = hd + k // 32, hs + k // 32
            f[j].y, f[j].ldy = yg + bounds[j] * H, H
            k += <int64_t>f[j].n * f[j].I
        if num_threads < 1:
            num_threads = colibri_max_threads()
        with nogil:
            gather_rows(x, rows, total, xg)
            for i in range(total):
                colibri_q8_row(xg + i * H, <int32_t>H, xd + i * G, xq + i * H, xs + i * G)
                if oss:
                    colibri_q8_oss_order(xq + i * H, <int32_t>H)
            colibri_qffn_run_many(f, <int32_t>count, first, num_threads)
            add_rows(y, rows, scale, total, yg)
    finally:
        free(first)
        free(scratch)
    return 0


cdef int64_t _gpt_oss_expert(colibri_qffn_t *f, tuple expert, int64_t H, float alpha,
                             float limit, Py_ssize_t j) except -1:
    """Fill f's weights from one gpt-oss expert (see :func:`ffn_sum`); its I."""
    if len(expert) != 6:
        raise ValueError(
            f"expert {j}: a gpt-oss expert is (gate_up, gate_up_scales, gate_up_bias, down, "
            f"down_scales, down_bias), got {len(expert)} arrays"
        )
    cdef const uint8_t[:, ::1] gu = expert[0]
    cdef const uint8_t[:, ::1] d = expert[3]
    cdef const uint8_t[:, ::1] gue
    cdef const uint8_t[:, ::1] de
    cdef const float[::1] gub
    cdef const float[::1] db
    cdef int t = COLIBRI_MXFP4_OSS
    cdef int64_t I = gu.shape[0] // 2
    if gu.shape[0] % 2 or I < 1:
        raise ValueError(f"expert {j}: gate_up has {gu.shape[0]} rows; gpt-oss's are 2I, I >= 1")
    f.gate = _matrix(gu, t, <int32_t>(2 * I), <int32_t>H, "gate_up", j)
    f.up = f.gate + gu.shape[1]
    f.down = _matrix(d, t, <int32_t>H, <int32_t>I, "down", j)
    _scales(expert[1], 2 * I, H // 32, f"expert {j}: gate_up")
    _scales(expert[4], H, I // 32, f"expert {j}: down")
    gue, de = expert[1], expert[4]  # C-contiguous: pointers into the caller's arrays
    gub, db = expert[2], expert[5]
    if gub.shape[0] != 2 * I or db.shape[0] != H:
        raise ValueError(
            f"expert {j}: the biases must be float32 [{2 * I}] and [{H}] (got "
            f"[{gub.shape[0]}] and [{db.shape[0]}])"
        )
    f.ldg = f.ldu = 2 * gu.shape[1]
    f.ldd = d.shape[1]
    f.ge, f.ue, f.de = &gue[0, 0], &gue[1, 0], &de[0, 0]
    f.lge = f.lue = 2 * gue.shape[1]
    f.lde = de.shape[1]
    f.bg, f.bu, f.bd, f.ldb = &gub[0], &gub[1], &db[0], 2
    f.alpha, f.limit = alpha, limit
    return I


# ---- quantizers: float rows -> blocks (include/colibri/quantize.h) ---------------------------

cdef extern from "colibri/quantize.h" nogil:
    void colibri_quantize_row(int type, const float *x, int64_t K, uint8_t *out) noexcept


cdef extern from "colibri/pool.h" nogil:
    ctypedef void (*colibri_chunk_fn)(void *arg, int32_t chunk) noexcept nogil
    void colibri_pool_run(colibri_chunk_fn fn, void *arg, int32_t chunks, int threads) noexcept


ctypedef struct _QuantizeJob:
    int type
    const float *x
    uint8_t *out
    int64_t rows, K, row_bytes
    int32_t chunks


cdef void _quantize_chunk(void *arg, int32_t c) noexcept nogil:
    cdef const _QuantizeJob *j = <const _QuantizeJob *>arg
    cdef int64_t r
    for r in range(c * j.rows // j.chunks, (c + 1) * j.rows // j.chunks):
        colibri_quantize_row(j.type, j.x + r * j.K, j.K, j.out + r * j.row_bytes)


#: Types whose blocks hold 32 values (what a row length that is no multiple of 256 can use).
SMALL_BLOCK_TYPES = tuple(name for name in TYPES if colibri_q_block[TYPES[name]] == 32)


def check_row_values(qtype, int values):
    """Raise ValueError unless rows of ``values`` values split into whole ``qtype`` blocks
    (the message names the type, the row length and the types that fit)."""
    cdef int t = _type(qtype, False)
    if values > 0 and values % colibri_q_block[t] == 0:
        return
    if values > 0 and values % 32 == 0:
        hint = f"use a type with 32-value blocks ({', '.join(SMALL_BLOCK_TYPES)})"
    else:
        hint = "no colibri type fits: every block holds a multiple of 32 values"
    raise ValueError(
        f"{qtype} quantizes rows in blocks of {colibri_q_block[t]} values, but these rows hold "
        f"{values} ({values} is not a multiple of {colibri_q_block[t]}); {hint}"
    )


def quantize(x, qtype, int num_threads=0):
    """Float rows -> rows of ``qtype`` blocks, as ggml's reference quantizers make them.

    Parameters
    ----------
    x : ndarray of float32, float16 or bfloat16 (ml_dtypes), shape (rows, K)
        Finite values; K a multiple of ``BLOCK[qtype]`` (256 for the K-quants and iq4_xs,
        32 for the others).
    qtype : str
        One of ``TYPES``.
    num_threads : int
        Threads (the caller and pool helpers); 0: all.

    Returns
    -------
    ndarray of uint8, shape (rows, K // BLOCK[qtype] * BLOCK_BYTES[qtype])
        ``dequantize(qtype, out)`` approximates ``x``.

    Raises
    ------
    TypeError
        ``x`` is not a 2-D float32, float16 or bfloat16 array.
    ValueError
        K is not a multiple of the type's block (naming the type, K and the types that fit),
        or ``x`` holds NaN or inf (naming the first row and column).
    """
    from colibri.layer import _rows

    cdef int t = _type(qtype, False)
    x = np.asarray(x)
    name = x.dtype.name
    if name not in ("float32", "float16", "bfloat16") or x.ndim != 2:
        raise TypeError(
            f"quantize(): x must be a 2-D float32, float16 or bfloat16 array (got {name} "
            f"{list(x.shape)})"
        )
    check_row_values(qtype, x.shape[1])
    cdef int threads = num_threads if num_threads > 0 else colibri_max_threads()
    if name == "float32":
        x = np.ascontiguousarray(x)
    else:
        kind = _rows.KIND_FLOAT16 if name == "float16" else _rows.KIND_BFLOAT16
        wide = np.empty(x.shape, np.float32)
        _rows.to_float32(np.ascontiguousarray(x).view(np.uint16), kind, threads, wide)
        x = wide
    finite = np.isfinite(x)
    if not finite.all():
        r, c = np.argwhere(~finite)[0]
        raise ValueError(
            f"quantize(): the values hold NaN or inf (first at row {r}, column {c}: "
            f"{x[r, c]}); no {qtype} block encodes them: fix or drop the source weights"
        )
    cdef int64_t K = x.shape[1]
    out = np.empty((x.shape[0], K // colibri_q_block[t] * colibri_q_bytes[t]), np.uint8)
    if x.shape[0] == 0:
        return out
    cdef const float[:, ::1] xv = x
    cdef uint8_t[:, ::1] ov = out
    cdef _QuantizeJob job
    job.type = t
    job.x = &xv[0, 0]
    job.out = &ov[0, 0]
    job.rows = x.shape[0]
    job.K = K
    job.row_bytes = out.shape[1]
    job.chunks = <int32_t>min(x.shape[0], 4 * threads)
    with nogil:
        colibri_pool_run(_quantize_chunk, &job, job.chunks, threads)
    return out


cdef class Held:
    """A layer's held experts for decode steps in one call: each expert's weights as the
    kernel takes them, set once (:meth:`hold` for block-quantized experts, :meth:`hold_half`
    for float16 / bfloat16 ones; the arrays are kept alive here), and :meth:`step`, which
    routes rows to them, runs the kernel and writes the weighted sum in the caller's dtype,
    with no Python object per expert. One kind of experts a layer.

    Parameters
    ----------
    num_experts : int
        ``E``.
    hidden : int
        ``H`` (a multiple of 32 for quantized experts).
    act : str
        The gate activation (:data:`ACTIVATIONS`, not ``"gpt_oss"``).
    max_rows : int
        Rows of one expert up to which a step runs (1 to the kernel's most).
    path : str, optional
        A SIMD path this CPU runs; None: the dispatched one (every path: the same bits).

    Notes
    -----
    Where colibri's x86 kernels are built, Q4_0 matrices of a multiple of 8 rows are held
    as a copy with their rows interleaved by eight (``include/colibri/quant.h``'s
    ``COLIBRI_Q4_0X8``; the same bits, 1.7-1.9x the speed of a Q4_0 row at a time on a Zen 3
    core): the held bytes live twice, the file's pages left for the OS to reclaim.
    """

    cdef colibri_qffn_t *forms
    cdef colibri_ffn_t *halves
    cdef unsigned char *held
    cdef readonly int64_t num_experts, hidden
    cdef int t, td, half, act, path, max_rows
    cdef list keep
    #: After a step that returned 1: the experts not held; after 0: the step's experts.
    cdef readonly list missing, active
    # a step's plan and rows, kept for the next (made anew while a step of another thread
    # runs): a decoding step's dozen arrays cost more than its native work on small layers
    cdef int64_t[::1] counts, bounds, starts, rows
    cdef float[::1] scale
    cdef float[:, ::1] xs, ys
    cdef bint busy

    def __cinit__(self, int64_t num_experts, int64_t hidden, act, int max_rows, path=None):
        self.forms = <colibri_qffn_t *>calloc(max(num_experts, 1), sizeof(colibri_qffn_t))
        self.halves = <colibri_ffn_t *>calloc(max(num_experts, 1), sizeof(colibri_ffn_t))
        self.held = <unsigned char *>calloc(max(num_experts, 1), 1)
        if self.forms == NULL or self.halves == NULL or self.held == NULL:
            raise MemoryError()
        self.act = ACTIVATIONS.get(act, -1)  # _ffn's numbers of these four too
        if self.act < 0 or self.act == COLIBRI_QFFN_ACT_GPT_OSS:
            raise ValueError(f"Held(): act must be one of silu, gelu_tanh, gelu, relu ({act!r})")
        if num_experts < 1 or hidden < 1:
            raise ValueError(f"Held(): E={num_experts} and H={hidden} must be >= 1")
        if not 1 <= max_rows <= COLIBRI_FFN_MAX_ROWS:
            raise ValueError(f"Held(): max_rows={max_rows} must be 1 to {COLIBRI_FFN_MAX_ROWS}")
        self.num_experts, self.hidden, self.max_rows = num_experts, hidden, max_rows
        self.t = self.td = -1
        self.half = 0
        self.path = path_index(path)
        self.keep = [None] * num_experts
        self.missing, self.active = [], []
        self.counts = np.zeros(num_experts + 1, np.int64)
        self.bounds = np.empty(num_experts + 1, np.int64)
        self.starts = np.empty(num_experts, np.int64)
        self._scratch(1, 1)

    cdef int _scratch(self, int64_t T, int64_t n) except -1:
        """Room in the kept arrays for a step of ``T`` rows and ``n`` choices (the arrays
        not made yet have shape 0)."""
        if self.rows.shape[0] < n:
            self.rows = np.empty(max(n, 1), np.int64)
            self.scale = np.empty(max(n, 1), np.float32)
        if self.ys.shape[0] < T:
            self.xs = np.empty((max(T, 1), self.hidden), np.float32)
            self.ys = np.empty((max(T, 1), self.hidden), np.float32)
        return 0

    def __dealloc__(self):
        free(self.forms)
        free(self.halves)
        free(self.held)

    def hold(self, int64_t e, tuple mats, qtype, down_type) -> bool:
        """Keep expert ``e``'s ``(gate, up, down)`` (as :func:`ffn_sum` takes them); False,
        holding nothing, when its types differ from the experts held before (one kind a
        layer: the kernel's one call)."""
        if not 0 <= e < self.num_experts:
            raise ValueError(f"hold(): expert {e} outside [0, {self.num_experts})")
        if self.hidden % 32:
            raise ValueError(f"hold(): quantized experts' H={self.hidden} must be a multiple "
                             f"of 32")
        cdef int t = _type(qtype, False), td = _type(down_type, False)
        if self.half or (self.t >= 0 and (t, td) != (self.t, self.td)):
            return False
        cdef colibri_qffn_t *f = &self.forms[e]
        f.I = <int32_t>_fill(f, mats, t, td, self.hidden, e)
        f.H, f.type, f.down_type, f.act, f.path = <int32_t>self.hidden, t, td, self.act, self.path
        self.t, self.td = t, td
        self.keep[e] = (mats, _interleave(f, mats))
        self.held[e] = 1
        return True

    def hold_half(self, int64_t e, tuple mats, int kind) -> bool:
        """Keep expert ``e``'s ``(gate [I, H], up [I, H], down [H, I])``: uint16 bits of
        float16 / bfloat16 (``kind``: half.h's ``COLIBRI_W_F16`` / ``COLIBRI_W_BF16``), rows
        contiguous (as :func:`colibri.layer._ffn.ffn_sum` takes them); False, holding
        nothing, when the experts held before are of another kind."""
        if not 0 <= e < self.num_experts:
            raise ValueError(f"hold_half(): expert {e} outside [0, {self.num_experts})")
        if kind != COLIBRI_W_F16 and kind != COLIBRI_W_BF16:
            raise ValueError(f"hold_half(): kind must be COLIBRI_W_F16 or COLIBRI_W_BF16 ({kind})")
        if self.t >= 0 or (self.half and kind != self.half):
            return False
        cdef const uint16_t[:, :] g, u, d
        g, u, d = mats
        cdef int64_t H = self.hidden, I = g.shape[0]
        if I < 1 or g.shape[1] != H or u.shape[0] != I or u.shape[1] != H or d.shape[0] != H \
                or d.shape[1] != I:
            raise ValueError(f"hold_half(): expert {e} must be gate/up [I, {H}] and down "
                             f"[{H}, I] (got {tuple(g.shape)}, {tuple(u.shape)}, "
                             f"{tuple(d.shape)})")
        cdef colibri_ffn_t *f = &self.halves[e]
        f.H, f.I = <int32_t>H, <int32_t>I
        ffn_weights(f, g, u, d, kind, self.act, self.path)
        self.half = kind
        self.keep[e] = mats
        self.held[e] = 1
        return True

    def step(self, x, const int64_t[:, ::1] ids, weights, out, int kind, int num_threads=0,
             residual=None, bint rounded=False):
        """``out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` (negative ids: none)
        as :func:`ffn_sum` computes it, rounded once to ``kind``; with ``residual`` (like
        ``x``), ``residual[t]`` plus that rounded sum, rounded to ``kind`` again (torch's add
        of two tensors of ``kind``).

        ``x`` and ``out`` ``[T, H]``, C-contiguous: float32 (``kind`` 0) or the uint16 bits
        of float16 / bfloat16 (half.h's ``COLIBRI_W_F16`` / ``COLIBRI_W_BF16``); ``weights``
        ``[T, k]`` float32 or uint16 bits of ``kind``; ``rounded``: float32 weights rounded to
        ``kind`` first (a router's ``.to(dtype)``). Returns 0: computed (``active``: the
        step's experts); 1: experts not held (``missing``), nothing written; 2: an expert has
        more than ``max_rows`` rows; 3: a sum is not finite (the caller's slower path names
        the cause). ValueError for an id at or past ``E`` or a wrong shape.
        """
        cdef bint own = not self.busy  # the kept arrays are free
        self.busy = True
        try:
            return self._step(x, ids, weights, out, kind, num_threads, residual, rounded, own)
        finally:
            if own:
                self.busy = False

    cdef int _step(self, x, const int64_t[:, ::1] ids, weights, out, int kind, int num_threads,
                   residual, bint rounded, bint own) except -1:
        cdef int64_t T = ids.shape[0], k = ids.shape[1], n = T * k, H = self.hidden
        cdef int64_t E = self.num_experts, a, e, total = 0, i, c
        cdef Py_ssize_t count = 0, j
        cdef const float[:, ::1] xf32
        cdef const uint16_t[:, ::1] xbits
        cdef const float[:, ::1] wf32
        cdef const uint16_t[:, ::1] wbits
        cdef float[:, ::1] of32
        cdef uint16_t[:, ::1] obits
        cdef const float[:, ::1] rf32
        cdef const uint16_t[:, ::1] rbits
        cdef bint add = residual is not None
        cdef float y
        cdef int64_t[::1] counts, bounds, starts, rows
        cdef float[::1] scale
        cdef float[:, ::1] xs, ys
        cdef const float[:, ::1] xin
        if kind == 0:
            xf32, of32 = x, out
            if xf32.shape[0] != T or xf32.shape[1] != H or of32.shape[0] != T or of32.shape[1] != H:
                raise ValueError(f"step(): x and out must be [{T}, {H}]")
            if add:
                rf32 = residual
                if rf32.shape[0] != T or rf32.shape[1] != H:
                    raise ValueError(f"step(): residual must be [{T}, {H}] like x")
        elif kind == COLIBRI_W_F16 or kind == COLIBRI_W_BF16:
            xbits, obits = x, out
            if xbits.shape[0] != T or xbits.shape[1] != H or obits.shape[0] != T \
                    or obits.shape[1] != H:
                raise ValueError(f"step(): x and out must be [{T}, {H}]")
            if add:
                rbits = residual
                if rbits.shape[0] != T or rbits.shape[1] != H:
                    raise ValueError(f"step(): residual must be [{T}, {H}] like x")
        else:
            raise ValueError(f"step(): kind must be 0, COLIBRI_W_F16 or COLIBRI_W_BF16 ({kind})")
        cdef bint wplain = np.asarray(weights).dtype == np.float32
        if wplain:
            wf32 = weights
            if wf32.shape[0] != T or wf32.shape[1] != k:
                raise ValueError(f"step(): weights must be [{T}, {k}] like ids")
        else:
            wbits = weights
            if wbits.shape[0] != T or wbits.shape[1] != k or kind == 0:
                raise ValueError(f"step(): weights must be [{T}, {k}] float32 or {kind}'s bits")
        if own:
            self._scratch(T, n)
            counts = self.counts
            bounds = self.bounds
            starts = self.starts
            rows = self.rows
            scale = self.scale
            xs = self.xs[:T]
            ys = self.ys[:T]
            counts[:] = 0
        else:
            counts = np.zeros(E + 1, np.int64)
            bounds = np.empty(E + 1, np.int64)
            starts = np.empty(E, np.int64)
            rows = np.empty(max(n, 1), np.int64)
            scale = np.empty(max(n, 1), np.float32)
            if kind:  # float32 rows are read in place
                xs = np.empty((T, H), np.float32)
            ys = np.empty((T, H), np.float32)
        for a in range(n):
            e = ids[a // k, a % k]
            if e >= E:
                raise ValueError(
                    f"expert id {e} at token {a // k}, choice {a % k} is out of range [0, {E}): "
                    f"ids must come from a router over {E} experts"
                )
            if e >= 0:
                counts[e] += 1
        active = [e for e in range(E) if counts[e]]
        missing = [e for e in active if not self.held[e]]
        if missing:
            self.missing = missing
            return 1
        for e in active:
            if counts[e] > self.max_rows:
                return 2
        count = len(active)
        for j in range(count):
            e = active[j]
            bounds[j] = total
            starts[e] = total
            total += counts[e]
        bounds[count] = total
        for a in range(n):  # token order within an expert: the engine's stable plan
            e = ids[a // k, a % k]
            if e < 0:
                continue
            i = starts[e]
            starts[e] = i + 1
            rows[i] = a // k
            if wplain:
                scale[i] = wf32[a // k, a % k]
                if rounded and kind == COLIBRI_W_BF16:
                    scale[i] = colibri_bf16_to_float(colibri_float_to_bf16(scale[i]))
                elif rounded and kind == COLIBRI_W_F16:
                    scale[i] = colibri_half_to_float(colibri_float_to_half(scale[i]))
            elif kind == COLIBRI_W_BF16:
                scale[i] = colibri_bf16_to_float(wbits[a // k, a % k])
            else:
                scale[i] = colibri_half_to_float(wbits[a // k, a % k])
        ys[:, :] = 0
        if kind:
            xin = xs
            with nogil:
                for i in range(T):
                    for c in range(H):
                        if kind == COLIBRI_W_BF16:
                            xs[i, c] = colibri_bf16_to_float(xbits[i, c])
                        else:
                            xs[i, c] = colibri_half_to_float(xbits[i, c])
        else:
            xin = xf32
        self._run(active, counts, bounds, rows, scale, total, xin, ys, num_threads)
        cdef bint finite = True
        with nogil:
            for i in range(T * H):
                if not isfinite((&ys[0, 0])[i]):
                    finite = False
                    break
        if not finite:
            return 3
        with nogil:
            for i in range(T):
                for c in range(H):
                    if kind == 0:
                        of32[i, c] = rf32[i, c] + ys[i, c] if add else ys[i, c]
                    elif kind == COLIBRI_W_BF16:
                        if add:
                            y = colibri_bf16_to_float(colibri_float_to_bf16(ys[i, c]))
                            obits[i, c] = colibri_float_to_bf16(
                                colibri_bf16_to_float(rbits[i, c]) + y)
                        else:
                            obits[i, c] = colibri_float_to_bf16(ys[i, c])
                    elif add:
                        y = colibri_half_to_float(colibri_float_to_half(ys[i, c]))
                        obits[i, c] = colibri_float_to_half(colibri_half_to_float(rbits[i, c]) + y)
                    else:
                        obits[i, c] = colibri_float_to_half(ys[i, c])
        self.active = active
        return 0

    cdef int _run(self, list active, const int64_t[::1] counts, const int64_t[::1] bounds,
                  const int64_t[::1] rows, const float[::1] scale, int64_t total,
                  const float[:, ::1] xs, float[:, ::1] ys, int num_threads) except -1:
        """The step's experts (copies of their held forms, with their row counts) through
        the kernel of their kind: block-quantized (qffn.h) or half precision (ffn.h)."""
        cdef Py_ssize_t j, count = len(active)
        cdef size_t size = sizeof(colibri_ffn_t) if self.half else sizeof(colibri_qffn_t)
        cdef void *forms = malloc(max(count, 1) * size)
        cdef colibri_qffn_t *q = <colibri_qffn_t *>forms
        cdef colibri_ffn_t *h = <colibri_ffn_t *>forms
        cdef int64_t e
        if forms == NULL:
            raise MemoryError()
        try:
            for j in range(count):
                e = active[j]
                if self.half:
                    h[j] = self.halves[e]
                    h[j].n = <int32_t>counts[e]
                else:
                    q[j] = self.forms[e]
                    q[j].n = <int32_t>counts[e]
            if count and self.half:
                ffn_run_sum(h, count, bounds, rows, scale, total, xs, ys,
                            num_threads if num_threads > 0 else colibri_max_threads())
            elif count:
                _run(q, count, bounds, rows, scale, total, xs, ys, num_threads, False)
        finally:
            free(forms)
        return 0
