"""colibri's compiled expert kernels (include/colibri/ffn.h), its linear kernel
(include/colibri/linear.h) and the SIMD dispatch facts (include/colibri/cpu.h): which path
runs, which ones this CPU can run."""

from libc.stdint cimport int32_t, int64_t, uint16_t, uint64_t
from libc.stdlib cimport free, malloc

from colibri._openmp cimport colibri_max_threads
from colibri._pool cimport share_pool
from colibri.layer._half cimport COLIBRI_W_BF16, COLIBRI_W_F16
from colibri.layer._kernels cimport (
    colibri_linear_run,
    colibri_linear_split_bytes,
    colibri_linear_t,
)
from colibri.layer._plan cimport check_plan

share_pool()  # one worker pool a process (colibri/_pool.pyx)


cdef extern from "colibri/cpu.h" nogil:
    enum:
        COLIBRI_PATH_SCALAR
        COLIBRI_PATH_AVX2
        COLIBRI_PATH_AVX512
        COLIBRI_PATH_AVX512_BF16
        COLIBRI_PATH_COUNT
    const char *const colibri_path_names[]
    int colibri_cpu_detect() noexcept
    int colibri_cpu_has_avx512fp16() noexcept
    int colibri_cpu_halves512() noexcept
    int colibri_simd_env() noexcept
    int colibri_simd_path() noexcept
    int colibri_path_runs(int path) noexcept


PATHS = tuple(colibri_path_names[i].decode() for i in range(COLIBRI_PATH_COUNT))
MAX_ROWS = COLIBRI_FFN_MAX_ROWS
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu": 3}
WEIGHT_KINDS = {"float16": COLIBRI_W_F16, "bfloat16": COLIBRI_W_BF16}


def simd_env_check():
    """Raise ValueError when COLIBRI_SIMD names no path."""
    if colibri_simd_env() == -2:
        import os

        raise ValueError(
            f"COLIBRI_SIMD must be one of {', '.join(PATHS)} or unset "
            f"(got {os.environ.get('COLIBRI_SIMD')!r})"
        )


def simd_path():
    """The SIMD path the kernels take: the CPU's best, capped by COLIBRI_SIMD."""
    simd_env_check()
    return PATHS[colibri_simd_path()]


def detected_path():
    """The best SIMD path this CPU runs, whatever COLIBRI_SIMD says."""
    return PATHS[colibri_cpu_detect()]


def has_avx512fp16():
    """Whether this CPU has AVX512_FP16 (torch's GEMMs then compute float16 natively)."""
    return bool(colibri_cpu_has_avx512fp16())


def runnable_paths():
    """Every SIMD path this CPU runs, lowest first."""
    return tuple(p for i, p in enumerate(PATHS) if colibri_path_runs(i))


cdef int _ffn_default() except -1:
    # Native bf16 dot products need x split in two bfloat16 parts for float32-grade results,
    # and were measured slower than converting the weights (bench/README.md, Kernels): the
    # kernels take the avx512 path there unless asked for avx512_bf16 by name. A CPU that
    # runs 512-bit vectors as two halves (Zen 4) ran them faster on 256-bit ones: avx2.
    simd_env_check()
    cdef int p = colibri_simd_path()
    if (p == COLIBRI_PATH_AVX512 or p == COLIBRI_PATH_AVX512_BF16) and colibri_cpu_halves512():
        return COLIBRI_PATH_AVX2
    return COLIBRI_PATH_AVX512 if p == COLIBRI_PATH_AVX512_BF16 else p


def ffn_path():
    """The SIMD path colibri's layer kernels take by default: the CPU's best, capped by
    COLIBRI_SIMD; avx512 for avx512_bf16, and avx2 on a CPU that runs 512-bit vectors as two
    256-bit halves (AMD Zen 4), where it was measured faster."""
    return PATHS[_ffn_default()]


def path_index(path):
    """The index of a path name (None: the FFN kernel's default); ValueError if it cannot run."""
    if path is None:
        return _ffn_default()
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS} or None (got {path!r})")
    cdef int i = PATHS.index(path)
    if not colibri_path_runs(i):
        raise ValueError(f"path {path!r} does not run on this CPU (it runs {runnable_paths()})")
    return i


