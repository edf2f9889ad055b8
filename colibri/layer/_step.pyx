"""A decoder layer's one-token step in two calls, for a model whose every kernel is colibri's.

:func:`enter` runs ``norm -> q, k, v projections -> per-head q / k norms -> rotary
embedding``; the caller appends ``k``, ``v`` to its cache; :func:`leave` runs ``attention ->
o projection -> residual add -> norm -> router logits``. Each step is the kernel the separate
calls run (``rms_norm``, ``quant_linear`` / ``half_linear``, ``rope``, ``attention``), in the
same order with the same roundings to the storage type between them, so the values equal the
separate calls' bit for bit; what goes is the interpreter between them (a dozen Python-level
calls a layer, each 2-5x its own cost while the weights stream through the caches).

A projection is ``(weight, code, bias, threads)``: ``code`` ``"bfloat16"`` / ``"float16"``
for a half-precision weight's uint16 bits ``[out, in]`` (``include/colibri/linear.h``), or a
quantized type (or ``"q4_0x8"``, Q4_0 rows interleaved by eight) for rows of blocks
``[out, row_bytes]`` (``include/colibri/qlinear.h``, the
input quantized to q8 once and shared by the projections of one input); ``bias`` float32
``[out]`` or None; ``threads`` colibri's threads (< 1: its default).
"""

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport free, malloc

from colibri._openmp cimport colibri_max_threads
from colibri._pool cimport share_pool
from colibri.layer._attention cimport head_stride
from colibri.layer._half cimport (
    COLIBRI_W_BF16,
    COLIBRI_W_F16,
    check_kind,
    load_value,
    store_value,
    value_t,
)
from colibri.layer._kernels cimport (
    colibri_attend,
    colibri_attend_t,
    colibri_linear_run,
    colibri_linear_t,
    colibri_q8_row,
    colibri_qlinear_run,
    colibri_qlinear_t,
)
from colibri.layer._norm cimport norm_rows
from colibri.layer._rope cimport rope_rows

from colibri.layer._ffn import path_index
from colibri.layer._quant import Q4_0X8, TYPES, linear_type, row_values

share_pool()  # one worker pool a process (colibri/_pool.pyx)


_HALF = {"float16": COLIBRI_W_F16, "bfloat16": COLIBRI_W_BF16}


cdef struct proj_t:
    const uint8_t *blocks  # quantized rows (qtype >= 0)
    const uint16_t *bits  # half-precision rows (qtype < 0)
    int64_t ldw  # bytes (quantized) or values (half) from one row to the next
    int32_t out_dim
    int32_t qtype  # quant.h's type, or -1: half precision of kind wkind
    int32_t wkind
    int threads
    const float *bias


cdef int _proj(object spec, int32_t in_dim, int32_t out_dim, proj_t *p, str what) except -1:
    """Read a projection ``(weight, code, bias, threads)`` of ``[out_dim, in_dim]``."""
    weight, code, bias, threads = spec
    cdef const uint8_t[:, ::1] blocks
    cdef const uint16_t[:, ::1] bits
    cdef const float[::1] b
    cdef int64_t values
    if code in _HALF:
        bits = weight
        if bits.shape[0] != out_dim or bits.shape[1] != in_dim:
            raise ValueError(f"{what}: the weight must be [{out_dim}, {in_dim}] (got "
                             f"[{bits.shape[0]}, {bits.shape[1]}])")
        p.bits, p.ldw, p.qtype, p.wkind = &bits[0, 0], in_dim, -1, _HALF[code]
    else:
        if code not in TYPES and code != Q4_0X8:
            raise ValueError(f"{what}: the weight type must be one of "
                             f"{', '.join([*_HALF, *TYPES, Q4_0X8])} (got {code!r})")
        blocks = weight
        values = row_values(code, blocks.shape[1])
        if blocks.shape[0] != out_dim or values != in_dim:
            raise ValueError(f"{what}: the weight must be {out_dim} rows of {in_dim} {code} "
                             f"values (got {blocks.shape[0]} rows of {values})")
        p.blocks, p.ldw, p.wkind = &blocks[0, 0], blocks.shape[1], 0
        p.qtype = linear_type(code, out_dim)
    p.out_dim = out_dim
    p.threads = threads if threads >= 1 else colibri_max_threads()
    p.bias = NULL
    if bias is not None:
        b = bias
        if b.shape[0] != out_dim:
            raise ValueError(f"{what}: the bias must be float32 [{out_dim}] (got "
                             f"[{b.shape[0]}])")
        p.bias = &b[0]
    return 0


