# Build-time OpenMP facts, readable from Cython without requiring OpenMP.
cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define COLIBRI_OPENMP 1
    #define COLIBRI_OPENMP_VERSION _OPENMP
    static int colibri_max_threads(void) { return omp_get_max_threads(); }
    #else
    #define COLIBRI_OPENMP 0
    #define COLIBRI_OPENMP_VERSION 0
    static int colibri_max_threads(void) { return 1; }
    #endif
    """
    const int COLIBRI_OPENMP
    const int COLIBRI_OPENMP_VERSION
    int colibri_max_threads() noexcept nogil
