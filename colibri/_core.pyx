"""colibri's compiled core: OpenMP facts (routing kernels land here)."""

from colibri._openmp cimport COLIBRI_OPENMP, COLIBRI_OPENMP_VERSION, colibri_max_threads


def openmp_enabled():
    """True when the extension was compiled with OpenMP."""
    return bool(COLIBRI_OPENMP)


def openmp_version():
    """The ``_OPENMP`` date macro the extension was compiled with (0 without OpenMP)."""
    return COLIBRI_OPENMP_VERSION


def max_threads():
    """OpenMP's default thread count (``OMP_NUM_THREADS`` or the core count); 1 without OpenMP."""
    return colibri_max_threads()
