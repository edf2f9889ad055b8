# DLPack intake shared by colibri's compiled modules (see _capsule.pyx).
from cpython.buffer cimport Py_buffer
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "colibri/dlpack.h" nogil:
    ctypedef struct DLDevice:
        int device_type
        int32_t device_id

    ctypedef struct DLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes

    ctypedef struct DLTensor:
        void *data
        DLDevice device
        int32_t ndim
        DLDataType dtype
        int64_t *shape
        int64_t *strides
        uint64_t byte_offset

    ctypedef struct DLManagedTensor:
        DLTensor dl_tensor
        void *manager_ctx
        void (*deleter)(DLManagedTensor *)

    ctypedef struct DLPackVersion:
        uint32_t major
        uint32_t minor

    ctypedef struct DLManagedTensorVersioned:
        DLPackVersion version
        void *manager_ctx
        void (*deleter)(DLManagedTensorVersioned *)
        uint64_t flags
        DLTensor dl_tensor

    ctypedef struct DLPackExchangeAPIHeader:
        DLPackVersion version
        DLPackExchangeAPIHeader *prev_api

    ctypedef struct DLPackExchangeAPI:
        DLPackExchangeAPIHeader header
        int (*managed_tensor_allocator)(DLTensor *prototype, DLManagedTensorVersioned **out,
                                        void *error_ctx,
                                        void (*SetError)(void *, const char *, const char *))
        int (*managed_tensor_from_py_object_no_sync)(void *py_object,
                                                     DLManagedTensorVersioned **out)
        int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor,
                                                   void **out_py_object)
        int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out)
        int (*current_work_stream)(int device_type, int32_t device_id, void **out_stream)

    uint64_t DLPACK_FLAG_BITMASK_READ_ONLY
    uint64_t DLPACK_FLAG_BITMASK_IS_COPIED
    int COLIBRI_DLPACK_MAJOR
    int COLIBRI_DLPACK_MINOR


# Element types colibri reads and writes.
cpdef enum DType:
    FLOAT32 = 0
    FLOAT64 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    INT32 = 4
    INT64 = 5
    UINT8 = 6
    BOOL = 7
    INT16 = 8
    UINT16 = 9
    INT8 = 10

cdef enum:
    MAX_NDIM = 8


cdef class HostTensor:
    """A host-readable view of a producer's tensor. It owns what keeps the memory alive (the
    DLPack managed tensor, whose deleter it calls exactly once, or a buffer-protocol view)."""
    cdef char *data               # first element (byte_offset applied); NULL when empty
    cdef int ndim
    cdef int64_t dims[MAX_NDIM]
    cdef int64_t steps[MAX_NDIM]   # strides in elements, never NULL
    cdef DType dtype
    cdef int itemsize
    cdef bint readonly
    cdef bint copied              # the producer exported a copy (DLPack IS_COPIED)
    cdef object source            # the object the tensor came from (for the caller's framework)
    cdef void *managed
    cdef bint versioned
    cdef Py_buffer view
    cdef bint has_view

    cdef int64_t size(self) noexcept
    cdef bint span(self, char **lo, char **hi) noexcept


cdef HostTensor import_tensor(object obj, bint writable, str what)
cdef tuple new_result(object like, tuple shape, DType dtype)
