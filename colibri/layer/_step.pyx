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

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport free, malloc

from colibri._openmp cimport colibri_max_threads
from colibri._pool cimport COLIBRI_POOL_WARM_RANGES, colibri_pool_warm, share_pool
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
    colibri_linear_run_many,
    colibri_linear_t,
    colibri_q8_row,
    colibri_qlinear_run,
    colibri_qlinear_run_many,
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


cdef void _half_form(colibri_linear_t *h, proj_t *p, input_t *a, int path,
                     float *y) noexcept nogil:
    """The kernel call of a half-precision projection ``p`` of ``a.x`` into ``y``."""
    h.n, h.in_dim, h.out_dim, h.kind, h.path = 1, a.K, p.out_dim, p.wkind, path
    h.x, h.ldx, h.w, h.ldw, h.bias = a.x, a.K, p.bits, p.ldw, p.bias
    h.xs, h.y, h.ldy = a.split, y, p.out_dim


cdef void _quant_form(colibri_qlinear_t *f, proj_t *p, input_t *a, int path,
                      float *y) noexcept nogil:
    """The kernel call of a quantized projection ``p`` of ``a.x`` into ``y`` (``a``'s q8
    blocks made at the first)."""
    if not a.quantized:
        colibri_q8_row(a.x, a.K, a.d, a.q, a.s)
        a.quantized = True
    f.n, f.in_dim, f.out_dim, f.type, f.path = 1, a.K, p.out_dim, p.qtype, path
    f.xd, f.xq, f.xs, f.w, f.ldw, f.bias = a.d, a.q, a.s, p.blocks, p.ldw, p.bias
    f.y, f.ldy = y, p.out_dim


cdef void _project(proj_t *p, input_t *a, int path, float *y) noexcept nogil:
    """``y [out] = W . a.x (+ bias)``, float32: the kernel ``half_linear`` / ``quant_linear``
    runs for one row."""
    cdef colibri_linear_t h
    cdef colibri_qlinear_t f
    if p.qtype < 0:
        _half_form(&h, p, a, path, y)
        colibri_linear_run(&h, p.threads)
    else:
        _quant_form(&f, p, a, path, y)
        colibri_qlinear_run(&f, p.threads)


cdef void _project3(proj_t *p, input_t *a, int path, float *y) noexcept nogil:
    """``y = (p[0] . a.x, p[1] . a.x, p[2] . a.x)`` one after another: in one pool run (their
    rows' chunks in one index space: one wait for the threads, not three) when the three are
    all quantized or all half precision of one kind on the same threads, else one by one.
    The values are :func:`_project`'s either way."""
    cdef colibri_qlinear_t f[3]
    cdef colibri_linear_t h[3]
    cdef int32_t first[4]
    cdef int j
    cdef float *at = y
    cdef bint quantized = p[0].qtype >= 0, together = True
    for j in range(1, 3):
        together = together and (p[j].qtype >= 0) == quantized and p[j].threads == p[0].threads \
            and (quantized or p[j].wkind == p[0].wkind)
    for j in range(3):
        if not together:
            _project(&p[j], a, path, at)
        elif quantized:
            _quant_form(&f[j], &p[j], a, path, at)
        else:
            _half_form(&h[j], &p[j], a, path, at)
        at += p[j].out_dim
    if together and quantized:
        colibri_qlinear_run_many(f, 3, first, p[0].threads)
    elif together:
        colibri_linear_run_many(h, 3, first, p[0].threads)


