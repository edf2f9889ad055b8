"""colibri's compiled routing core: the batch driver around include/colibri/route.h.

The per-token kernel is plain C (one fused pass: decode, NaN check, optional scores and
bias, group limit, partial top-k, weights). This module runs it over tokens in chunks on
colibri/pool.h's threads (the caller takes every chunk no helper has claimed yet, so a busy
machine costs at most the serial time; one scratch block per chunk, no locks), fills
caller-owned or fresh buffers, and counts expert usage per chunk when asked, merged after.
"""

from libc.stdint cimport int32_t, int64_t, uintptr_t
from libc.stdlib cimport free, malloc

from colibri._dlpack._capsule cimport (BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT32, INT64,
                                       DType, HostTensor, import_tensor, new_result)
from colibri._openmp cimport COLIBRI_OPENMP, COLIBRI_OPENMP_VERSION, colibri_max_threads
from colibri._pool cimport share_pool
from colibri._route cimport (COLIBRI_BF16, COLIBRI_F16, COLIBRI_F32, COLIBRI_F64,
                             COLIBRI_GROUP_MAX, COLIBRI_GROUP_TOP2_SUM, COLIBRI_OK,
                             COLIBRI_ROW_ALL_NEG_INF, COLIBRI_ROW_NAN, COLIBRI_ROW_SHORT,
                             COLIBRI_SIGMOID, COLIBRI_SOFTMAX, COLIBRI_SQRTSOFTPLUS,
                             colibri_cpu_has_avx2, colibri_cpu_has_avx512, colibri_load_row,
                             colibri_block_rows, colibri_prefetch, colibri_route_block,
                             colibri_route_row, colibri_router_t, colibri_rows8_eligible,
                             colibri_scratch_layout, colibri_scratch_t)

import threading

import numpy as np

from colibri._dlpack import DTYPE_NAMES, to_caller

share_pool()  # one worker pool a process (colibri/_pool.pyx)


cdef extern from "colibri/pool.h" nogil:
    ctypedef void (*colibri_chunk_fn)(void *arg, int32_t chunk) noexcept nogil
    void colibri_pool_run(colibri_chunk_fn fn, void *arg, int32_t chunks, int threads) noexcept


# Work per thread below which another thread costs more than it saves (waking one costs
# microseconds), and a row's cost by path, in ns: linear in E, fitted to measured costs
# (the figures: commit 1ac02ef).
cdef double THREAD_WORK_NS = 5000.0
# Chunks per thread of a batch: the caller and its helpers claim them as they go, so a helper
# that starts late leaves its second chunk to the caller instead of holding the whole call
# back (the figures: commit e463d6d).
cdef Py_ssize_t CHUNKS_PER_THREAD = 2


cdef Py_ssize_t _rows_per_thread(const colibri_router_t *r) noexcept:
    """Rows worth one more thread: fewer the costlier a row (16 at least)."""
    cdef double row_ns
    if colibri_rows8_eligible(r):
        row_ns = 10.0 + 0.35 * r.num_experts  # plain top-2: the 8-row and block paths
    else:
        row_ns = 40.0 + 1.5 * r.num_experts  # scores, groups, top-k candidates
    return max(16, <Py_ssize_t>(THREAD_WORK_NS / row_ns))

# Option names to route.h's codes, from its enums: Config validates against these keys.
SCORINGS = {"softmax": COLIBRI_SOFTMAX, "sigmoid": COLIBRI_SIGMOID,
            "sqrtsoftplus": COLIBRI_SQRTSOFTPLUS}
GROUP_SCORES = {"max": COLIBRI_GROUP_MAX, "top2_sum": COLIBRI_GROUP_TOP2_SUM}


cdef int _logits_dtype(DType dtype) noexcept:
    """route.h's code for a DLPack dtype colibri routes (-1: not a logits dtype)."""
    if dtype == FLOAT32:
        return COLIBRI_F32
    if dtype == FLOAT64:
        return COLIBRI_F64
    if dtype == FLOAT16:
        return COLIBRI_F16
    if dtype == BFLOAT16:
        return COLIBRI_BF16
    return -1