def ffn(const float[:, :] x, const uint16_t[:, :] gate, const uint16_t[:, :] up,
        const uint16_t[:, :] down, int kind, int act, float[:, :] y, int num_threads, path=None):
    """y = down @ (act(gate @ x.T) * (up @ x.T)), transposed: the fused kernel.

    x [n, H] float32 (rows contiguous), gate/up [I, H] and down [H, I] uint16 bits of
    float16 (kind 1) or bfloat16 (kind 2), y [n, H] float32; shapes checked by the caller
    (colibri.layer.expert_ffn). ``path``: a name from PATHS (tests), None for the dispatched
    one."""
    cdef colibri_ffn_t f
    cdef size_t split
    cdef float *h = NULL
    f.n = <int32_t>x.shape[0]
    f.H = <int32_t>x.shape[1]
    f.I = <int32_t>gate.shape[0]
    if f.n < 1 or f.n > COLIBRI_FFN_MAX_ROWS:
        raise ValueError(f"ffn(): 1 to {COLIBRI_FFN_MAX_ROWS} rows (got {f.n})")
    if f.H < 1 or f.I < 1:
        raise ValueError(f"ffn(): empty weights (H={f.H}, I={f.I})")
    if (x.strides[1] != 4 and f.H > 1) or (y.strides[1] != 4 and f.H > 1):
        raise ValueError("ffn(): x and y rows must be contiguous float32")
    ffn_weights(&f, gate, up, down, kind, act, path_index(path))
    f.x = &x[0, 0]
    f.ldx = x.strides[0] // 4
    f.y = &y[0, 0]
    f.ldy = y.strides[0] // 4
    split = colibri_ffn_split_bytes(&f)
    h = <float *>malloc(<size_t>f.n * f.I * sizeof(float) + split + 64)
    if h == NULL:
        raise MemoryError()
    f.h = h
    if split:
        f.xs = <uint16_t *>(h + <size_t>f.n * f.I)
    if num_threads < 1:
        num_threads = colibri_max_threads()
    with nogil:
        colibri_ffn_run(&f, num_threads)
    free(h)


def ffn_sum(const float[:, :] x, list experts, int kind, int act,
            const int64_t[::1] bounds, const int64_t[::1] rows, const float[::1] scale,
            float[:, :] y, int num_threads, path=None):
    """y[rows[i]] += scale[i] * ffn_j(x[rows[i]]) for i in [bounds[j], bounds[j + 1]): a
    layer's experts in one call, two passes on the pool for all of them (decoding).

    x [T, H] and y [T, H] float32 (rows contiguous); experts[j] = (gate [I, H], up [I, H],
    down [H, I]) uint16 bits of one ``kind``; rows int64 in [0, T) and scale float32 per
    assignment, grouped by expert as bounds (int64 [len(experts) + 1], from 0) says, 1 to
    MAX_ROWS rows an expert. Shapes are checked here; float32 accumulation throughout."""
    cdef Py_ssize_t count = len(experts), j
    cdef int64_t T = x.shape[0], H = x.shape[1], total
    cdef colibri_ffn_t *fs = NULL
    cdef const uint16_t[:, :] g, u, d
    cdef int p = path_index(path)
    if y.shape[0] != T or y.shape[1] != H or (H > 1 and (x.strides[1] != 4 or y.strides[1] != 4)):
        raise ValueError(f"ffn_sum(): y must be [{T}, {H}] like x, rows contiguous float32")
    total = check_plan(count, T, bounds, rows, scale)
    if count == 0:
        return
    if num_threads < 1:
        num_threads = colibri_max_threads()
    fs = <colibri_ffn_t *>malloc(count * sizeof(colibri_ffn_t))
    try:
        if fs == NULL:
            raise MemoryError()
        for j in range(count):
            g, u, d = experts[j]
            if g.shape[1] != H or u.shape[0] != g.shape[0] or u.shape[1] != H \
                    or d.shape[0] != H or d.shape[1] != g.shape[0] or g.shape[0] < 1:
                raise ValueError(f"ffn_sum(): expert {j} must be gate/up [I, {H}] and down "
                                 f"[{H}, I] (got {tuple(g.shape)}, {tuple(u.shape)}, "
                                 f"{tuple(d.shape)})")
            fs[j].n = <int32_t>(bounds[j + 1] - bounds[j])
            fs[j].H = <int32_t>H
            fs[j].I = <int32_t>g.shape[0]
            ffn_weights(&fs[j], g, u, d, kind, act, p)
        ffn_run_sum(fs, count, bounds, rows, scale, total, x, y, num_threads)
    finally:
        free(fs)