cdef void _enter_rows(const value_t *x, const value_t *norm, Py_ssize_t H, float eps,
                      proj_t *p, input_t *a, int path, float *y, value_t *h, value_t **outs,
                      const value_t *q_norm, Py_ssize_t nq, float q_eps,
                      const value_t *k_norm, Py_ssize_t nk, float k_eps,
                      const value_t *cos, const value_t *sin, Py_ssize_t Hq, Py_ssize_t Hkv,
                      Py_ssize_t D, int kind) noexcept nogil:
    """:func:`enter`'s work: ``outs`` ``(q [Hq, D], k [Hkv, D], v [Hkv, D])`` from ``x [H]``
    (``h``: ``[H]`` scratch, ``y``: ``(Hq + 2 Hkv) * D`` floats, ``a``: an input of ``H``); a NULL
    norm weight: not normed (``nq``, ``nk``: the norms' sizes)."""
    cdef Py_ssize_t i, sizes[3]
    cdef int j
    sizes[0], sizes[1], sizes[2] = Hq * D, Hkv * D, Hkv * D
    norm_rows(x, norm, 1, H, eps, h, kind, path)
    for i in range(H):
        a.x[i] = load_value(h, i, kind)
    _project3(p, a, path, y)
    for j in range(3):
        for i in range(sizes[j]):
            store_value(outs[j], i, y[i], kind)
        y += sizes[j]
    if q_norm != NULL:
        norm_rows(outs[0], q_norm, Hq * D // nq, nq, q_eps, outs[0], kind, path)
    if k_norm != NULL:
        norm_rows(outs[1], k_norm, Hkv * D // nk, nk, k_eps, outs[1], kind, path)
    rope_rows(outs[0], cos, sin, Hq, D, kind, path)
    rope_rows(outs[1], cos, sin, Hkv, D, kind, path)


cdef int _leave_rows(colibri_attend_t *at, proj_t *o, proj_t *r, input_t *a, input_t *b,
                     int path, value_t *out, float *y, const value_t *x, const value_t *norm,
                     float eps, value_t *x_out, value_t *h, value_t *logits, Py_ssize_t H,
                     Py_ssize_t E) noexcept nogil:
    """:func:`leave`'s work after its checks: the attention ``at`` into ``out`` (``Hq * D``
    scratch; ``at.out`` is set here), then ``x_out``, ``h`` and (``r`` not NULL) ``logits``;
    ``y``: ``H + E`` floats, ``a``: an input of ``Hq * D``, ``b`` of ``H``. Nonzero when the
    attention could not allocate its scratch."""
    cdef Py_ssize_t i
    cdef float f
    cdef value_t t
    cdef int kind = at.kind
    at.out = out
    if colibri_attend(at, path):
        return 1
    for i in range(at.Hq * at.D):
        a.x[i] = load_value(out, i, kind)
    _project(o, a, path, y)
    for i in range(H):
        f = store_value(&t, 0, y[i], kind)  # the projection, rounded
        store_value(x_out, i, load_value(x, i, kind) + f, kind)
    norm_rows(x_out, norm, 1, H, eps, h, kind, path)
    if r != NULL:
        for i in range(H):
            b.x[i] = load_value(h, i, kind)
        _project(r, b, path, y + H)
        for i in range(E):
            store_value(logits, i, y[H + i], kind)
    return 0


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
    outs[0], outs[1], outs[2] = &q[0, 0], &k[0, 0], &v[0, 0]
    cdef int j
    cdef Py_ssize_t sizes[3]
    sizes[0], sizes[1], sizes[2] = Hq * D, Hkv * D, Hkv * D
    for j, what in enumerate(("q", "k", "v")):
        _proj(projections[j], <int32_t>H, <int32_t>sizes[j], &p[j], f"pre_attention(): {what}")
    cdef int path = path_index(None)
    cdef input_t a
    cdef float *y = <float *>malloc(<size_t>(Hq + 2 * Hkv) * D * sizeof(float))
    cdef value_t *h = <value_t *>malloc(<size_t>H * sizeof(value_t))
    a.x = NULL
    try:
        if y == NULL or h == NULL:
            raise MemoryError()
        _input(&a, <int32_t>H)
        with nogil:
            _enter_rows(&x[0], &norm[0], H, eps, p, &a, path, y, h, outs,
                        NULL if q_norm is None else &q_norm[0],
                        0 if q_norm is None else q_norm.shape[0], q_eps,
                        NULL if k_norm is None else &k_norm[0],
                        0 if k_norm is None else k_norm.shape[0], k_eps,
                        &cos[0], &sin[0], Hq, Hkv, D, kind)  # fmt: skip
    finally:
        free(y)
        free(h)
        free(a.x)


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
    cdef int failed
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
        at.q, at.k, at.v, at.mask = &q[0, 0], &keys[0, 0, 0], &values[0, 0, 0], NULL
        at.Hq, at.Hkv, at.T, at.L, at.D, at.scale, at.kind = Hq, Hkv, 1, L, D, scale, kind
        at.threads = o.threads  # the o projection's: the layer's threads
        with nogil:
            failed = _leave_rows(&at, &o, &r if routed else NULL, &a, &b, path, out, y, &x[0],
                                 &norm[0], eps, &x_out[0], &h[0], &logits[0] if routed else NULL,
                                 H, E)  # fmt: skip
        if failed:
            raise MemoryError()
    finally:
        free(out)
        free(y)
        free(a.x)
        free(b.x)


WARM_MAX = COLIBRI_POOL_WARM_RANGES  # the most arrays a warm takes


def warm(*arrays):
    """Have colibri's idle helper thread bring ``arrays`` toward the CPU caches, and return
    at once.

    For a caller with other work (an interpreter's) before a kernel call that will read
    ``arrays`` (a layer's weights): the helper that spins between colibri's kernel calls
    prefetches them meanwhile, in order, and stops where the next kernel call begins (which
    never waits for it). A hint only: nothing is read into Python, nothing happens when no
    helper is awake and free (one thread, a busy machine), and memory freed meanwhile is
    harmless (a prefetch never faults).

    Parameters
    ----------
    *arrays : buffer
        At most 8 C-contiguous arrays (numpy, or any object with the buffer protocol).

    Raises
    ------
    ValueError
        More than 8 arrays, or one not contiguous.
    TypeError
        One without the buffer protocol.
    """
    cdef Py_buffer view
    cdef const void *at[COLIBRI_POOL_WARM_RANGES]
    cdef int64_t nbytes[COLIBRI_POOL_WARM_RANGES]
    cdef int j
    if len(arrays) > COLIBRI_POOL_WARM_RANGES:
        raise ValueError(f"warm(): at most {WARM_MAX} arrays (got {len(arrays)})")
    for j, a in enumerate(arrays):
        try:
            PyObject_GetBuffer(a, &view, PyBUF_SIMPLE)
        except (BufferError, ValueError) as e:
            raise ValueError(f"warm(): array {j} must be C-contiguous ({e})") from None
        except TypeError:
            raise TypeError(f"warm(): array {j} must be an array or another object with the "
                            f"buffer protocol (got {type(a).__name__})") from None
        at[j], nbytes[j] = view.buf, view.len
        PyBuffer_Release(&view)
    colibri_pool_warm(at, nbytes, len(arrays))


cdef class AttentionStep:
    """A decoder layer's attention half for one token, its arguments read once: :func:`enter`,
    the token's key and value appended to the caller's cache buffers, then :func:`leave`, in
    one call with no array made (the same kernels in the same order: the same bits).

    Parameters
    ----------
    norm, norm_post : tuple
        ``(weight [H], eps)``: the norms before the attention and after its residual add.
    projections : tuple
        ``(q, k, v)`` projections (module docstring; :func:`colibri.layer.pre_attention`'s).
    q_norm, k_norm : tuple or None
        ``(weight, eps)``: an RMSNorm of every ``len(weight)`` values of ``q`` / ``k``.
    o_proj : tuple
        The output projection ``[H, Hq * D]``.
    router : tuple or None
        The router's projection ``[E, H]``: its logits computed too; None: not.
    heads : tuple of int
        ``(Hq, Hkv, D)``.
    dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``: how every value is stored (the
        ``uint16`` bits of a half type). The weights are kept referenced, read in place.
    """

    cdef proj_t p[5]  # q, k, v, o, router
    cdef const char *norms[4]  # norm, q_norm, k_norm, norm_post (NULL: none)
    cdef Py_ssize_t sizes[4]
    cdef float eps[4]
    cdef readonly Py_ssize_t H, Hq, Hkv, D, E
    cdef readonly int kind
    cdef bint routed
    cdef object keep

    def __init__(self, tuple norm, tuple projections, q_norm, k_norm, tuple o_proj,
                 tuple norm_post, router, tuple heads, str dtype="float32"):
        where = "AttentionStep()"
        if dtype != "float32" and dtype not in _HALF:
            raise ValueError(f"{where}: dtype must be float32, bfloat16 or float16 ({dtype!r})")
        self.Hq, self.Hkv, self.D = heads
        self.kind = _HALF.get(dtype, 0)
        if self.kind == 0:
            self._norms[float](norm, q_norm, k_norm, norm_post, where)
        else:
            self._norms[uint16_t](norm, q_norm, k_norm, norm_post, where)
        cdef Py_ssize_t H = self.H, Hq = self.Hq, Hkv = self.Hkv, D = self.D
        if H == 0 or D == 0 or D % 2 or Hq == 0 or Hkv == 0 or Hq % Hkv:
            raise ValueError(f"{where}: heads (Hq={Hq}, Hkv={Hkv}, D={D}) and H={H} must be "
                             "positive, D even, Hkv dividing Hq")
        if len(projections) != 3:
            raise ValueError(f"{where}: projections must be (q, k, v)")
        cdef Py_ssize_t sizes[3]
        sizes[0], sizes[1], sizes[2] = Hq * D, Hkv * D, Hkv * D
        for j, what in enumerate(("q", "k", "v")):
            _proj(projections[j], <int32_t>H, <int32_t>sizes[j], &self.p[j], f"{where}: {what}")
        _proj(o_proj, <int32_t>(Hq * D), <int32_t>H, &self.p[3], f"{where}: o_proj")
        self.routed = router is not None
        self.E = 0
        if self.routed:
            self.E = len(router[0])
            _proj(router, <int32_t>H, <int32_t>self.E, &self.p[4], f"{where}: router")
        for j, n in ((1, Hq * D), (2, Hkv * D)):
            if self.norms[j] != NULL and (self.sizes[j] == 0 or n % self.sizes[j]):
                raise ValueError(f"{where}: {('q', 'k')[j - 1]}_norm [{self.sizes[j]}] must "
                                 f"divide its {n} values")
        self.keep = (norm, projections, q_norm, k_norm, o_proj, norm_post, router)

    cdef int _norms(self, tuple norm, q_norm, k_norm, tuple norm_post, str where,
                    value_t kind_of=0) except -1:
        """Read the four norms' ``(weight, eps)`` (values stored as ``value_t``)."""
        cdef const value_t[::1] w
        for j, given in enumerate((norm, q_norm, k_norm, norm_post)):
            self.norms[j], self.sizes[j], self.eps[j] = NULL, 0, 0.0
            if given is None:
                if j in (0, 3):
                    raise ValueError(f"{where}: norm and norm_post must be (weight, eps)")
                continue
            w = given[0]
            self.norms[j], self.sizes[j], self.eps[j] = <const char *>&w[0], w.shape[0], given[1]
        self.H = self.sizes[0]
        if self.sizes[3] != self.H:
            raise ValueError(f"{where}: norm_post [{self.sizes[3]}] must be [H] like norm "
                             f"[{self.H}]")
        return 0

    def warm(self):
        """:func:`warm` of this step's weights (its projections' and router's), in the order
        its call reads them: for a caller with other work before the call."""
        cdef const void *at[5]
        cdef int64_t nbytes[5]
        cdef int j, n = 5 if self.routed else 4
        cdef proj_t *p
        for j in range(n):
            p = &self.p[j]
            if p.qtype >= 0:
                at[j], nbytes[j] = p.blocks, p.ldw * p.out_dim
            else:
                at[j], nbytes[j] = p.bits, 2 * p.ldw * p.out_dim
        colibri_pool_warm(at, nbytes, n)

    def __call__(self, x, cos, sin, keys, values, Py_ssize_t row, float scale, x_out, h,
                 logits=None):
        """One token's step.

        Parameters
        ----------
        x : numpy.ndarray
            ``[H]``, the layer's input.
        cos, sin : numpy.ndarray
            ``[D]``: the token's rotation.
        keys, values : numpy.ndarray
            ``[Hkv, capacity, D]``, C-contiguous: a cache holding ``row`` rows; the token's
            key and value are written at ``row``, the attention reads rows ``0 .. row``.
        row : int
            In ``[0, capacity)``.
        scale : float
            The attention's scale.
        x_out, h, logits : numpy.ndarray
            Written: ``x_out [H]`` the input plus the attention's output projected, ``h [H]``
            its norm, ``logits [E]`` the router's (None without a router), each rounded to
            the storage type as :func:`colibri.layer.post_attention` rounds them.

        Every array holds ``dtype``'s values as the step stores them.
        """
        if self.kind == 0:
            _attend_step[float](self, x, cos, sin, keys, values, row, scale, x_out, h, logits)
        else:
            _attend_step[uint16_t](self, x, cos, sin, keys, values, row, scale, x_out, h,
                                   logits)


cdef int _attend_step(AttentionStep s, const value_t[::1] x, const value_t[::1] cos,
                      const value_t[::1] sin, value_t[:, :, ::1] keys,
                      value_t[:, :, ::1] values, Py_ssize_t row, float scale,
                      value_t[::1] x_out, value_t[::1] h, value_t[::1] logits) except -1:
    cdef Py_ssize_t H = s.H, Hq = s.Hq, Hkv = s.Hkv, D = s.D, E = s.E, i, j
    cdef Py_ssize_t capacity = keys.shape[1]
    where = "AttentionStep()"
    if (x.shape[0] != H or x_out.shape[0] != H or h.shape[0] != H or cos.shape[0] != D
            or sin.shape[0] != D or keys.shape[0] != Hkv or keys.shape[2] != D
            or values.shape[0] != Hkv or values.shape[1] != capacity or values.shape[2] != D):
        raise ValueError(f"{where}: x, x_out, h must be [{H}], cos and sin [{D}], keys and "
                         f"values [{Hkv}, capacity, {D}]")
    if not 0 <= row < capacity:
        raise ValueError(f"{where}: row {row} must be in [0, capacity={capacity})")
    if s.routed and (logits is None or logits.shape[0] != E):
        raise ValueError(f"{where}: logits must be [{E}] (the router's rows)")
    cdef int kind = s.kind, path = path_index(None)
    cdef value_t *outs[3]
    cdef colibri_attend_t at
    cdef input_t a, b, c
    cdef int failed = 0
    # q [Hq * D], k, v [Hkv * D], the norm's h [H], the attention's out [Hq * D]
    cdef value_t *scratch = <value_t *>malloc(<size_t>(2 * Hq * D + 2 * Hkv * D + H)
                                              * sizeof(value_t))  # fmt: skip
    cdef float *y = <float *>malloc(<size_t>((Hq + 2 * Hkv) * D + H + E) * sizeof(float))
    a.x = b.x = c.x = NULL
    try:
        if scratch == NULL or y == NULL:
            raise MemoryError()
        _input(&a, <int32_t>H)
        _input(&b, <int32_t>(Hq * D))
        _input(&c, <int32_t>H)
        outs[0], outs[1] = scratch, scratch + Hq * D
        outs[2] = outs[1] + Hkv * D
        at.q, at.k, at.v, at.mask = outs[0], &keys[0, 0, 0], &values[0, 0, 0], NULL
        at.Hq, at.Hkv, at.T, at.L, at.D, at.scale, at.kind = Hq, Hkv, 1, row + 1, D, scale, kind
        at.ldk = at.ldv = capacity * D
        at.threads = s.p[3].threads  # the o projection's: the layer's threads
        with nogil:
            _enter_rows(&x[0], <const value_t *>s.norms[0], H, s.eps[0], s.p, &a, path, y,
                        outs[2] + Hkv * D, outs, <const value_t *>s.norms[1], s.sizes[1],
                        s.eps[1], <const value_t *>s.norms[2], s.sizes[2], s.eps[2], &cos[0],
                        &sin[0], Hq, Hkv, D, kind)  # fmt: skip
            for j in range(Hkv):
                for i in range(D):
                    keys[j, row, i] = outs[1][j * D + i]
                    values[j, row, i] = outs[2][j * D + i]
            failed = _leave_rows(&at, &s.p[3], &s.p[4] if s.routed else NULL, &b, &c, path,
                                 outs[2] + Hkv * D + H, y, &x[0],
                                 <const value_t *>s.norms[3], s.eps[3], &x_out[0], &h[0],
                                 &logits[0] if s.routed else NULL, H, E)  # fmt: skip
        if failed:
            raise MemoryError()
    finally:
        free(scratch)
        free(y)
        free(a.x)
        free(b.x)
        free(c.x)
    return 0
