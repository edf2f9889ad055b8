"""Hand-made DLPack capsules (ctypes) for adversarial intake tests: any version, dtype,
device, strides, byte_offset; the deleter counts its calls."""

from __future__ import annotations

import ctypes

import numpy as np


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DELETER_V = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", DELETER_V),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", DELETER),
]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

DTYPES = {
    np.dtype(np.float32): (2, 32),
    np.dtype(np.float64): (2, 64),
    np.dtype(np.float16): (2, 16),
    np.dtype(np.int32): (0, 32),
    np.dtype(np.int64): (0, 64),
}


class Capsule:
    """A DLPack capsule over ``base`` (kept alive here) with fully controllable fields.

    ``capsule`` is the PyCapsule; ``deleted`` counts deleter calls.
    """

    def __init__(
        self,
        base: np.ndarray,
        *,
        shape,
        strides=None,
        byte_offset=0,
        versioned=True,
        version=(1, 1),
        flags=0,
        dtype=None,
        device=(1, 0),
        null_data=False,
        null_shape=False,
        lanes=1,
    ):
        self.base = base
        self.deleted = 0
        ndim = len(shape)
        self.shape = (ctypes.c_int64 * max(ndim, 1))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * max(ndim, 1))(*strides)
        code, bits = dtype if dtype is not None else DTYPES[base.dtype]
        tensor = DLTensor(
            None if null_data else base.ctypes.data,
            DLDevice(*device),
            ndim,
            DLDataType(code, bits, lanes),
            None if null_shape else ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64)),
            None
            if self.strides is None
            else ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64)),
            byte_offset,
        )
        if versioned:
            self.deleter = DELETER_V(self._delete)
            self.managed = DLManagedTensorVersioned(
                DLPackVersion(*version), None, self.deleter, flags, tensor
            )
            name = b"dltensor_versioned"
        else:
            self.deleter = DELETER(self._delete)
            self.managed = DLManagedTensor(tensor, None, self.deleter)
            name = b"dltensor"
        self.capsule = _capsule_new(ctypes.addressof(self.managed), name, None)

    def _delete(self, _ptr):
        self.deleted += 1


class Producer:
    """A non-numpy DLPack producer wrapping a numpy array (exercises the capsule path)."""

    def __init__(self, array: np.ndarray, *, legacy_only=False):
        self.array = array
        self.legacy_only = legacy_only
        self.calls = []

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append(max_version)
        if self.legacy_only and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return self.array.__dlpack__(max_version=max_version or (0, 8))