cdef extern from *:
    """
    #include <stdint.h>
    #include <stddef.h>
    /* Sum of the 64-bit words of [p, p + 8 n): one read pass (the memory floor). */
    static uint64_t colibri_read_pass(const uint64_t *p, int64_t n, int threads)
    {
        const int64_t block = 8192; /* 64 KiB per claim: long vectorizable runs */
        uint64_t total = 0;
        int64_t b;
    #ifdef _OPENMP
    #pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static) \
        if (threads > 1)
    #endif
        for (b = 0; b < (n + block - 1) / block; b++) {
            int64_t j, start = b * block, stop = start + block < n ? start + block : n;
            uint64_t s = 0;
            for (j = start; j < stop; j++)
                s += p[j];
            total += s;
        }
        (void)threads;
        return total;
    }
    """
    uint64_t colibri_read_pass(const uint64_t *p, int64_t n, int threads) noexcept nogil


def read_pass(const uint64_t[::1] words, int num_threads=0):
    """Read every word of ``words`` once (their wrapping sum): the memory floor for benches."""
    cdef uint64_t total
    if num_threads < 1:
        num_threads = colibri_max_threads()
    if words.shape[0] == 0:
        return 0
    with nogil:
        total = colibri_read_pass(&words[0], words.shape[0], num_threads)
    return total


def linear(const float[:, :] x, const uint16_t[:, :] w, int kind, float[:, :] y,
           int num_threads, const float[::1] bias=None, path=None):
    """y = x @ w.T (+ bias): colibri's linear kernel (include/colibri/linear.h).

    x [n, in] float32 (rows contiguous), w [out, in] uint16 bits of float16 (kind 1) or
    bfloat16 (kind 2), rows contiguous; y [n, out] float32 (rows contiguous), written;
    bias float32 [out] or None, added in float32. Any n (decode: a few rows); float32
    accumulation, the bits independent of ``num_threads`` (< 1: colibri's default).
    ``path``: a name from PATHS (tests), None for the dispatched one."""
    cdef colibri_linear_t f
    cdef size_t split
    cdef uint16_t *xs = NULL
    if w.shape[1] != x.shape[1] or y.shape[0] != x.shape[0] or y.shape[1] != w.shape[0]:
        raise ValueError(
            f"linear(): x [n, in], w [out, in] and y [n, out] (got x {(x.shape[0], x.shape[1])}, "
            f"w {(w.shape[0], w.shape[1])}, y {(y.shape[0], y.shape[1])})")
    if bias is not None and bias.shape[0] != w.shape[0]:
        raise ValueError(f"linear(): bias must be float32 [{w.shape[0]}] (got "
                         f"[{bias.shape[0]}])")
    if kind != COLIBRI_W_F16 and kind != COLIBRI_W_BF16:
        raise ValueError(f"linear(): kind must be one of {WEIGHT_KINDS} (got {kind})")
    if x.shape[0] > 0x7fffffff or w.shape[0] > 0x7fffffff or w.shape[1] > 0x7fffffff:
        raise ValueError("linear(): more than 2^31 - 1 rows or features")
    if (x.shape[1] > 1 and x.strides[1] != 4) or (y.shape[1] > 1 and y.strides[1] != 4):
        raise ValueError("linear(): x and y rows must be contiguous float32")
    if x.shape[1] < 1:
        raise ValueError("linear(): empty weights (in = 0)")
    if w.shape[1] > 1 and w.strides[1] != 2:
        raise ValueError(f"linear(): w rows must be contiguous (got strides "
                         f"{(w.strides[0], w.strides[1])}); pass np.ascontiguousarray(w)")
    f.n = <int32_t>x.shape[0]
    f.in_dim = <int32_t>x.shape[1]
    f.out_dim = <int32_t>w.shape[0]
    f.kind = kind
    f.path = path_index(path)
    if f.n == 0 or f.out_dim == 0:
        return
    f.w = &w[0, 0]
    f.ldw = w.strides[0] // 2
    f.x = &x[0, 0]
    f.ldx = x.strides[0] // 4
    f.y = &y[0, 0]
    f.ldy = y.strides[0] // 4
    f.bias = &bias[0] if bias is not None else NULL
    f.xs = NULL
    split = colibri_linear_split_bytes(&f)
    if split:
        xs = <uint16_t *>malloc(split)
        if xs == NULL:
            raise MemoryError()
        f.xs = xs
    if num_threads < 1:
        num_threads = colibri_max_threads()
    with nogil:
        colibri_linear_run(&f, num_threads)
    free(xs)
