"""The process's one worker pool (``include/colibri/pool.h``): every compiled module of
colibri runs its kernels' chunks on these helper threads (``share_pool()`` at import), so
that one helper a spare core waits for the next call, not one a module."""

from cpython.pycapsule cimport PyCapsule_New

#: This module's pool as a capsule for the others' ``share_pool()``; None where kernels run
#: OpenMP loops instead (no POSIX threads).
POOL = (PyCapsule_New(colibri_pool_instance(), "colibri.pool", NULL)
        if colibri_pool_instance() != NULL else None)
