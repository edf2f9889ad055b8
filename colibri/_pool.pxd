# colibri's worker pool (include/colibri/pool.h), one a process: every compiled module that
# runs kernels on it calls share_pool() when it is imported.

from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport int64_t


cdef extern from "colibri/pool.h" nogil:
    enum:
        COLIBRI_POOL_WARM_RANGES  # the most ranges a warm takes
    void *colibri_pool_instance() noexcept
    void colibri_pool_share(void *pool) noexcept
    void colibri_pool_warm(const void *const *at, const int64_t *bytes, int count) noexcept


cdef inline int share_pool() except -1:
    """Run this module's kernels on the process's one pool (``colibri._pool``'s)."""
    from colibri._pool import POOL

    if POOL is not None:
        colibri_pool_share(PyCapsule_GetPointer(POOL, "colibri.pool"))
    return 0
