"""Dispatch and combine kernels: group token slots by expert, gather rows, combine outputs.

A *slot* is one (token, choice) pair of the routing result ``ids [T, k]``, numbered
``s = t * k + j``. ``build_plan`` is a stable counting sort of the ``T * k`` slots by
expert: per-thread histograms over contiguous chunks of slots, a prefix sum across
(expert, chunk), then a parallel scatter in which each thread writes its own chunk in
order. The result is unique (stable), so it does not depend on the thread count.
"""

from cython.parallel cimport prange, threadid
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from colibri._openmp cimport colibri_max_threads

cdef extern from "colibri/half.h" nogil:
    float colibri_bf16_to_float(uint16_t h)

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* float32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN. */
    static inline uint16_t colibri_float_to_bf16(float f)
    {
        uint32_t x;
        memcpy(&x, &f, sizeof x);
        if ((x & 0x7fffffffu) > 0x7f800000u)
            return (uint16_t)((x >> 16) | 0x40u);
        x += 0x7fffu + ((x >> 16) & 1u);
        return (uint16_t)(x >> 16);
    }
    /* float32 -> IEEE half, round to nearest even, overflow to inf, subnormals exact. */
    static inline uint16_t colibri_float_to_half(float f)
    {
        uint32_t x, ax, sign;
        memcpy(&x, &f, sizeof x);
        sign = (x >> 16) & 0x8000u;
        ax = x & 0x7fffffffu;
        if (ax >= 0x7f800000u) /* inf / NaN */
            return (uint16_t)(sign | 0x7c00u
                              | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
        if (ax >= 0x477ff000u) /* rounds to >= 65520: inf */
            return (uint16_t)(sign | 0x7c00u);
        if (ax < 0x38800000u) { /* below 2^-14: half subnormal or zero */
            uint32_t e, m, shift, r, rem, halfway;
            if (ax < 0x33000000u) /* <= 2^-25: rounds to zero */
                return (uint16_t)sign;
            e = ax >> 23;
            m = (ax & 0x7fffffu) | 0x800000u;
            shift = 126u - e;
            r = m >> shift;
            rem = m & ((1u << shift) - 1u);
            halfway = 1u << (shift - 1u);
            if (rem > halfway || (rem == halfway && (r & 1u)))
                r++;
            return (uint16_t)(sign | r);
        }
        ax += 0xfffu + ((ax >> 13) & 1u);
        ax -= 0x38000000u; /* exponent bias 127 -> 15 */
        return (uint16_t)(sign | (ax >> 13));
    }
    /* IEEE half -> float32, exact for every input, branch-light so loops vectorize:
       rebias the exponent; inf/NaN get the rest of the bias; zero/subnormals are
       renormalised by an (exact) float subtraction. */
    static inline float colibri_half_to_float_fast(uint16_t h)
    {
        const uint32_t exp_mask = 0x7c00u << 13;
        uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
        uint32_t exp = o & exp_mask;
        float f;
        o += (uint32_t)(127 - 15) << 23;
        if (exp == exp_mask) {
            o += (uint32_t)(128 - 16) << 23;
        } else if (exp == 0) {
            const uint32_t magic_bits = 113u << 23;
            float magic;
            o += 1u << 23;
            memcpy(&f, &o, sizeof f);
            memcpy(&magic, &magic_bits, sizeof magic);
            f -= magic;
            memcpy(&o, &f, sizeof o);
        }
        o |= ((uint32_t)h & 0x8000u) << 16;
        memcpy(&f, &o, sizeof f);
        return f;
    }
    """
    uint16_t colibri_float_to_bf16(float f) noexcept nogil
    uint16_t colibri_float_to_half(float f) noexcept nogil
    float colibri_half_to_float_fast(uint16_t h) noexcept nogil

# How 16-bit storage is read and written (uint16_t carries both half formats).
KIND_PLAIN = 0
KIND_FLOAT16 = 1
KIND_BFLOAT16 = 2

ctypedef fused index_t:
    int32_t
    int64_t

ctypedef fused src_t:
    float
    double
    uint16_t

ctypedef fused dst_t:
    float
    double
    uint16_t

# Less work than this per thread is not worth waking a thread (wake-up costs microseconds,
# milliseconds on a busy machine).
cdef Py_ssize_t MIN_SLOTS_PER_CHUNK = 16384
cdef Py_ssize_t MIN_BYTES_PER_THREAD = 1 << 18


def resolve_threads(num_threads):
    """The thread count to use: ``num_threads`` if given (>= 1), else OpenMP's default."""
    if num_threads is None:
        return max(1, colibri_max_threads())
    n = int(num_threads)
    if n < 1:
        raise ValueError(f"num_threads must be >= 1 or None (got {num_threads!r})")
    return n


def build_plan(
    const index_t[:, ::1] ids,       # IN  [T, k]
    Py_ssize_t num_experts,
    Py_ssize_t block_size,
    int num_threads,
    int64_t[::1] counts,             # OUT [E]      slots per expert
    int64_t[::1] offsets,            # OUT [E + 1]  start of each expert's (padded) rows
    int64_t[::1] sorted_slots,       # OUT [N]      slot of each row; padding rows = T * k
    int64_t[::1] inverse,            # OUT [T * k]  row of each slot
):
    """Stable counting sort of the slots of ``ids`` by expert (see the module docstring).

    Raises ValueError naming the first slot whose id is outside ``[0, num_experts)``.
    """
    cdef Py_ssize_t k = ids.shape[1]
    cdef Py_ssize_t n = ids.shape[0] * k
    cdef Py_ssize_t E = num_experts
    cdef Py_ssize_t num_chunks = min(<Py_ssize_t>num_threads, n // MIN_SLOTS_PER_CHUNK)
    if num_chunks < 1:
        num_chunks = 1
    cdef const index_t* flat = &ids[0, 0] if n > 0 else NULL
    cdef int64_t* starts = <int64_t*>calloc(num_chunks * E, sizeof(int64_t))
    cdef int64_t* first_bad = <int64_t*>malloc(num_chunks * sizeof(int64_t))
    if starts == NULL or first_bad == NULL:
        free(starts)
        free(first_bad)
        raise MemoryError("build_plan(): cannot allocate per-thread histograms")
    cdef Py_ssize_t c, s, lo, hi, e, p, total, count, padded
    cdef int64_t value, row
    cdef int64_t* hist
    try:
        # 1. Per-chunk histograms (and the first out-of-range id of each chunk).
        for c in prange(num_chunks, nogil=True, num_threads=num_chunks, schedule="static"):
            lo = c * n // num_chunks
            hi = (c + 1) * n // num_chunks
            hist = starts + c * E
            first_bad[c] = -1
            for s in range(lo, hi):
                value = flat[s]
                if value < 0 or value >= E:
                    if first_bad[c] < 0:
                        first_bad[c] = s
                else:
                    hist[value] += 1
        for c in range(num_chunks):
            if first_bad[c] >= 0:
                s = first_bad[c]
                raise ValueError(
                    f"expert id {flat[s]} at token {s // k}, choice {s % k} is out of range "
                    f"[0, {E}): ids must come from a router over {E} experts"
                )
        # 2. Prefix sums: expert e's rows start at offsets[e]; chunk c's slots of e
        #    follow those of chunks 0..c-1. Padding rows get the sentinel n.
        total = 0
        with nogil:
            for e in range(E):
                offsets[e] = total
                count = 0
                for c in range(num_chunks):
                    value = starts[c * E + e]
                    starts[c * E + e] = total + count
                    count = count + value
                counts[e] = count
                padded = (count + block_size - 1) // block_size * block_size
                for p in range(total + count, total + padded):
                    sorted_slots[p] = n
                total = total + padded
            offsets[E] = total
            # 3. Scatter: each chunk writes its slots in order (stable).
            for c in prange(num_chunks, num_threads=num_chunks, schedule="static"):
                lo = c * n // num_chunks
                hi = (c + 1) * n // num_chunks
                hist = starts + c * E
                for s in range(lo, hi):
                    row = hist[flat[s]]
                    hist[flat[s]] = row + 1
                    sorted_slots[row] = s
                    inverse[s] = row
    finally:
        free(starts)
        free(first_bad)


def gather_rows(
    const uint8_t[:, ::1] src,        # IN  [T, H * itemsize] hidden states as bytes
    const int64_t[::1] sorted_slots,  # IN  [N]
    Py_ssize_t top_k,
    int num_threads,
    uint8_t[:, ::1] dst,              # OUT [N, H * itemsize]; padding rows zeroed
):
    """Copy the token row of each slot into expert order (same dtype, byte copy)."""
    cdef Py_ssize_t rows = dst.shape[0]
    cdef Py_ssize_t width = dst.shape[1]
    cdef Py_ssize_t n = src.shape[0] * top_k
    cdef Py_ssize_t i, s
    cdef int threads = _threads_for(rows * width, num_threads)
    if rows == 0 or width == 0:
        return
    for i in prange(rows, nogil=True, num_threads=threads, schedule="static"):
        s = sorted_slots[i]
        if s >= n:
            memset(&dst[i, 0], 0, width)
        else:
            memcpy(&dst[i, 0], &src[s // top_k, 0], width)


def gather_rows_float32(
    const src_t[:, ::1] src,          # IN  [T, H]
    int src_kind,
    const int64_t[::1] sorted_slots,  # IN  [N]
    Py_ssize_t top_k,
    int num_threads,
    float[:, ::1] dst,                # OUT [N, H]; padding rows zeroed
):
    """Gather token rows into expert order, converting to float32 on the way."""
    cdef Py_ssize_t rows = dst.shape[0]
    cdef Py_ssize_t H = dst.shape[1]
    cdef Py_ssize_t n = src.shape[0] * top_k
    cdef Py_ssize_t i, s, h
    cdef int threads = _threads_for(rows * H * 4, num_threads)
    if rows == 0 or H == 0:
        return
    for i in prange(rows, nogil=True, num_threads=threads, schedule="static"):
        s = sorted_slots[i]
        if s >= n:
            memset(&dst[i, 0], 0, H * sizeof(float))
        else:
            for h in range(H):
                dst[i, h] = _load(src, s // top_k, h, src_kind)


def combine_rows(
    const src_t[:, ::1] expert_out,   # IN  [N, H] expert outputs in expert order
    int src_kind,
    const int64_t[::1] inverse,       # IN  [T * k] row of each slot
    const float[:, ::1] weights,      # IN  [T, k]
    int num_threads,
    dst_t[:, ::1] out,                # OUT [T, H]
    int dst_kind,
):
    """``out[t] = sum_j weights[t, j] * expert_out[inverse[t * k + j]]``, j = 0..k-1 in order.

    Each token is one thread's work (no atomics); the sum runs in float32 (float64 for
    float64 inputs) and is rounded to the output dtype once.
    """
    cdef Py_ssize_t T = out.shape[0]
    cdef Py_ssize_t H = out.shape[1]
    cdef Py_ssize_t k = weights.shape[1]
    cdef Py_ssize_t t, j, h, row
    cdef float w
    cdef float* acc
    cdef double* acc64
    cdef int threads = _threads_for(T * H * (k + 1) * 4, num_threads)
    if T == 0 or H == 0:
        return
    # One scratch row per thread (doubles, so the float64 path fits too).
    cdef double* scratch = <double*>malloc(threads * H * sizeof(double))
    if scratch == NULL:
        raise MemoryError(f"combine(): cannot allocate {threads} scratch rows of {H} values")
    try:
        for t in prange(T, nogil=True, num_threads=threads, schedule="static"):
            acc64 = scratch + threadid() * H
            acc = <float*>acc64
            if src_t is double:
                for h in range(H):
                    acc64[h] = 0.0
                for j in range(k):
                    row = inverse[t * k + j]
                    w = weights[t, j]
                    for h in range(H):
                        acc64[h] = acc64[h] + <double>w * expert_out[row, h]
                for h in range(H):
                    _store(out, t, h, acc64[h], dst_kind)
            else:
                for h in range(H):
                    acc[h] = 0.0
                for j in range(k):
                    row = inverse[t * k + j]
                    w = weights[t, j]
                    for h in range(H):
                        acc[h] = acc[h] + w * _load(expert_out, row, h, src_kind)
                for h in range(H):
                    _store(out, t, h, acc[h], dst_kind)
    finally:
        free(scratch)


cdef inline int _threads_for(Py_ssize_t work_bytes, int num_threads) noexcept nogil:
    cdef Py_ssize_t useful = work_bytes // MIN_BYTES_PER_THREAD
    if useful < 1:
        return 1
    if useful < num_threads:
        return <int>useful
    return num_threads


cdef inline float _load(const src_t[:, ::1] a, Py_ssize_t i, Py_ssize_t j, int kind) noexcept nogil:
    if src_t is uint16_t:
        if kind == 2:
            return colibri_bf16_to_float(a[i, j])
        return colibri_half_to_float_fast(a[i, j])
    else:
        return <float>a[i, j]


cdef inline void _store(dst_t[:, ::1] a, Py_ssize_t i, Py_ssize_t j, double v,
                        int kind) noexcept nogil:
    if dst_t is uint16_t:
        if kind == 2:
            a[i, j] = colibri_float_to_bf16(<float>v)
        else:
            a[i, j] = colibri_float_to_half(<float>v)
    elif dst_t is float:
        a[i, j] = <float>v
    else:
        a[i, j] = v


def to_float32(
    const src_t[:, ::1] src,          # IN  [R, C]
    int src_kind,
    int num_threads,
    float[:, ::1] dst,                # OUT [R, C]
):
    """Convert float16/bfloat16 (uint16 storage, told apart by ``src_kind``) or float64 rows
    to float32."""
    cdef Py_ssize_t R = src.shape[0]
    cdef Py_ssize_t C = src.shape[1]
    cdef Py_ssize_t i, j
    cdef int threads = _threads_for(R * C * 4, num_threads)
    if R == 0 or C == 0:
        return
    for i in prange(R, nogil=True, num_threads=threads, schedule="static"):
        for j in range(C):
            dst[i, j] = _load(src, i, j, src_kind)