def openmp_enabled():
    """True when the extension was compiled with OpenMP."""
    return bool(COLIBRI_OPENMP)


def openmp_version():
    """The ``_OPENMP`` date macro the extension was compiled with (0 without OpenMP)."""
    return COLIBRI_OPENMP_VERSION


cdef extern from *:
    """
    #if defined(__clang__)
    #define COLIBRI_COMPILER "clang " __clang_version__
    #elif defined(__GNUC__)
    #define COLIBRI_COMPILER "gcc " __VERSION__
    #elif defined(_MSC_VER)
    #define COLIBRI_STR2(x) #x
    #define COLIBRI_STR(x) COLIBRI_STR2(x)
    #define COLIBRI_COMPILER "msvc " COLIBRI_STR(_MSC_FULL_VER)
    #else
    #define COLIBRI_COMPILER "unknown"
    #endif
    #ifdef COLIBRI_SSE2
    #define COLIBRI_SIMD "sse2"
    #elif defined(COLIBRI_NEON)
    #define COLIBRI_SIMD "neon (score passes, top two, top-k candidates)"
    #else
    #define COLIBRI_SIMD "none (portable C)"
    #endif
    """
    const char *COLIBRI_COMPILER
    const char *COLIBRI_SIMD


def build_info():
    """How this extension was built and what this CPU runs of routing's SIMD kernels: the
    compiler and the paths (the expert kernels report theirs: ``colibri.layer.simd_path``)."""
    simd = COLIBRI_SIMD.decode()
    if colibri_cpu_has_avx2():
        simd += ", avx2 (score passes, top two, top-k bound, 8-row blocks)"
    if colibri_cpu_has_avx512():
        simd += ", avx512f (sigmoid pass, top two, 16-row blocks)"
    return {"compiler": COLIBRI_COMPILER.decode(), "simd": simd}


def max_threads():
    """OpenMP's default thread count (``OMP_NUM_THREADS`` or the core count); 1 without OpenMP."""
    return colibri_max_threads()


ctypedef struct RowJob:
    const colibri_router_t *router
    const char *x               # logits, first element
    int64_t xs0, xs1            # strides in elements
    int x_itemsize, x_dtype
    char *ids                   # out ids, first element
    int64_t ids_s0, ids_s1
    int ids_itemsize
    bint ids64
    float *w                    # out weights, first element
    int64_t w_s0, w_s1
    Py_ssize_t k, E
    colibri_scratch_t scratch   # one thread's scratch: route.h's layout
    bint rows8                  # route blocks of rows (colibri_route_block)
    Py_ssize_t block            # rows per block: colibri_block_rows


cdef inline void _count_row(const int32_t *ids, Py_ssize_t k, Py_ssize_t E, int64_t *counts,
                            int64_t *pairs, int64_t sign) noexcept nogil:
    """Add sign x one routed row to counts [E] and the pairs' upper triangle [E, E]."""
    cdef Py_ssize_t a, b
    cdef int32_t lo, hi
    for a in range(k):
        counts[ids[a]] += sign
        for b in range(a + 1, k):  # a row's ids are distinct: each pair once, as (low, high)
            lo = ids[a] if ids[a] < ids[b] else ids[b]
            hi = ids[a] + ids[b] - lo
            pairs[lo * E + hi] += sign


cdef inline void _store_row(const RowJob *job, Py_ssize_t t, const int32_t *ids,
                            const float *weights) noexcept nogil:
    """Write one routed row into the out buffers (any strides, int32 or int64 ids)."""
    cdef Py_ssize_t j
    cdef char *ids_out = job.ids + t * job.ids_s0 * job.ids_itemsize
    cdef float *w_out = job.w + t * job.w_s0
    for j in range(job.k):
        if job.ids64:
            (<int64_t *>ids_out)[j * job.ids_s1] = ids[j]
        else:
            (<int32_t *>ids_out)[j * job.ids_s1] = ids[j]
        w_out[j * job.w_s1] = weights[j]


ctypedef struct SpanJob:
    const RowJob *job
    Py_ssize_t T, chunks
    char *scratch
    size_t slot
    int64_t *cnt
    int64_t *co
    Py_ssize_t cs, ps
    Py_ssize_t *bad_rows
    int *bad_codes


