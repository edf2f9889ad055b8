"""Host-memory intake and return of caller arrays (numpy, torch, jax, any DLPack producer).

``import_host`` gives a zero-copy numpy view and the dtype's name; bfloat16 arrives as a
uint16 array. ``to_caller`` hands a numpy result back in the caller's framework.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
# dtype.name is slow (microseconds) in numpy 2; the common ones by lookup.
_DTYPE_NAMES = {np.dtype(t): np.dtype(t).name for t in
                (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint16)}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, fast for the usual dtypes."""
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else dtype.name


def _torch_module(obj: Any):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return torch
    return None


def _jax_array(obj: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(obj, jax.Array)


@functools.cache
def _dlpack_importer():
    """colibri._dlpack.import_host when the build has it (looked up once)."""
    try:
        from colibri._dlpack import import_host as dlpack_import
    except ImportError:
        return None
    return dlpack_import


def import_host(obj: Any, *, writable: bool = False) -> tuple[np.ndarray, str]:
    """A numpy view of ``obj``'s host memory and its dtype name.

    Parameters
    ----------
    obj : array-like or DLPack producer
    writable : bool
        Require a writable view (for output buffers).

    Returns
    -------
    (array, dtype_name) : bfloat16 data come back as a uint16 array named "bfloat16".
    """
    dlpack_import = _dlpack_importer()
    if dlpack_import is not None and not isinstance(obj, np.ndarray):
        return dlpack_import(obj, writable=writable)
    torch = _torch_module(obj)
    if isinstance(obj, np.ndarray):
        arr = obj
    elif torch is not None:
        tensor = obj.detach()
        if tensor.device.type != "cpu":
            raise BufferError(
                f"colibri works on host memory; got a tensor on {tensor.device}. "
                "Move it with .cpu() first."
            )
        if tensor.dtype == torch.bfloat16:
            arr = np.from_dlpack(tensor.view(torch.int16)).view(np.uint16)
            return _check_writable(arr, writable), "bfloat16"
        arr = np.from_dlpack(tensor)
    elif hasattr(obj, "__dlpack__"):
        arr = np.from_dlpack(obj)
    else:
        arr = np.asarray(obj)
    name = dtype_name(arr.dtype)
    if name == "bfloat16":  # ml_dtypes' numpy bfloat16
        arr = arr.view(np.uint16)
    return _check_writable(arr, writable), name


def _check_writable(arr: np.ndarray, writable: bool) -> np.ndarray:
    if writable and not arr.flags.writeable:
        raise ValueError("output buffer is read-only; pass a writable array")
    return arr


def to_caller(arr: np.ndarray, like: Any, name: str | None = None) -> Any:
    """Return ``arr`` in ``like``'s framework (zero-copy for numpy and torch).

    ``name="bfloat16"`` marks a uint16 array holding bfloat16 values.
    """
    torch = _torch_module(like)
    if torch is not None:
        if name == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)
    if _jax_array(like):
        import jax.numpy as jnp

        if name == "bfloat16":
            return jnp.asarray(arr.view(np.uint16)).view(jnp.bfloat16)
        return jnp.asarray(arr)
    if name == "bfloat16" and isinstance(like, np.ndarray) and like.dtype.name == "bfloat16":
        return arr.view(like.dtype)
    return arr
