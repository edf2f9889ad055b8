"""Dispatch and combine kernels: group assignments by expert, gather rows, combine outputs.

An *assignment* is one (token, choice) pair of the routing result ``ids [T, k]``, numbered
``a = t * k + j``. ``build_plan`` is a stable counting sort of the ``T * k`` assignments by
expert: per-thread histograms over contiguous chunks of assignments, a prefix sum across
(expert, chunk), then a parallel scatter in which each thread writes its own chunk in
order. The result is unique (stable), so it does not depend on the thread count.

Every parallel loop runs on colibri/pool.h's threads, in contiguous chunks of rows: the
caller takes every chunk no helper has claimed yet, so a busy machine (a compiler, torch's
own pool) costs at most the serial time instead of a scheduler quantum per call.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from colibri._openmp cimport colibri_max_threads
from colibri._pool cimport share_pool
from colibri._validate import check_threads
from colibri.layer._half cimport (
    COLIBRI_W_BF16,
    COLIBRI_W_F16,
    colibri_bf16_to_float,
    colibri_float_to_bf16,
    colibri_float_to_half,
    colibri_half_to_float,
)

share_pool()  # one worker pool a process (colibri/_pool.pyx)


cdef extern from "colibri/pool.h" nogil:
    ctypedef void (*colibri_chunk_fn)(void *arg, int32_t chunk) noexcept nogil
    void colibri_pool_run(colibri_chunk_fn fn, void *arg, int32_t chunks, int threads) noexcept

# How 16-bit storage is read and written (uint16_t carries both half formats): half.h's.
KIND_PLAIN = 0
KIND_FLOAT16 = COLIBRI_W_F16
KIND_BFLOAT16 = COLIBRI_W_BF16

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
cdef Py_ssize_t MIN_ASSIGNMENTS_PER_CHUNK = 16384
cdef Py_ssize_t MIN_BYTES_PER_THREAD = 1 << 18

# A chunk callback learns its arrays' element types from these tags (one branch per chunk).
cdef enum:
    TYPE_FLOAT32 = 0
    TYPE_FLOAT64 = 1
    TYPE_UINT16 = 2


cdef struct Job:
    # one call's C-contiguous arrays, split into `chunks` contiguous spans of `rows`
    const void *src
    void *dst
    int src_type
    int src_kind
    int dst_type
    int dst_kind
    Py_ssize_t rows
    Py_ssize_t width       # elements per row (bytes for gather_rows)
    Py_ssize_t chunks
    Py_ssize_t top_k
    Py_ssize_t n           # assignments: T * k
    const int64_t *assignments   # sorted_assignments (gather) or inverse (combine)
    const float *weights   # [T, k] (combine)
    double *scratch        # one row of `width` doubles per chunk (combine)


cdef struct PlanJob:
    const void *ids
    int wide               # ids are int64
    Py_ssize_t n
    Py_ssize_t E
    Py_ssize_t chunks
    int64_t *starts        # [chunks, E] histograms, then each chunk's next row per expert
    int64_t *first_bad     # [chunks]
    int64_t *sorted_assignments
    int64_t *inverse


cdef inline int _type_of(src_t *tag) noexcept nogil:
    if src_t is float:
        return TYPE_FLOAT32
    elif src_t is double:
        return TYPE_FLOAT64
    else:
        return TYPE_UINT16


def resolve_threads(num_threads):
    """The thread count to use: ``num_threads`` if given (1 to 4x the CPUs), else OpenMP's
    default."""
    if num_threads is None:
        return max(1, colibri_max_threads())
    return check_threads(num_threads)


cdef void _hist_span(const index_t *flat, PlanJob *p, int32_t c) noexcept nogil:
    cdef Py_ssize_t lo = c * p.n // p.chunks, hi = (c + 1) * p.n // p.chunks, s
    cdef int64_t *hist = p.starts + c * p.E
    cdef int64_t value
    p.first_bad[c] = -1
    for s in range(lo, hi):
        value = flat[s]
        if value < 0 or value >= p.E:
            if p.first_bad[c] < 0:
                p.first_bad[c] = s
        else:
            hist[value] += 1


cdef void _hist_chunk(void *arg, int32_t c) noexcept nogil:
    """Chunk c's histogram of expert ids (and its first out-of-range assignment)."""
    cdef PlanJob *p = <PlanJob *>arg
    if p.wide:
        _hist_span(<const int64_t *>p.ids, p, c)
    else:
        _hist_span(<const int32_t *>p.ids, p, c)


