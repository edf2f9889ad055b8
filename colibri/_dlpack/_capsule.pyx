"""DLPack intake and return: colibri's own capsule consumer.

Anything that speaks DLPack (``__dlpack__`` / ``__dlpack_device__``: torch, jax, numpy, cupy,
...) or a raw ``"dltensor"`` / ``"dltensor_versioned"`` capsule becomes a :class:`HostTensor`:
a pointer, shape, strides in elements and a dtype that colibri decodes itself (bfloat16
included, which numpy cannot import). NumPy arrays take the buffer protocol, which reads the
same memory with less overhead, and arrays of numpy's own numeric dtypes are read straight
from numpy's C struct (no buffer export: a one-token route imports three of them). Results go
back through :func:`to_caller`, zero-copy.
"""

from cpython.buffer cimport (PyBUF_FORMAT, PyBUF_RECORDS, PyBUF_RECORDS_RO,
                             PyBuffer_Release, PyObject_GetBuffer)
from cpython.pycapsule cimport (PyCapsule_CheckExact, PyCapsule_GetPointer, PyCapsule_IsValid,
                                PyCapsule_SetName)
from cpython.exc cimport PyErr_Clear, PyErr_SetString
from cpython.long cimport PyLong_AsVoidPtr
from cpython.ref cimport Py_DECREF
cimport numpy as cnp
from libc.stdint cimport (INT64_MAX, INT64_MIN, PTRDIFF_MAX, UINTPTR_MAX, int64_t, uint64_t,
                          uintptr_t)

import sys

import numpy as np

_HOST_DEVICES = {1: "cpu", 3: "cuda_host", 11: "rocm_host", 13: "cuda_managed"}
_DEVICE_NAMES = {2: "cuda", 4: "opencl", 7: "vulkan", 8: "metal", 10: "rocm", 14: "oneapi",
                 15: "webgpu", 16: "hexagon", 17: "maia"}
_ITEMSIZE = {FLOAT32: 4, FLOAT64: 8, FLOAT16: 2, BFLOAT16: 2, INT32: 4, INT64: 8, UINT8: 1,
             BOOL: 1, INT16: 2, UINT16: 2, INT8: 1}
DTYPE_NAMES = {FLOAT32: "float32", FLOAT64: "float64", FLOAT16: "float16", BFLOAT16: "bfloat16",
               INT32: "int32", INT64: "int64", UINT8: "uint8", BOOL: "bool", INT16: "int16",
               UINT16: "uint16", INT8: "int8"}
# numpy storage for each dtype (bfloat16 is stored as uint16)
_NUMPY_STORAGE = {FLOAT32: np.float32, FLOAT64: np.float64, FLOAT16: np.float16,
                  BFLOAT16: np.uint16, INT32: np.int32, INT64: np.int64, UINT8: np.uint8,
                  BOOL: np.bool_, INT16: np.int16, UINT16: np.uint16, INT8: np.int8}
_DL_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat",
                  5: "complex", 6: "bool"}
_ndarray = np.ndarray
cnp.import_array()


cdef int _dl_dtype(DLDataType t, str what) except -1:
    if t.lanes != 1:
        raise TypeError(f"{what}: vector dtypes (lanes={t.lanes}) are not supported; pass a "
                        "tensor of scalars")
    if t.code == 2:
        if t.bits == 32:
            return FLOAT32
        if t.bits == 64:
            return FLOAT64
        if t.bits == 16:
            return FLOAT16
    elif t.code == 4 and t.bits == 16:
        return BFLOAT16
    elif t.code == 0:
        if t.bits == 32:
            return INT32
        if t.bits == 64:
            return INT64
        if t.bits == 16:
            return INT16
        if t.bits == 8:
            return INT8
    elif t.code == 1:
        if t.bits == 8:
            return UINT8
        if t.bits == 16:
            return UINT16
    elif t.code == 6 and t.bits == 8:
        return BOOL
    name = _DL_CODE_NAMES.get(t.code, f"fp8/fp6/fp4 or unknown (DLPack code {t.code})")
    raise TypeError(f"{what}: unsupported dtype {name}{t.bits}; colibri reads float32, "
                    "float64, float16 and bfloat16 (and int32/int64 ids)")


