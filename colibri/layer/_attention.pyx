"""Attention of a few query rows over a key/value cache, for decoding steps
(``include/colibri/attention.h``: the same bits on every SIMD path).

``out[t, h] = sum_j p[h, t, j] v[h // G, j]`` with ``p = softmax_j(scale * q[h, t] . k[h // G, j]
+ mask[t, j])``, ``G = Hq / Hkv`` query heads a key/value head (grouped-query attention).
Values read as float32 (half types converted exactly), dot products and sums in float32 in
a fixed order, the output rounded once to the storage type: the same bits on every run and
machine. A row whose every key is masked (``-inf``) gets zeros; NaN and inf scores give NaN.
"""

from colibri._openmp cimport colibri_max_threads
from colibri._pool cimport share_pool
from colibri.layer._half cimport (
    check_kind,
    store_value,
    value_t,
)
from colibri.layer._kernels cimport colibri_attend, colibri_attend_t

from colibri.layer._ffn import path_index

share_pool()  # one worker pool a process (colibri/_pool.pyx)


def attention(const value_t[:, :, ::1] q, const value_t[:, :, :] k,
              const value_t[:, :, :] v, float scale, value_t[:, :, ::1] out, int kind,
              const float[:, ::1] mask=None, path=None, int threads=0):
    """``q [Hq, T, D]`` over ``k, v [Hkv, L, D]`` (each head's rows packed, the heads any
    distance apart: a cache's first L rows) into ``out [T, Hq, D]``; ``mask [T, L]``
    float32, added to the scaled scores. float32 (``kind`` 0), or uint16 bits of ``kind``;
    ``path`` a SIMD path this CPU runs (None: the dispatched one; every path: the same bits);
    ``threads`` the most threads the heads run on (< 1: colibri's default; the same bits)."""
    cdef Py_ssize_t Hq = q.shape[0], T = q.shape[1], D = q.shape[2]
    cdef Py_ssize_t Hkv = k.shape[0], L = k.shape[1]
    if (Hkv == 0 or Hq % Hkv or k.shape[2] != D or v.shape[0] != Hkv or v.shape[1] != L
            or v.shape[2] != D or out.shape[0] != T or out.shape[1] != Hq or out.shape[2] != D):
        raise ValueError(
            f"attention(): q [{Hq}, {T}, {D}], k [{Hkv}, {L}, {k.shape[2]}], v "
            f"[{v.shape[0]}, {v.shape[1]}, {v.shape[2]}], out [{out.shape[0]}, {out.shape[1]}, "
            f"{out.shape[2]}]: k and v must be [Hkv, L, D] with Hkv dividing Hq, out [T, Hq, D]"
        )
    if mask is not None and (mask.shape[0] != T or mask.shape[1] != L):
        raise ValueError(
            f"attention(): mask must be [{T}, {L}] (got [{mask.shape[0]}, {mask.shape[1]}])"
        )
    check_kind(<const value_t *>NULL, kind, "attention()")
    if Hq == 0 or T == 0 or D == 0:
        return
    cdef int p = path_index(path)
    cdef Py_ssize_t i
    if L == 0:  # nothing to attend to: zeros, as for fully masked rows
        for i in range(T * Hq * D):
            store_value(&out[0, 0, 0], i, 0, kind)
        return
    cdef colibri_attend_t a
    a.ldk, a.ldv = head_stride(k, "k", "attention()"), head_stride(v, "v", "attention()")
    a.q, a.k, a.v, a.out = &q[0, 0, 0], &k[0, 0, 0], &v[0, 0, 0], &out[0, 0, 0]
    a.mask = NULL if mask is None else &mask[0, 0]
    a.Hq, a.Hkv, a.T, a.L, a.D, a.scale, a.kind = Hq, Hkv, T, L, D, scale, kind
    a.threads = threads if threads >= 1 else colibri_max_threads()
    cdef int failed
    with nogil:
        failed = colibri_attend(&a, p)
    if failed:
        raise MemoryError()