# One input row as the projections read it: float32, and its q8 blocks once made.
cdef struct input_t:
    float *x
    float *d
    int8_t *q
    int32_t *s
    uint16_t *split  # linear.h's bf16 scratch
    int32_t K
    bint quantized


cdef int _input(input_t *a, int32_t K) except -1:
    """Scratch for one row of ``K`` values (K a multiple of 32 for quantized projections)."""
    cdef char *m = <char *>malloc(<size_t>K * (4 + 1 + 4) + 8 * (<size_t>K // 32 + 1))
    if m == NULL:
        raise MemoryError()
    a.x = <float *>m
    a.split = <uint16_t *>(m + 4 * <size_t>K)
    a.d = <float *>(m + 8 * <size_t>K)
    a.s = <int32_t *>(m + 8 * <size_t>K + 4 * (<size_t>K // 32 + 1))
    a.q = <int8_t *>(m + 8 * <size_t>K + 8 * (<size_t>K // 32 + 1))
    a.K = K
    a.quantized = False
    return 0


cdef void _project(proj_t *p, input_t *a, int path, float *y) noexcept nogil:
    """``y [out] = W . a.x (+ bias)``, float32: the kernel ``half_linear`` / ``quant_linear``
    runs for one row."""
    cdef colibri_linear_t h
    cdef colibri_qlinear_t f
    if p.qtype < 0:
        h.n, h.in_dim, h.out_dim, h.kind, h.path = 1, a.K, p.out_dim, p.wkind, path
        h.x, h.ldx, h.w, h.ldw, h.bias = a.x, a.K, p.bits, p.ldw, p.bias
        h.xs, h.y, h.ldy = a.split, y, p.out_dim
        colibri_linear_run(&h, p.threads)
        return
    if not a.quantized:
        colibri_q8_row(a.x, a.K, a.d, a.q, a.s)
        a.quantized = True
    f.n, f.in_dim, f.out_dim, f.type, f.path = 1, a.K, p.out_dim, p.qtype, path
    f.xd, f.xq, f.xs, f.w, f.ldw, f.bias = a.d, a.q, a.s, p.blocks, p.ldw, p.bias
    f.y, f.ldy = y, p.out_dim
    colibri_qlinear_run(&f, p.threads)


def enter(const value_t[::1] x, const value_t[::1] norm, float eps, tuple projections,
          const value_t[::1] q_norm, float q_eps, const value_t[::1] k_norm, float k_eps,
          const value_t[::1] cos, const value_t[::1] sin, value_t[:, ::1] q,
          value_t[:, ::1] k, value_t[:, ::1] v, int kind):
    """``h = rms_norm(x)``; ``q, k, v = h @ Wq.T, h @ Wk.T, h @ Wv.T`` (each rounded to the
    storage type); ``q``, ``k`` rows normed by ``q_norm`` / ``k_norm`` (None: not normed;
    a weight of ``n`` values norms each ``n`` values) and rotated by ``cos``, ``sin``.

    ``x``, ``norm`` ``[H]``; ``projections`` the three projections (module docstring);
    ``cos``, ``sin`` ``[D]``; ``q`` ``[Hq, D]``, ``k``, ``v`` ``[Hkv, D]`` written. float32
    (``kind`` 0), or the uint16 bits of ``kind``'s half type.
    """
    cdef Py_ssize_t H = x.shape[0], D = q.shape[1], Hq = q.shape[0], Hkv = k.shape[0]
    check_kind(<const value_t *>NULL, kind, "pre_attention()")
    if (norm.shape[0] != H or k.shape[1] != D or v.shape[0] != Hkv or v.shape[1] != D
            or cos.shape[0] != D or sin.shape[0] != D or D % 2 or H == 0 or D == 0
            or Hq == 0 or Hkv == 0):
        raise ValueError(
            f"pre_attention(): x [{H}], norm [{norm.shape[0]}], q [{Hq}, {D}], k [{Hkv}, "
            f"{k.shape[1]}], v [{v.shape[0]}, {v.shape[1]}], cos [{cos.shape[0]}], sin "
            f"[{sin.shape[0]}]: norm must be [H], k and v [Hkv, D], cos and sin [D], D even"
        )
    if q_norm is not None and (q_norm.shape[0] == 0 or Hq * D % q_norm.shape[0]):
        raise ValueError(f"pre_attention(): q_norm [{q_norm.shape[0]}] must divide q's "
                         f"{Hq * D} values")
    if k_norm is not None and (k_norm.shape[0] == 0 or Hkv * D % k_norm.shape[0]):
        raise ValueError(f"pre_attention(): k_norm [{k_norm.shape[0]}] must divide k's "
                         f"{Hkv * D} values")
    if len(projections) != 3:
        raise ValueError("pre_attention(): projections must be (q, k, v)")
    cdef proj_t p[3]
    cdef value_t *outs[3]
    cdef Py_ssize_t sizes[3]
    sizes[0], sizes[1], sizes[2] = Hq * D, Hkv * D, Hkv * D
    outs[0], outs[1], outs[2] = &q[0, 0], &k[0, 0], &v[0, 0]
    cdef int j
    for j, what in enumerate(("q", "k", "v")):
        _proj(projections[j], <int32_t>H, <int32_t>sizes[j], &p[j], f"pre_attention(): {what}")
    cdef int path = path_index(None)
    cdef input_t a
    cdef Py_ssize_t i
    cdef float *y = <float *>malloc(<size_t>Hq * D * sizeof(float))
    cdef value_t *h = <value_t *>malloc(<size_t>H * sizeof(value_t))
    a.x = NULL
    try:
        if y == NULL or h == NULL:
            raise MemoryError()
        _input(&a, <int32_t>H)
        with nogil:
            norm_rows(&x[0], &norm[0], 1, H, eps, h, kind)
            for i in range(H):
                a.x[i] = load_value(h, i, kind)
            for j in range(3):
                _project(&p[j], &a, path, y)
                for i in range(sizes[j]):
                    store_value(outs[j], i, y[i], kind)
    finally:
        free(y)
        free(h)
        free(a.x)
    with nogil:
        if q_norm is not None:
            norm_rows(&q[0, 0], &q_norm[0], Hq * D // q_norm.shape[0], q_norm.shape[0], q_eps,
                      &q[0, 0], kind)
        if k_norm is not None:
            norm_rows(&k[0, 0], &k_norm[0], Hkv * D // k_norm.shape[0], k_norm.shape[0], k_eps,
                      &k[0, 0], kind)
        rope_rows(&q[0, 0], &cos[0], &sin[0], Hq, D, kind)
        rope_rows(&k[0, 0], &cos[0], &sin[0], Hkv, D, kind)


def leave(const value_t[:, ::1] q, const value_t[:, :, :] keys,
          const value_t[:, :, :] values, float scale, tuple o_proj,
          const value_t[::1] x, const value_t[::1] norm, float eps, object router,
          value_t[::1] x_out, value_t[::1] h, value_t[::1] logits, int kind):
    """``a = attention(q, keys, values)``; ``x_out = x + a @ Wo.T``; ``h = rms_norm(x_out)``;
    ``logits = h @ Wr.T`` (``router`` None: not computed), each rounded to the storage type.

    ``q`` ``[Hq, D]``; ``keys``, ``values`` ``[Hkv, L, D]`` (the cache, this token's row
    last; each head's rows packed, the heads any distance apart); ``o_proj``, ``router``
    projections (module docstring); ``x``, ``norm``, ``x_out``, ``h`` ``[H]``; ``logits``
    ``[E]``. float32 (``kind`` 0), or the uint16 bits of ``kind``'s half type.
    """
    cdef Py_ssize_t Hq = q.shape[0], D = q.shape[1], H = x.shape[0]
    cdef Py_ssize_t Hkv = keys.shape[0], L = keys.shape[1], E = logits.shape[0]
    check_kind(<const value_t *>NULL, kind, "post_attention()")
    if (Hkv == 0 or Hq % Hkv or keys.shape[2] != D or values.shape[0] != Hkv
            or values.shape[1] != L or values.shape[2] != D or L == 0 or D == 0 or H == 0
            or norm.shape[0] != H or x_out.shape[0] != H or h.shape[0] != H):
        raise ValueError(
            f"post_attention(): q [{Hq}, {D}], keys [{Hkv}, {L}, {keys.shape[2]}], values "
            f"[{values.shape[0]}, {values.shape[1]}, {values.shape[2]}], x [{H}], norm "
            f"[{norm.shape[0]}], x_out [{x_out.shape[0]}], h [{h.shape[0]}]: keys and values "
            "must be [Hkv, L, D] with L > 0 and Hkv dividing Hq; norm, x_out, h [H]"
        )
    cdef proj_t o, r
    _proj(o_proj, <int32_t>(Hq * D), <int32_t>H, &o, "post_attention(): o_proj")
    cdef bint routed = router is not None
    if routed:
        _proj(router, <int32_t>H, <int32_t>E, &r, "post_attention(): router")
    cdef int path = path_index(None)
    cdef colibri_attend_t at
    cdef input_t a, b
    cdef Py_ssize_t i
    cdef float f
    cdef int failed
    cdef value_t t
    cdef value_t *out = <value_t *>malloc(<size_t>Hq * D * sizeof(value_t))
    cdef float *y = <float *>malloc(<size_t>(H + E) * sizeof(float))
    if out == NULL or y == NULL:
        free(out)
        free(y)
        raise MemoryError()
    a.x = b.x = NULL
    try:
        _input(&a, <int32_t>(Hq * D))
        _input(&b, <int32_t>H)
        at.ldk = head_stride(keys, "keys", "post_attention()")
        at.ldv = head_stride(values, "values", "post_attention()")
        at.q, at.k, at.v, at.out, at.mask = &q[0, 0], &keys[0, 0, 0], &values[0, 0, 0], out, NULL
        at.Hq, at.Hkv, at.T, at.L, at.D, at.scale, at.kind = Hq, Hkv, 1, L, D, scale, kind
        at.threads = o.threads  # the o projection's: the layer's threads
        with nogil:
            failed = colibri_attend(&at, path)
            if not failed:
                for i in range(Hq * D):
                    a.x[i] = load_value(out, i, kind)
                _project(&o, &a, path, y)
                for i in range(H):
                    f = store_value(&t, 0, y[i], kind)  # the projection, rounded
                    store_value(&x_out[0], i, load_value(&x[0], i, kind) + f, kind)
                norm_rows(&x_out[0], &norm[0], 1, H, eps, &h[0], kind)
                if routed:
                    for i in range(H):
                        b.x[i] = load_value(&h[0], i, kind)
                    _project(&r, &b, path, y + H)
                    for i in range(E):
                        store_value(&logits[0], i, y[H + i], kind)
        if failed:
            raise MemoryError()
    finally:
        free(out)
        free(y)
        free(a.x)
        free(b.x)