cdef int _buffer_dtype(bytes fmt, Py_ssize_t itemsize, str what) except -1:
    cdef bytes code = fmt
    if code[:1] in (b"@", b"=", b"<"):
        code = code[1:]
    elif code[:1] in (b">", b"!"):
        raise TypeError(f"{what}: big-endian data is not supported; convert it to native byte "
                        "order first (arr.astype(arr.dtype.newbyteorder('=')))")
    if code == b"f":
        return FLOAT32
    if code == b"d":
        return FLOAT64
    if code == b"e":
        return FLOAT16
    if code in (b"i", b"l", b"q") and itemsize == 4:
        return INT32
    if code in (b"l", b"q") and itemsize == 8:
        return INT64
    if code == b"h":
        return INT16
    if code == b"H":
        return UINT16
    if code == b"B":
        return UINT8
    if code == b"b":
        return INT8
    if code == b"?":
        return BOOL
    raise TypeError(f"{what}: unsupported dtype (buffer format {fmt.decode()!r}); colibri "
                    "reads float32, float64, float16 and bfloat16 (and int32/int64 ids)")


cdef class HostTensor:
    def __dealloc__(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False
        if self.managed != NULL:
            if self.versioned:
                if (<DLManagedTensorVersioned *>self.managed).deleter != NULL:
                    (<DLManagedTensorVersioned *>self.managed).deleter(
                        <DLManagedTensorVersioned *>self.managed)
            elif (<DLManagedTensor *>self.managed).deleter != NULL:
                (<DLManagedTensor *>self.managed).deleter(<DLManagedTensor *>self.managed)
            self.managed = NULL

    cdef int64_t size(self) noexcept:
        cdef int64_t n = 1
        cdef int i
        for i in range(self.ndim):
            if self.dims[i] == 0:
                return 0  # before multiplying: the other dimensions' product may not fit
        for i in range(self.ndim):
            n *= self.dims[i]  # fits: _fill checked it
        return n

    cdef bint span(self, char **lo, char **hi) noexcept:
        """The byte range [lo, hi) the tensor's elements occupy; False when empty."""
        cdef int64_t low = 0, high = 0
        cdef int i
        if self.size() == 0:
            return False
        for i in range(self.ndim):
            if self.steps[i] < 0:
                low += self.steps[i] * (self.dims[i] - 1)
            else:
                high += self.steps[i] * (self.dims[i] - 1)
        lo[0] = self.data + low * self.itemsize
        hi[0] = self.data + (high + 1) * self.itemsize
        return True

    @property
    def shape(self):
        return tuple(self.dims[i] for i in range(self.ndim))

    @property
    def strides(self):
        """Strides in elements."""
        return tuple(self.steps[i] for i in range(self.ndim))

    @property
    def dtype(self):
        return DTYPE_NAMES[self.dtype]

    @property
    def readonly(self):
        return bool(self.readonly)

    @property
    def address(self):
        return <uintptr_t>self.data

    def numpy(self):
        """A zero-copy numpy view (bfloat16 as uint16) that keeps this tensor alive."""
        return np.asarray(_NumpyView(self))


cdef class _NumpyView:
    """Presents a HostTensor through ``__array_interface__`` (numpy keeps a reference)."""
    cdef HostTensor tensor
    cdef readonly dict __array_interface__

    def __cinit__(self, HostTensor tensor):
        self.tensor = tensor
        storage = np.dtype(_NUMPY_STORAGE[tensor.dtype])
        self.__array_interface__ = {
            "version": 3,
            "shape": tensor.shape,
            "typestr": storage.str,
            "data": (<uintptr_t>tensor.data if tensor.size() else 0, bool(tensor.readonly)),
            "strides": tuple(s * tensor.itemsize for s in tensor.strides),
        }


cdef int _fill(HostTensor t, DLTensor *dl, str what) except -1:
    """Shape, strides, dtype and data of a host DLTensor into t (device checked)."""
    cdef int device = dl.device.device_type
    if device not in _HOST_DEVICES:
        name = _DEVICE_NAMES.get(device, f"device type {device}")
        raise BufferError(f"{what}: the tensor lives on {name}:{dl.device.device_id}; colibri "
                          "routes on the CPU and the producer did not copy it to the host. Move "
                          "it first (torch: .cpu(), jax: jax.device_get, cupy: .get())")
    if dl.ndim < 0 or dl.ndim > MAX_NDIM:
        raise ValueError(f"{what}: ndim={dl.ndim} is out of range (at most {MAX_NDIM})")
    if dl.ndim > 0 and dl.shape == NULL:
        raise ValueError(f"{what}: DLPack tensor has ndim={dl.ndim} but a NULL shape")
    t.dtype = <DType>_dl_dtype(dl.dtype, what)
    t.itemsize = _ITEMSIZE[t.dtype]
    t.ndim = dl.ndim
    cdef int i
    cdef int64_t step = 1, count = 1, extent = 0, reach
    cdef bint empty = False
    for i in range(dl.ndim):
        if dl.shape[i] < 0:
            raise ValueError(f"{what}: negative dimension {dl.shape[i]} in DLPack shape")
        t.dims[i] = dl.shape[i]
        empty = empty or dl.shape[i] == 0
    for i in range(dl.ndim):  # checked: the element count and the byte extent fit in int64
        if not empty and count > (INT64_MAX // t.itemsize) // t.dims[i]:
            raise ValueError(f"{what}: DLPack shape {t.shape} holds more than 2**63 bytes")
        count *= t.dims[i]
    if dl.strides == NULL:
        for i in range(dl.ndim - 1, -1, -1):
            t.steps[i] = step
            if t.dims[i] and step > INT64_MAX // t.dims[i]:
                step = 0  # past a zero dimension (the count is checked): no element addressed
            else:
                step *= t.dims[i]
    else:
        for i in range(dl.ndim):
            t.steps[i] = dl.strides[i]
            if empty or t.dims[i] < 2:
                continue
            reach = (INT64_MAX // t.itemsize - extent) // (t.dims[i] - 1)
            if dl.strides[i] == INT64_MIN or -reach > dl.strides[i] or dl.strides[i] > reach:
                strides = tuple([dl.strides[j] for j in range(dl.ndim)])
                raise ValueError(f"{what}: DLPack strides {strides} with shape {t.shape} span "
                                 "more than 2**63 bytes")
            extent += (dl.strides[i] if dl.strides[i] > 0 else -dl.strides[i]) * (t.dims[i] - 1)
    if dl.byte_offset > <uint64_t>PTRDIFF_MAX or (
            dl.data != NULL and dl.byte_offset > UINTPTR_MAX - <uintptr_t>dl.data):
        raise ValueError(f"{what}: DLPack byte_offset {dl.byte_offset} points past the end of "
                         "the address space")
    t.data = <char *>dl.data + dl.byte_offset if dl.data != NULL else NULL
    if t.data == NULL and t.size() != 0:
        raise BufferError(f"{what}: DLPack tensor has a NULL data pointer")
    return 0


cdef int _take_capsule(HostTensor t, object capsule, str what) except -1:
    """Take ownership of a DLPack capsule's managed tensor; rename it ``used_*``."""
    cdef DLManagedTensorVersioned *mv
    cdef DLManagedTensor *ml
    cdef DLTensor *dl
    if not PyCapsule_CheckExact(capsule):
        raise TypeError(f"{what}: __dlpack__() returned {type(capsule).__name__}, not a capsule")
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        mv = <DLManagedTensorVersioned *>PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        PyCapsule_SetName(capsule, b"used_dltensor_versioned")
        t.managed = mv
        t.versioned = True
        if mv.version.major != COLIBRI_DLPACK_MAJOR:
            raise BufferError(f"{what}: DLPack version {mv.version.major}.{mv.version.minor} is "
                              f"not supported (colibri reads {COLIBRI_DLPACK_MAJOR}.x)")
        dl = &mv.dl_tensor
        t.readonly = (mv.flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0
        t.copied = (mv.flags & DLPACK_FLAG_BITMASK_IS_COPIED) != 0
    elif PyCapsule_IsValid(capsule, b"dltensor"):
        ml = <DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")
        PyCapsule_SetName(capsule, b"used_dltensor")
        t.managed = ml
        t.versioned = False
        dl = &ml.dl_tensor
        t.readonly = False
    elif (PyCapsule_IsValid(capsule, b"used_dltensor")
          or PyCapsule_IsValid(capsule, b"used_dltensor_versioned")):
        raise ValueError(f"{what}: this DLPack capsule was already consumed; a capsule can be "
                         "imported once: call __dlpack__() again for a fresh one")
    else:
        raise TypeError(f"{what}: capsule is not a DLPack tensor (expected a 'dltensor' or "
                        "'dltensor_versioned' capsule)")

    _fill(t, dl, what)
    return 0


cdef int _set_shape(HostTensor t, int ndim, const Py_ssize_t *shape, const Py_ssize_t *strides,
                    object obj, str what) except -1:
    """t's dims and element steps from a shape and byte strides (t.itemsize set)."""
    cdef int i
    t.ndim = ndim
    for i in range(ndim):
        if strides[i] % t.itemsize:
            raise ValueError(f"{what}: byte strides {obj.strides} are not multiples of the item "
                             "size; pass an aligned array (np.ascontiguousarray)")
        t.dims[i] = shape[i]
        t.steps[i] = strides[i] // t.itemsize
    return 0


cdef int _take_buffer(HostTensor t, object obj, bint writable, str what) except -1:
    cdef int flags = (PyBUF_RECORDS if writable else PyBUF_RECORDS_RO) | PyBUF_FORMAT
    try:
        PyObject_GetBuffer(obj, &t.view, flags)
    except BufferError as exc:
        raise ValueError(f"{what}: the array is read-only; pass a writable array") from exc
    t.has_view = True
    if t.view.ndim > MAX_NDIM:
        raise ValueError(f"{what}: ndim={t.view.ndim} is out of range (at most {MAX_NDIM})")
    t.dtype = <DType>_buffer_dtype(t.view.format, t.view.itemsize, what)
    t.itemsize = <int>t.view.itemsize
    _set_shape(t, t.view.ndim, t.view.shape, t.view.strides, obj, what)
    t.data = <char *>t.view.buf
    t.readonly = t.view.readonly
    return 0


cdef bint _take_ndarray(HostTensor t, cnp.ndarray a, bint writable, str what) except -1:
    """Read a native-order array of a numpy numeric dtype from numpy's struct; False for any
    other array (the buffer protocol then decodes it, errors included)."""
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(a)
    cdef int nd = cnp.PyArray_NDIM(a)
    cdef DType dtype
    if nd > MAX_NDIM or not cnp.PyArray_ISNOTSWAPPED(a):
        return False
    if cnp.PyArray_ISFLOAT(a) and itemsize in (2, 4, 8):
        dtype = FLOAT16 if itemsize == 2 else FLOAT32 if itemsize == 4 else FLOAT64
    elif cnp.PyArray_ISSIGNED(a) and itemsize in (1, 2, 4, 8):
        dtype = (INT8 if itemsize == 1 else INT16 if itemsize == 2 else INT32 if itemsize == 4
                 else INT64)
    elif cnp.PyArray_ISUNSIGNED(a) and itemsize in (1, 2):
        dtype = UINT8 if itemsize == 1 else UINT16
    elif cnp.PyArray_ISBOOL(a):
        dtype = BOOL
    else:
        return False
    t.readonly = not cnp.PyArray_ISWRITEABLE(a)
    if writable and t.readonly:
        raise ValueError(f"{what}: the array is read-only; pass a writable array")
    t.dtype = dtype
    t.itemsize = <int>itemsize
    _set_shape(t, nd, <Py_ssize_t *>cnp.PyArray_DIMS(a), <Py_ssize_t *>cnp.PyArray_STRIDES(a),
               a, what)
    t.data = <char *>cnp.PyArray_DATA(a)
    return True  # t.source holds the array: its memory lives as long as t


def _export(obj, what, bint writable):
    """Ask a producer for a host capsule: negotiate the version, copy inputs from devices.

    An output (``writable``) on a device is refused: results written into a host copy
    would be lost.
    """
    try:
        device, _ = obj.__dlpack_device__()
    except AttributeError:
        raise TypeError(f"{what}: expected an array that supports DLPack (torch, jax, numpy, "
                        f"cupy, ...) or a DLPack capsule, got {type(obj).__name__}") from None
    device = int(device)
    kwargs = {"max_version": (COLIBRI_DLPACK_MAJOR, COLIBRI_DLPACK_MINOR)}
    if device not in _HOST_DEVICES:
        if writable:
            name = _DEVICE_NAMES.get(device, f"device type {device}")
            raise BufferError(f"{what}: the buffer lives on {name}, but colibri writes its "
                              "results on the host; pass CPU buffers (torch: device='cpu', "
                              "pinned if you copy them on) or leave out= unset")
        kwargs.update(dl_device=(1, 0), copy=True)
    try:
        try:
            return obj.__dlpack__(**kwargs)
        except TypeError:
            if "copy" in kwargs:
                raise
            return obj.__dlpack__()  # a producer older than DLPack 1.0's keywords
    except (BufferError, TypeError, RuntimeError, NotImplementedError) as exc:
        if getattr(obj, "requires_grad", False):
            raise ValueError(f"{what}: the tensor requires grad; pass tensor.detach() or call "
                             "under torch.no_grad()") from exc
        if device not in _HOST_DEVICES:
            name = _DEVICE_NAMES.get(device, f"device type {device}")
            raise BufferError(f"{what}: the tensor lives on {name} and its producer could not "
                              "copy it to the host through DLPack; move it first (torch: "
                              ".cpu(), jax: jax.device_get, cupy: .get())") from exc
        raise


cdef class _Exchange:
    """A framework's DLPack C exchange table (DLPack 1.2+), cached per tensor type."""
    cdef const DLPackExchangeAPI *api


cdef dict _exchange_cache = {}


cdef _Exchange _exchange_for(object tp):
    try:
        return _exchange_cache[tp]
    except KeyError:
        pass
    cdef void *ptr = NULL
    cdef _Exchange entry = None
    table = getattr(tp, "__dlpack_c_exchange_api__", None)
    if table is not None and PyCapsule_IsValid(table, b"dlpack_exchange_api"):
        ptr = PyCapsule_GetPointer(table, b"dlpack_exchange_api")
    else:
        table = getattr(tp, "__c_dlpack_exchange_api__", None)
        if isinstance(table, int):
            ptr = PyLong_AsVoidPtr(table)
    if ptr != NULL and (<DLPackExchangeAPI *>ptr).header.version.major == COLIBRI_DLPACK_MAJOR:
        entry = _Exchange.__new__(_Exchange)
        entry.api = <const DLPackExchangeAPI *>ptr
    _exchange_cache[tp] = entry
    return entry


cdef bint _take_exchange(HostTensor t, object obj, _Exchange ex, str what) except -1:
    """Borrow obj's DLTensor through the C exchange table; False to use __dlpack__ instead."""
    cdef DLTensor dl
    if ex.api.dltensor_from_py_object_no_sync == NULL:
        return False
    if ex.api.dltensor_from_py_object_no_sync(<void *>obj, &dl) != 0:
        PyErr_Clear()  # __dlpack__ gives the producer's full error message
        return False
    if dl.device.device_type not in _HOST_DEVICES:
        return False
    if getattr(obj, "requires_grad", False):
        raise ValueError(f"{what}: the tensor requires grad; pass tensor.detach() or call "
                         "under torch.no_grad()")
    _fill(t, &dl, what)  # borrowed: t.source keeps obj, and so its memory, alive
    return True


cdef int _propagate() except -1:
    """Raise the Python error a C exchange function has set."""
    return -1


cdef void _set_error(void *ctx, const char *kind, const char *message) noexcept with gil:
    """SetError for a producer's allocator: leaves a RuntimeError set for _propagate()."""
    PyErr_SetString(RuntimeError, b"%s: %s" % (<bytes>kind, <bytes>message))


cdef tuple new_result(object like, tuple shape, DType dtype):
    """A fresh C-contiguous result for a caller who passed ``like``.

    Returns ``(obj, tensor, converted)``: the object to hand back, the HostTensor to write,
    and whether obj already is in like's framework (else call :func:`to_caller` after
    writing). Frameworks with a DLPack C exchange table allocate their own tensor.
    """
    cdef HostTensor t = HostTensor.__new__(HostTensor)
    cdef _Exchange ex = None
    cdef DLTensor proto
    cdef int64_t dims[MAX_NDIM]
    cdef DLManagedTensorVersioned *managed = NULL
    cdef void *py_result = NULL
    cdef int i
    if type(like) is not _ndarray and not PyCapsule_CheckExact(like):
        ex = _exchange_for(type(like))
    if ex is not None:
        for i in range(len(shape)):
            dims[i] = shape[i]
        proto.data = NULL
        proto.device.device_type = 1
        proto.device.device_id = 0
        proto.ndim = len(shape)
        proto.dtype.code = 2 if dtype == FLOAT32 else 0  # float32, or int32 / int64 ids
        proto.dtype.bits = 64 if dtype == INT64 else 32
        proto.dtype.lanes = 1
        proto.shape = dims
        proto.strides = NULL
        proto.byte_offset = 0
        if ex.api.managed_tensor_allocator(&proto, &managed, NULL, _set_error) != 0:
            _propagate()  # _set_error left the producer's message
        if managed == NULL:
            raise MemoryError(f"route(): the {type(like).__module__} allocator returned no tensor")
        t.managed = managed  # owned until handed over below
        t.versioned = True
        _fill(t, &managed.dl_tensor, "route(result)")
        if ex.api.managed_tensor_to_py_object_no_sync(managed, &py_result) != 0:
            _propagate()  # the producer set the Python error
        t.managed = NULL  # ownership went to the new tensor
        result = <object>py_result
        Py_DECREF(result)  # <object> took a reference; the call's own one is ours to drop
        t.source = result
        return result, t, True
    cdef cnp.npy_intp npy_dims[MAX_NDIM]
    for i in range(len(shape)):
        npy_dims[i] = shape[i]
    arr = cnp.PyArray_EMPTY(len(shape), npy_dims, cnp.NPY_FLOAT32 if dtype == FLOAT32 else
                            cnp.NPY_INT64 if dtype == INT64 else cnp.NPY_INT32, 0)
    _take_ndarray(t, <cnp.ndarray>arr, True, "route(result)")
    t.source = arr
    return arr, t, False


cdef HostTensor import_tensor(object obj, bint writable, str what):
    """Import ``obj`` (array, tensor or capsule) as a HostTensor; ``writable`` for outputs."""
    if type(obj) is HostTensor:  # imported already (a capsule can be consumed only once)
        if writable and (<HostTensor>obj).readonly:
            raise ValueError(f"{what}: the tensor is read-only; pass a writable buffer")
        return <HostTensor>obj
    cdef HostTensor t = HostTensor.__new__(HostTensor)
    t.source = obj
    if type(obj) is _ndarray:
        if not _take_ndarray(t, <cnp.ndarray>obj, writable, what):
            _take_buffer(t, obj, writable, what)
        return t
    if not PyCapsule_CheckExact(obj):
        ex = _exchange_for(type(obj))
        if ex is not None and _take_exchange(t, obj, ex, what):
            return t
    _take_capsule(t, obj if PyCapsule_CheckExact(obj) else _export(obj, what, writable), what)
    if writable and t.readonly:
        raise ValueError(f"{what}: the tensor is read-only (DLPack READ_ONLY flag); pass a "
                         "writable buffer")
    if writable and t.copied:
        raise BufferError(f"{what}: the producer exported a copy (DLPack IS_COPIED flag), so "
                          "results written there would be lost; pass the buffer itself")
    return t


# dtype.name is slow (microseconds) in numpy 2; the common ones by lookup.
_NUMPY_NAMES = {np.dtype(t): np.dtype(t).name
                for t in (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint16)}


def dtype_name(dtype):
    """``dtype.name``, fast for the usual dtypes."""
    name = _NUMPY_NAMES.get(dtype)
    return name if name is not None else dtype.name


def import_host(obj, *, writable=False):
    """A zero-copy numpy view of ``obj``'s host memory and its dtype name.

    Parameters
    ----------
    obj : numpy array or any DLPack producer (torch, jax, ...) in host memory
    writable : bool
        Require a writable view (for output buffers).

    Returns
    -------
    (array, dtype_name) : bfloat16 data (from any producer, ml_dtypes' numpy bfloat16
        included) come back as a uint16 array named ``"bfloat16"``. The array keeps the
        producer's memory alive. NumPy arrays pass through as they are (no dtype check).
    """
    cdef HostTensor t
    if type(obj) is _ndarray:
        name = dtype_name(obj.dtype)
        if writable and not obj.flags.writeable:
            raise ValueError("output buffer is read-only; pass a writable array")
        if name == "bfloat16":
            return obj.view(np.uint16), name
        return obj, name
    t = import_tensor(obj, writable, "import_host()")
    return t.numpy(), DTYPE_NAMES[t.dtype]


def host_tensor(obj, *, writable=False):
    """Import ``obj`` as a :class:`HostTensor` (for inspection and tests)."""
    return import_tensor(obj, writable, "host_tensor()")


_from_dlpack_cache = {}


def to_caller(arr, like, name=None):
    """Return numpy ``arr`` in ``like``'s framework (torch in -> torch out), zero-copy.

    ``like`` is the caller's input; capsules and numpy arrays give ``arr`` itself.
    ``name="bfloat16"`` marks a uint16 array holding bfloat16 values, returned as the
    caller's bfloat16 type (torch, jax, ml_dtypes) where it has one.
    """
    if name == "bfloat16":
        return _bfloat16_to_caller(arr, like)
    tp = type(like)
    if tp is _ndarray or tp is HostTensor or PyCapsule_CheckExact(like):
        return arr
    fn = _from_dlpack_cache.get(tp, False)
    if fn is False:
        fn = _namespace_from_dlpack(like)
        _from_dlpack_cache[tp] = fn
    return arr if fn is None else fn(arr)


def _bfloat16_to_caller(arr, like):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(like, torch.Tensor):
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(like, jax.Array):
        import jax.numpy as jnp

        return jnp.asarray(arr).view(jnp.bfloat16)
    if isinstance(like, _ndarray) and like.dtype.name == "bfloat16":
        return arr.view(like.dtype)
    return arr


def _namespace_from_dlpack(like):
    module = type(like).__module__.partition(".")[0]
    if module in ("numpy", "cupy"):  # cupy arrays live on the GPU only: numpy results
        return None
    try:
        import array_api_compat
    except ImportError:
        raise ImportError(f"returning results as {type(like).__module__}.{type(like).__name__} "
                          "needs array-api-compat: pip install 'colibri-moe[frameworks]'") from None
    try:
        return array_api_compat.array_namespace(like).from_dlpack
    except TypeError:
        return None  # an unknown producer: numpy arrays back