cdef void _scatter_span(const index_t *flat, PlanJob *p, int32_t c) noexcept nogil:
    cdef Py_ssize_t lo = c * p.n // p.chunks, hi = (c + 1) * p.n // p.chunks, s
    cdef int64_t *hist = p.starts + c * p.E
    cdef int64_t row
    for s in range(lo, hi):
        row = hist[flat[s]]
        hist[flat[s]] = row + 1
        p.sorted_assignments[row] = s
        p.inverse[s] = row


cdef void _scatter_chunk(void *arg, int32_t c) noexcept nogil:
    """Chunk c's assignments to their rows, in order (stable)."""
    cdef PlanJob *p = <PlanJob *>arg
    if p.wide:
        _scatter_span(<const int64_t *>p.ids, p, c)
    else:
        _scatter_span(<const int32_t *>p.ids, p, c)


def build_plan(
    const index_t[:, ::1] ids,       # IN  [T, k]
    Py_ssize_t num_experts,
    Py_ssize_t block_size,
    int num_threads,
    int64_t[::1] counts,              # OUT [E]      assignments per expert
    int64_t[::1] offsets,             # OUT [E + 1]  start of each expert's (padded) rows
    int64_t[::1] sorted_assignments,  # OUT [N]      assignment of each row; padding = T * k
    int64_t[::1] inverse,             # OUT [T * k]  row of each assignment
):
    """Stable counting sort of the assignments of ``ids`` by expert (see the module docstring).

    Raises ValueError naming the first assignment whose id is outside ``[0, num_experts)``.
    """
    cdef Py_ssize_t k = ids.shape[1]
    cdef Py_ssize_t n = ids.shape[0] * k
    cdef Py_ssize_t E = num_experts
    cdef Py_ssize_t num_chunks = min(<Py_ssize_t>num_threads, n // MIN_ASSIGNMENTS_PER_CHUNK)
    if num_chunks < 1:
        num_chunks = 1
    cdef const index_t* flat = &ids[0, 0] if n > 0 else NULL
    cdef int64_t* starts = <int64_t*>calloc(num_chunks * E, sizeof(int64_t))
    cdef int64_t* first_bad = <int64_t*>malloc(num_chunks * sizeof(int64_t))
    if starts == NULL or first_bad == NULL:
        free(starts)
        free(first_bad)
        raise MemoryError("build_plan(): cannot allocate per-thread histograms")
    cdef Py_ssize_t c, s, e, p, total, count, padded
    cdef int64_t value
    cdef PlanJob job
    job.ids = flat
    job.wide = index_t is int64_t
    job.n = n
    job.E = E
    job.chunks = num_chunks
    job.starts = starts
    job.first_bad = first_bad
    job.sorted_assignments = &sorted_assignments[0] if sorted_assignments.shape[0] > 0 else NULL
    job.inverse = &inverse[0] if n > 0 else NULL
    try:
        # 1. Per-chunk histograms (and the first out-of-range id of each chunk).
        with nogil:
            colibri_pool_run(_hist_chunk, &job, <int32_t>num_chunks, <int>num_chunks)
        for c in range(num_chunks):
            if first_bad[c] >= 0:
                s = first_bad[c]
                raise ValueError(
                    f"expert id {flat[s]} at token {s // k}, choice {s % k} is out of range "
                    f"[0, {E}): ids must come from a router over {E} experts"
                )
        # 2. Prefix sums: expert e's rows start at offsets[e]; chunk c's assignments of e
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
                    sorted_assignments[p] = n
                total = total + padded
            offsets[E] = total
            # 3. Scatter: each chunk writes its assignments in order (stable).
            colibri_pool_run(_scatter_chunk, &job, <int32_t>num_chunks, <int>num_chunks)
    finally:
        free(starts)
        free(first_bad)


cdef void _gather_bytes_chunk(void *arg, int32_t c) noexcept nogil:
    cdef const Job *j = <const Job *>arg
    cdef Py_ssize_t i, s
    cdef uint8_t *row
    for i in range(c * j.rows // j.chunks, (c + 1) * j.rows // j.chunks):
        s = j.assignments[i]
        row = <uint8_t *>j.dst + i * j.width
        if s >= j.n:
            memset(row, 0, j.width)
        else:
            memcpy(row, <const uint8_t *>j.src + (s // j.top_k) * j.width, j.width)


def gather_rows(
    const uint8_t[:, ::1] src,        # IN  [T, H * itemsize] hidden states as bytes
    const int64_t[::1] sorted_assignments,  # IN  [N]
    Py_ssize_t top_k,
    int num_threads,
    uint8_t[:, ::1] dst,              # OUT [N, H * itemsize]; padding rows zeroed
):
    """Copy the token row of each assignment into expert order (same dtype, byte copy)."""
    cdef Py_ssize_t rows = dst.shape[0]
    cdef Py_ssize_t width = dst.shape[1]
    cdef int threads = _threads_for(rows * width, num_threads)
    cdef Job job
    if rows == 0 or width == 0:
        return
    job.src = &src[0, 0] if src.shape[0] > 0 else NULL
    job.dst = &dst[0, 0]
    job.rows = rows
    job.width = width
    job.chunks = threads
    job.top_k = top_k
    job.n = src.shape[0] * top_k
    job.assignments = &sorted_assignments[0]
    with nogil:
        colibri_pool_run(_gather_bytes_chunk, &job, threads, threads)


cdef void _gather_float32_span(const src_t *src, const Job *j, int32_t c) noexcept nogil:
    cdef Py_ssize_t i, s, h, H = j.width
    cdef float *out
    cdef const src_t *row
    for i in range(c * j.rows // j.chunks, (c + 1) * j.rows // j.chunks):
        s = j.assignments[i]
        out = <float *>j.dst + i * H
        if s >= j.n:
            memset(out, 0, H * sizeof(float))
        else:
            row = src + (s // j.top_k) * H
            for h in range(H):
                out[h] = _load(row[h], j.src_kind)


cdef void _gather_float32_chunk(void *arg, int32_t c) noexcept nogil:
    cdef const Job *j = <const Job *>arg
    if j.src_type == TYPE_FLOAT32:
        _gather_float32_span(<const float *>j.src, j, c)
    elif j.src_type == TYPE_FLOAT64:
        _gather_float32_span(<const double *>j.src, j, c)
    else:
        _gather_float32_span(<const uint16_t *>j.src, j, c)


def gather_rows_float32(
    const src_t[:, ::1] src,          # IN  [T, H]
    int src_kind,
    const int64_t[::1] sorted_assignments,  # IN  [N]
    Py_ssize_t top_k,
    int num_threads,
    float[:, ::1] dst,                # OUT [N, H]; padding rows zeroed
):
    """Gather token rows into expert order, converting to float32 on the way."""
    cdef Py_ssize_t rows = dst.shape[0]
    cdef Py_ssize_t H = dst.shape[1]
    cdef int threads = _threads_for(rows * H * 4, num_threads)
    cdef Job job
    if rows == 0 or H == 0:
        return
    job.src = &src[0, 0] if src.shape[0] > 0 else NULL
    job.src_type = _type_of(<src_t *>NULL)
    job.src_kind = src_kind
    job.dst = &dst[0, 0]
    job.rows = rows
    job.width = H
    job.chunks = threads
    job.top_k = top_k
    job.n = src.shape[0] * top_k
    job.assignments = &sorted_assignments[0]
    with nogil:
        colibri_pool_run(_gather_float32_chunk, &job, threads, threads)


cdef void _combine_span(const src_t *src, dst_t *out, const Job *j, int32_t c) noexcept nogil:
    """Tokens of chunk c, summed in chunk c's scratch row."""
    cdef Py_ssize_t t, i, h, row, H = j.width, k = j.top_k
    cdef float w
    cdef double *acc64 = j.scratch + c * H
    cdef float *acc = <float *>acc64
    cdef dst_t *o
    for t in range(c * j.rows // j.chunks, (c + 1) * j.rows // j.chunks):
        o = out + t * H
        if src_t is double:
            for h in range(H):
                acc64[h] = 0.0
            for i in range(k):
                row = j.assignments[t * k + i]
                w = j.weights[t * k + i]
                for h in range(H):
                    acc64[h] = acc64[h] + <double>w * src[row * H + h]
            for h in range(H):
                _store(o + h, acc64[h], j.dst_kind)
        else:
            for h in range(H):
                acc[h] = 0.0
            for i in range(k):
                row = j.assignments[t * k + i]
                w = j.weights[t * k + i]
                for h in range(H):
                    acc[h] = acc[h] + w * _load(src[row * H + h], j.src_kind)
            for h in range(H):
                _store(o + h, acc[h], j.dst_kind)


cdef void _combine_to(const src_t *src, const Job *j, int32_t c) noexcept nogil:
    if j.dst_type == TYPE_FLOAT32:
        _combine_span(src, <float *>j.dst, j, c)
    elif j.dst_type == TYPE_FLOAT64:
        _combine_span(src, <double *>j.dst, j, c)
    else:
        _combine_span(src, <uint16_t *>j.dst, j, c)


cdef void _combine_chunk(void *arg, int32_t c) noexcept nogil:
    cdef const Job *j = <const Job *>arg
    if j.src_type == TYPE_FLOAT32:
        _combine_to(<const float *>j.src, j, c)
    elif j.src_type == TYPE_FLOAT64:
        _combine_to(<const double *>j.src, j, c)
    else:
        _combine_to(<const uint16_t *>j.src, j, c)


def combine_rows(
    const src_t[:, ::1] expert_out,   # IN  [N, H] expert outputs in expert order
    int src_kind,
    const int64_t[::1] inverse,       # IN  [T * k] row of each assignment
    const float[:, ::1] weights,      # IN  [T, k]
    int num_threads,
    dst_t[:, ::1] out,                # OUT [T, H]
    int dst_kind,
):
    """``out[t] = sum_j weights[t, j] * expert_out[inverse[t * k + j]]``, j = 0..k-1 in order.

    Each token is one chunk's work (no atomics); the sum runs in float32 (float64 for
    float64 inputs) and is rounded to the output dtype once.
    """
    cdef Py_ssize_t T = out.shape[0]
    cdef Py_ssize_t H = out.shape[1]
    cdef Py_ssize_t k = weights.shape[1]
    cdef int threads = _threads_for(T * H * (k + 1) * 4, num_threads)
    cdef Job job
    if T == 0 or H == 0:
        return
    # One scratch row per chunk (doubles, so the float64 path fits too).
    cdef double* scratch = <double*>malloc(threads * H * sizeof(double))
    if scratch == NULL:
        raise MemoryError(f"combine(): cannot allocate {threads} scratch rows of {H} values")
    job.src = &expert_out[0, 0] if expert_out.shape[0] > 0 else NULL
    job.src_type = _type_of(<src_t *>NULL)
    job.src_kind = src_kind
    job.dst = &out[0, 0]
    job.dst_type = _type_of(<dst_t *>NULL)
    job.dst_kind = dst_kind
    job.rows = T
    job.width = H
    job.chunks = threads
    job.top_k = k
    job.assignments = &inverse[0] if k > 0 else NULL
    job.weights = &weights[0, 0] if k > 0 else NULL
    job.scratch = scratch
    try:
        with nogil:
            colibri_pool_run(_combine_chunk, &job, threads, threads)
    finally:
        free(scratch)


cdef inline int _threads_for(Py_ssize_t work_bytes, int num_threads) noexcept nogil:
    cdef Py_ssize_t useful = work_bytes // MIN_BYTES_PER_THREAD
    if useful < 1:
        return 1
    if useful < num_threads:
        return <int>useful
    return num_threads


cdef inline float _load(src_t v, int kind) noexcept nogil:
    if src_t is uint16_t:
        if kind == COLIBRI_W_BF16:
            return colibri_bf16_to_float(v)
        return colibri_half_to_float(v)
    else:
        return <float>v


cdef inline void _store(dst_t *a, double v, int kind) noexcept nogil:
    if dst_t is uint16_t:
        if kind == COLIBRI_W_BF16:
            a[0] = colibri_float_to_bf16(<float>v)
        else:
            a[0] = colibri_float_to_half(<float>v)
    elif dst_t is float:
        a[0] = <float>v
    else:
        a[0] = v


cdef void _convert_span(const src_t *src, const Job *j, int32_t c) noexcept nogil:
    cdef Py_ssize_t i, lo = c * j.rows // j.chunks * j.width
    cdef Py_ssize_t hi = (c + 1) * j.rows // j.chunks * j.width
    cdef float *out = <float *>j.dst
    for i in range(lo, hi):
        out[i] = _load(src[i], j.src_kind)


cdef void _convert_chunk(void *arg, int32_t c) noexcept nogil:
    cdef const Job *j = <const Job *>arg
    if j.src_type == TYPE_FLOAT32:
        _convert_span(<const float *>j.src, j, c)
    elif j.src_type == TYPE_FLOAT64:
        _convert_span(<const double *>j.src, j, c)
    else:
        _convert_span(<const uint16_t *>j.src, j, c)


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
    cdef int threads = _threads_for(R * C * 4, num_threads)
    cdef Job job
    if R == 0 or C == 0:
        return
    job.src = &src[0, 0]
    job.src_type = _type_of(<src_t *>NULL)
    job.src_kind = src_kind
    job.dst = &dst[0, 0]
    job.rows = R
    job.width = C
    job.chunks = threads
    with nogil:
        colibri_pool_run(_convert_chunk, &job, threads, threads)
