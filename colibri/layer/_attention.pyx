"""Attention of a few query rows over a key/value cache, for decoding steps.

``out[t, h] = sum_j p[h, t, j] v[h // G, j]`` with ``p = softmax_j(scale * q[h, t] . k[h // G, j]
+ mask[t, j])``, ``G = Hq / Hkv`` query heads a key/value head (grouped-query attention).
Values read as float32 (half types converted exactly), dot products and sums in float32 in
a fixed order, the output rounded once to the storage type: the same bits on every run and
machine. A row whose every key is masked (``-inf``) gets zeros; NaN and inf scores give NaN.
"""

from libc.math cimport INFINITY, expf
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from colibri.layer._half cimport (
    check_kind,
    load_value,
    store_value,
    value_t,
)


cdef inline float _dot(const float *a, const float *b, Py_ssize_t n) noexcept nogil:
    """``a . b`` in eight running sums (lanes a compiler vectorizes), added pairwise."""
    cdef float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0
    cdef Py_ssize_t i = 0
    while i + 8 <= n:
        s0 += a[i] * b[i]
        s1 += a[i + 1] * b[i + 1]
        s2 += a[i + 2] * b[i + 2]
        s3 += a[i + 3] * b[i + 3]
        s4 += a[i + 4] * b[i + 4]
        s5 += a[i + 5] * b[i + 5]
        s6 += a[i + 6] * b[i + 6]
        s7 += a[i + 7] * b[i + 7]
        i += 8
    while i < n:
        s0 += a[i] * b[i]
        i += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


cdef int _attend(const value_t *q, const value_t *k, const value_t *v, const float *mask,
                 Py_ssize_t Hq, Py_ssize_t Hkv, Py_ssize_t T, Py_ssize_t L, Py_ssize_t D,
                 float scale, value_t *out, int kind) noexcept nogil:
    """One key/value head at a time: its G * T query rows scored against each key (read
    once), softmax, then each value row (read once) added to every query row's sum.
    Returns -1 when scratch memory is short."""
    cdef Py_ssize_t G = Hq // Hkv, R = G * T, g, r, j, d, h, t
    cdef float *buf = <float *>malloc((R * L + 2 * R * D + D + R) * sizeof(float))
    if buf == NULL:
        return -1
    cdef float *s = buf  # [R, L]: scores, then their exponentials
    cdef float *qf = s + R * L  # [R, D]
    cdef float *acc = qf + R * D  # [R, D]
    cdef float *row = acc + R * D  # [D]: a key or value row as float32
    cdef float *total = row + D  # [R]
    cdef float m, p, a
    cdef const value_t *kg
    cdef const value_t *vg
    for g in range(Hkv):
        for r in range(R):  # row r: head g * G + r // T, query t = r % T
            h, t = g * G + r // T, r % T
            for d in range(D):
                qf[r * D + d] = load_value(q, (h * T + t) * D + d, kind)
        kg, vg = k + g * L * D, v + g * L * D
        for j in range(L):
            for d in range(D):
                row[d] = load_value(kg, j * D + d, kind)
            for r in range(R):
                a = _dot(&qf[r * D], row, D) * scale
                if mask != NULL:
                    a = a + mask[(r % T) * L + j]
                s[r * L + j] = a
        for r in range(R):
            m = -INFINITY
            for j in range(L):
                if s[r * L + j] > m:
                    m = s[r * L + j]
            a = 0
            for j in range(L):
                p = expf(s[r * L + j] - m) if m != -INFINITY else 0
                s[r * L + j] = p
                a = a + p
            total[r] = a
        memset(acc, 0, R * D * sizeof(float))
        for j in range(L):
            for d in range(D):
                row[d] = load_value(vg, j * D + d, kind)
            for r in range(R):
                p = s[r * L + j]
                for d in range(D):
                    acc[r * D + d] += p * row[d]
        for r in range(R):
            h, t = g * G + r // T, r % T
            a = total[r]
            for d in range(D):
                store_value(out, (t * Hq + h) * D + d, acc[r * D + d] / a if a != 0 else 0, kind)
    free(buf)
    return 0


def attention(const value_t[:, :, ::1] q, const value_t[:, :, ::1] k,
              const value_t[:, :, ::1] v, float scale, value_t[:, :, ::1] out, int kind,
              const float[:, ::1] mask=None):
    """``q [Hq, T, D]`` over ``k, v [Hkv, L, D]`` into ``out [T, Hq, D]``; ``mask [T, L]``
    float32, added to the scaled scores. float32 (``kind`` 0), or uint16 bits of ``kind``."""
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
    cdef const float *m = NULL if mask is None else &mask[0, 0]
    cdef int failed
    cdef Py_ssize_t i
    if L == 0:  # nothing to attend to: zeros, as for fully masked rows
        for i in range(T * Hq * D):
            store_value(&out[0, 0, 0], i, 0, kind)
        return
    with nogil:
        failed = _attend(&q[0, 0, 0], &k[0, 0, 0], &v[0, 0, 0], m, Hq, Hkv, T, L, D, scale,
                         &out[0, 0, 0], kind)
    if failed:
        raise MemoryError()