cdef void _route_chunk(void *arg, int32_t c) noexcept nogil:
    """Chunk c of a batch (colibri/pool.h): its rows, scratch, counts and failure slot."""
    cdef SpanJob *s = <SpanJob *>arg
    _route_span(s.job, c * s.T // s.chunks, (c + 1) * s.T // s.chunks, s.scratch + s.slot * c,
                s.cnt + c * s.cs if s.cnt != NULL else NULL,
                s.co + c * s.ps if s.co != NULL else NULL, s.bad_rows + c, s.bad_codes + c)


cdef void _route_span(const RowJob *job, Py_ssize_t start, Py_ssize_t stop, char *scratch,
                      int64_t *counts, int64_t *pairs, Py_ssize_t *bad_row,
                      int *bad_code) noexcept nogil:
    """Route rows [start, stop) with one scratch block; count usage when counts != NULL.

    The first failing row and its status go to bad_row / bad_code (left alone if none); the
    rows before it are routed and counted."""
    cdef Py_ssize_t t = start, i, k = job.k
    cdef int32_t *row_ids = <int32_t *>(scratch + job.scratch.block_ids)
    cdef float *row_w = <float *>(scratch + job.scratch.block_weights)
    cdef const float *row
    cdef int status
    # rows whose elements are contiguous are fetched about 2 KiB ahead (hardware prefetchers
    # alone leave long rows waiting); the block path gains only on long rows
    cdef size_t row_bytes = job.E * job.x_itemsize if job.xs1 == 1 else 0
    cdef Py_ssize_t ahead = max(8, 2048 // max(row_bytes, 1))
    cdef bint direct = (not job.ids64 and job.ids_s1 == 1 and job.ids_s0 == k
                        and job.w_s1 == 1 and job.w_s0 == k)
    cdef int32_t *ids8 = row_ids
    cdef float *w8 = row_w
    cdef Py_ssize_t block = job.block
    if job.rows8:
        while t + block <= stop:
            if row_bytes >= 512:
                for i in range(ahead, ahead + block):
                    if t + i < stop:
                        colibri_prefetch(job.x + (t + i) * job.xs0 * 4, row_bytes)
            if direct:  # C-contiguous int32 / float32 results: written in place
                ids8 = <int32_t *>job.ids + t * k
                w8 = job.w + t * k
            if colibri_route_block(job.router, <const float *>(job.x + t * job.xs0 * 4),
                                   job.xs0, scratch, ids8, w8) != COLIBRI_OK:
                break  # the rows one by one below name the failing one
            for i in range(block):
                if not direct:
                    _store_row(job, t + i, ids8 + i * k, w8 + i * k)
                if counts != NULL:
                    _count_row(ids8 + i * k, k, job.E, counts, pairs, 1)
            t += block
    ahead = max(1, 2048 // max(row_bytes, 1))
    for t in range(t, stop):
        if row_bytes and t + ahead < stop:
            colibri_prefetch(job.x + (t + ahead) * job.xs0 * job.x_itemsize, row_bytes)
        row = colibri_load_row(job.x + t * job.xs0 * job.x_itemsize, job.x_dtype, job.xs1,
                               <int32_t>job.E, <float *>(scratch + job.scratch.row))
        status = colibri_route_row(job.router, row, scratch, row_ids, row_w)
        if status != COLIBRI_OK:
            bad_row[0] = t
            bad_code[0] = status
            return
        _store_row(job, t, row_ids, row_w)
        if counts != NULL:
            _count_row(row_ids, k, job.E, counts, pairs, 1)


cdef void _uncount_span(const RowJob *job, Py_ssize_t start, Py_ssize_t stop, char *scratch,
                        int64_t *counts, int64_t *pairs) noexcept nogil:
    """Take back the counts of rows [start, stop), read from the results (a failed call)."""
    cdef Py_ssize_t t, j, k = job.k
    cdef int32_t *row_ids = <int32_t *>(scratch + job.scratch.block_ids)
    cdef char *ids_row
    for t in range(start, stop):
        ids_row = job.ids + t * job.ids_s0 * job.ids_itemsize
        for j in range(k):
            row_ids[j] = <int32_t>(<int64_t *>ids_row)[j * job.ids_s1] if job.ids64 else \
                (<int32_t *>ids_row)[j * job.ids_s1]
        _count_row(row_ids, k, job.E, counts, pairs, -1)


cdef inline bint _self_overlapping(HostTensor t) noexcept:
    cdef int i
    for i in range(t.ndim):
        if t.steps[i] == 0 and t.dims[i] > 1:
            return True
    return False


cdef inline bint _has_shape(HostTensor t, int ndim, Py_ssize_t T, Py_ssize_t k) noexcept:
    if ndim == 2:
        return t.ndim == 2 and t.dims[0] == T and t.dims[1] == k
    return t.ndim == 1 and t.dims[0] == k


cdef class Router:
    """The compiled router: a validated routing configuration and its kernels.

    Built by :class:`colibri.Context`; use ``ctx.route``.
    """
    cdef colibri_router_t r
    cdef colibri_router_t _r_one  # r for one token: 4 lanes (a lone AVX-512 call costs more)
    cdef readonly int num_experts
    cdef readonly int top_k
    cdef readonly int routing_threads
    cdef bint ids64
    cdef object _keep            # arrays the C struct points into
    cdef object _ids_dtype
    cdef readonly bint collect_stats
    cdef object _stats_lock
    cdef object _counts          # [chunks, >= E] int64, one row per chunk of a call
    cdef object _coactivation    # [chunks, >= E * E] int64, pairs (low, high) only
    cdef Py_ssize_t _counts_stride, _pairs_stride  # rows padded: no cache line shared
    cdef readonly int64_t tokens_routed
    cdef colibri_scratch_t _scratch  # one thread's scratch: route.h's layout

    def _configure(self, config):
        """Copy a :class:`colibri.Config` (already validated) into the C router."""
        cdef int num_experts = config.num_experts
        cdef int routing_threads = config.routing_threads or colibri_max_threads()
        use_avx512 = config.use_avx512
        use_avx2 = config.use_avx2
        self.num_experts = num_experts
        self.top_k = config.top_k
        self.routing_threads = routing_threads
        self.ids64 = config.ids_dtype == "int64"
        self._ids_dtype = np.dtype(config.ids_dtype)
        keep = []
        self.r.num_experts = num_experts
        self.r.top_k = config.top_k
        self.r.scoring = SCORINGS[config.scoring]
        self.r.normalize = config.normalize
        self.r.norm_p = config.norm_p
        self.r.norm_eps = config.normalize_eps
        self.r.bias_on_logits = config.bias_on == "logits"
        self.r.scale = config.scale
        self.r.bias = NULL
        self.r.expert_scale = NULL
        cdef const float[::1] fview
        cdef const int32_t[::1] iview
        if config.correction_bias is not None:
            fview = np.ascontiguousarray(config.correction_bias, dtype=np.float32)
            keep.append(fview)
            self.r.bias = &fview[0]
        if config.expert_scale is not None:
            fview = np.ascontiguousarray(config.expert_scale, dtype=np.float32)
            keep.append(fview)
            self.r.expert_scale = &fview[0]
        self.r.num_groups = 1
        self.r.topk_groups = 1
        self.r.group_score = GROUP_SCORES[config.group_score]
        self.r.group_start = NULL
        self.r.group_members = NULL
        self.r.groups_in_order = 1
        groups = config.groups()
        if len(groups) > 1:
            iview = np.cumsum([0] + [len(g) for g in groups], dtype=np.int32)
            keep.append(iview)
            self.r.group_start = &iview[0]
            members = np.concatenate([np.asarray(g, np.int32) for g in groups])
            iview = members
            keep.append(iview)
            self.r.group_members = &iview[0]
            self.r.num_groups = len(groups)
            self.r.topk_groups = config.topk_groups
            self.r.groups_in_order = bool(np.array_equal(members, np.arange(num_experts)))
        self._keep = keep
        if use_avx512 and not colibri_cpu_has_avx512():
            raise ValueError("use_avx512=True, but this CPU has no AVX-512F (or COLIBRI_SIMD "
                             "caps the path below avx512, or this build, made without "
                             "GCC/Clang on x86-64, has no AVX-512 code); leave "
                             "use_avx512=None to use it only where it runs")
        self.r.use_avx512 = colibri_cpu_has_avx512() if use_avx512 is None else use_avx512
        if use_avx2 and not colibri_cpu_has_avx2():
            raise ValueError("use_avx2=True, but this CPU has no AVX2 (or COLIBRI_SIMD caps "
                             "the path below avx2, or this build, made without GCC/Clang on "
                             "x86-64, has no AVX2 code); leave use_avx2=None to use it only "
                             "where it runs")
        self.r.use_avx2 = colibri_cpu_has_avx2() if use_avx2 is None else use_avx2
        self._r_one = self.r
        self._r_one.use_avx512 = 0
        self._scratch = colibri_scratch_layout(&self.r)
        self.collect_stats = config.collect_stats
        self._stats_lock = threading.Lock()
        # each thread's rows start on their own cache lines (8 int64 = 64 bytes), else two
        # threads counting the experts at a row boundary fight over one line
        self._counts_stride = (num_experts + 7) // 8 * 8 + 8
        self._pairs_stride = (num_experts * num_experts + 7) // 8 * 8 + 8
        self._counts = np.zeros((routing_threads * CHUNKS_PER_THREAD, self._counts_stride),
                                np.int64)
        self._coactivation = np.zeros((routing_threads * CHUNKS_PER_THREAD, self._pairs_stride),
                                      np.int64)
        self.tokens_routed = 0

    def _usage_arrays(self):
        """(counts [E], coactivation [E, E], tokens) copied under the statistics lock."""
        with self._stats_lock:
            E = self.num_experts
            counts = self._counts[:, :E].sum(axis=0)
            pairs = self._coactivation[:, : E * E].sum(axis=0).reshape(E, E)  # each pair once
            coactivation = pairs + pairs.T
            np.fill_diagonal(coactivation, counts)
            return counts, coactivation, self.tokens_routed

    def reset_stats(self):
        """Zero the usage statistics."""
        with self._stats_lock:
            self._counts[:] = 0
            self._coactivation[:] = 0
            self.tokens_routed = 0

    @property
    def use_avx512(self):
        """Whether batched calls run the AVX-512F kernels."""
        return bool(self.r.use_avx512)

    @property
    def use_avx2(self):
        """Whether calls run the AVX2 kernels (where the AVX-512F ones do not apply)."""
        return bool(self.r.use_avx2)

    def set_collect_stats(self, bint on):
        self.collect_stats = on

    def route(self, logits, *, out=None):
        """Top-k experts and weights of each token.

        Parameters
        ----------
        logits : array or DLPack capsule, ``[T, E]`` or ``[E]``
            float32, float64, float16 or bfloat16, any strides, never written.
        out : (ids, weights), optional
            Writable buffers ``[T, k]`` (``[k]`` for one token), ids int32 (or the context's
            ids dtype) and weights float32, any DLPack producer; filled and returned.

        Returns
        -------
        ids : ``[T, k]`` int32, weights : ``[T, k]`` float32
            In the caller's framework; rows sorted by descending score, ties to the lower id.
        """
        cdef HostTensor x = import_tensor(logits, False, "route(logits)")
        if _logits_dtype(x.dtype) < 0:
            raise TypeError(f"route(logits): logits must be floating point (float32, float64, "
                            f"float16 or bfloat16), got {DTYPE_NAMES[x.dtype]}")
        if x.ndim != 1 and x.ndim != 2:
            raise ValueError(f"route(logits): logits must be [E] or [T, E], got shape "
                             f"{x.shape}; reshape to (-1, {self.num_experts})")
        if x.dims[x.ndim - 1] != self.num_experts:
            raise ValueError(f"route(logits): last dimension is {x.dims[x.ndim - 1]} but the "
                             f"context routes {self.num_experts} experts; pass [T, "
                             f"{self.num_experts}] logits or init() a context with "
                             f"num_experts={x.dims[x.ndim - 1]}")
        cdef Py_ssize_t T = x.dims[0] if x.ndim == 2 else 1
        cdef Py_ssize_t k = self.top_k
        cdef int64_t xs0 = x.steps[0] if x.ndim == 2 else 0
        cdef int64_t xs1 = x.steps[x.ndim - 1]
        cdef HostTensor ids_t, w_t
        cdef char *lo
        cdef char *hi
        cdef char *olo
        cdef char *ohi
        cdef tuple shape
        if x.ndim == 2:
            shape = (T, k)
        else:
            shape = (k,)
        if out is None:
            ids_arr, ids_t, converted = new_result(logits, shape, INT64 if self.ids64 else INT32)
            w_arr, w_t, converted = new_result(logits, shape, FLOAT32)
        else:
            if not isinstance(out, tuple) or len(out) != 2:
                raise TypeError("route(out=...): out must be a tuple (ids, weights)")
            ids_arr, w_arr = out
            ids_t = import_tensor(ids_arr, True, "route(out ids)")
            w_t = import_tensor(w_arr, True, "route(out weights)")
            if not (_has_shape(ids_t, x.ndim, T, k) and _has_shape(w_t, x.ndim, T, k)):
                raise ValueError(f"route(out=...): buffers must have shape {shape}, got ids "
                                 f"{ids_t.shape} and weights {w_t.shape}")
            if ids_t.dtype != (INT64 if self.ids64 else INT32):
                raise TypeError(f"route(out=...): ids must be {self._ids_dtype}, got "
                                f"{DTYPE_NAMES[ids_t.dtype]}")
            if w_t.dtype != FLOAT32:
                raise TypeError(f"route(out=...): weights must be float32, got "
                                f"{DTYPE_NAMES[w_t.dtype]}")
            if _self_overlapping(ids_t) or _self_overlapping(w_t):
                raise ValueError("route(out=...): an out buffer has a zero stride, so its "
                                 "elements overlap; pass a buffer with one slot per result")
            if x.span(&lo, &hi):
                for o in (ids_t, w_t):
                    if (<HostTensor>o).span(&olo, &ohi) and olo < hi and lo < ohi:
                        raise ValueError("route(out=...): an out buffer overlaps the logits; "
                                         "pass separate buffers")
            if ids_t.span(&lo, &hi) and w_t.span(&olo, &ohi) and olo < hi and lo < ohi:
                raise ValueError("route(out=...): the ids and weights buffers overlap")
        if T:
            self._run(x, T, xs0, xs1, ids_t, w_t)
        if out is not None or converted:
            return ids_arr, w_arr
        return to_caller(ids_arr, logits), to_caller(w_arr, logits)

    cdef int _run(self, HostTensor x, Py_ssize_t T, int64_t xs0, int64_t xs1,
                  HostTensor ids_t, HostTensor w_t) except -1:
        cdef RowJob job
        cdef SpanJob span
        job.router = &self.r if T > 1 else &self._r_one
        job.x = x.data
        job.xs0 = xs0
        job.xs1 = xs1
        job.x_itemsize = x.itemsize
        job.x_dtype = _logits_dtype(x.dtype)  # checked by route()
        job.ids = ids_t.data
        job.ids_s0 = ids_t.steps[0] if ids_t.ndim == 2 else 0
        job.ids_s1 = ids_t.steps[ids_t.ndim - 1]
        job.ids_itemsize = ids_t.itemsize
        job.ids64 = self.ids64
        job.w = <float *>w_t.data
        job.w_s0 = w_t.steps[0] if w_t.ndim == 2 else 0
        job.w_s1 = w_t.steps[w_t.ndim - 1]
        job.k = self.top_k
        job.E = self.num_experts
        job.scratch = self._scratch
        job.rows8 = (colibri_rows8_eligible(&self.r) and x.dtype == FLOAT32 and xs1 == 1
                     and (<uintptr_t>x.data) % 4 == 0)
        job.block = colibri_block_rows(job.router)
        cdef size_t slot = self._scratch.bytes  # one chunk's scratch
        cdef Py_ssize_t chunks = 1, c, bad = T
        cdef int status = COLIBRI_OK
        cdef char stack_scratch[8192]
        cdef char *scratch = stack_scratch
        cdef Py_ssize_t *bad_rows = NULL
        cdef int *bad_codes = NULL
        cdef int64_t[:, ::1] counts
        cdef int64_t[:, ::1] coact
        cdef Py_ssize_t cs = self._counts_stride, ps = self._pairs_stride
        cdef int64_t *cnt = NULL
        cdef int64_t *co = NULL
        cdef Py_ssize_t rows_per_thread = _rows_per_thread(&self.r)
        if T > rows_per_thread and self.routing_threads > 1:
            chunks = min(<Py_ssize_t>self.routing_threads * CHUNKS_PER_THREAD,
                         (T + rows_per_thread - 1) // rows_per_thread)
        if self.collect_stats:
            # counted while routing, into per-chunk accumulators the context keeps (one
            # statistics-collecting call at a time); a failed call takes its counts back
            self._stats_lock.acquire()
            counts = self._counts
            coact = self._coactivation
            cnt = &counts[0, 0]
            co = &coact[0, 0]
        try:
            if chunks == 1 and slot <= sizeof(stack_scratch):
                # the latency path: no allocation, no parallel region
                _route_span(&job, 0, T, scratch, cnt, co, &bad, &status)
                if status != COLIBRI_OK and cnt != NULL:
                    _uncount_span(&job, 0, bad, scratch, cnt, co)
            else:
                scratch = <char *>malloc(slot * chunks)
                bad_rows = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * chunks)
                bad_codes = <int *>malloc(sizeof(int) * chunks)
                if scratch == NULL or bad_rows == NULL or bad_codes == NULL:
                    free(scratch)
                    free(bad_rows)
                    free(bad_codes)
                    raise MemoryError("route(): could not allocate routing scratch")
                for c in range(chunks):
                    bad_rows[c] = (c + 1) * T // chunks  # the chunk's end: all rows routed
                    bad_codes[c] = COLIBRI_OK
                # one contiguous block of rows per chunk, CHUNKS_PER_THREAD per thread; the
                # caller takes every chunk no helper has claimed yet (no wait for a thread
                # the OS has not run: colibri/pool.h)
                span.job = &job
                span.T = T
                span.chunks = chunks
                span.scratch = scratch
                span.slot = slot
                span.cnt = cnt
                span.co = co
                span.cs = cs
                span.ps = ps
                span.bad_rows = bad_rows
                span.bad_codes = bad_codes
                with nogil:
                    colibri_pool_run(_route_chunk, &span, <int32_t>chunks,
                                     <int>min(chunks, <Py_ssize_t>self.routing_threads))
                for c in range(chunks):
                    if bad_codes[c] != COLIBRI_OK and bad_rows[c] < bad:
                        bad = bad_rows[c]
                        status = bad_codes[c]
                if status != COLIBRI_OK and cnt != NULL:
                    for c in range(chunks):  # bad_rows[c]: where chunk c stopped routing
                        _uncount_span(&job, c * T // chunks, bad_rows[c], scratch,
                                      cnt + c * cs, co + c * ps)
                free(scratch)
                free(bad_rows)
                free(bad_codes)
            if cnt != NULL and status == COLIBRI_OK:
                self.tokens_routed += T
        finally:
            if cnt != NULL:
                self._stats_lock.release()
        if status == COLIBRI_ROW_NAN:
            raise ValueError(f"route(logits): row {bad} contains NaN; colibri refuses to route "
                             "NaN logits (check the gate's input, or replace NaN with "
                             "torch.nan_to_num / np.nan_to_num)")
        if status == COLIBRI_ROW_ALL_NEG_INF:
            raise ValueError(f"route(logits): row {bad}: every logit the softmax needs is -inf, "
                             "so the weights are undefined (0/0); check the gate's mask")
        if status == COLIBRI_ROW_SHORT:
            raise RuntimeError(f"route(): row {bad} kept fewer than top_k={self.top_k} "
                               "experts; this is a colibri bug, please report it")
        return 0
