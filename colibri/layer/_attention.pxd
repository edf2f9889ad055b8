# The layout the attention kernel reads its keys and values in, for _attention.pyx and
# _step.pyx: [Hkv, L, D] with each head's L rows of D values packed, the heads any distance
# apart (a cache with room to grow: rows [:L] of [Hkv, capacity, D]).

from libc.stdint cimport int64_t

from colibri.layer._half cimport value_t


cdef inline int64_t head_stride(const value_t[:, :, :] a, str what, str where) except -1:
    """Values from one head's rows of ``a`` to the next's; ValueError naming ``what`` and
    ``where`` when a head's rows are not packed."""
    cdef Py_ssize_t size = sizeof(value_t), L = a.shape[1], D = a.shape[2]
    if a.shape[0] <= 1:
        return L * D
    if ((D > 1 and a.strides[2] != size) or (L > 1 and a.strides[1] != D * size)
            or a.strides[0] % size or a.strides[0] < L * D * size):
        raise ValueError(
            f"{where}: {what} must hold each head's [L, D] rows packed, the heads apart "
            f"(strides {[a.strides[0], a.strides[1], a.strides[2]]} for {size}-byte values)"
        )
    return a.strides[0] // size
