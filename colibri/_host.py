"""Host-memory intake and return of caller arrays (numpy, torch, jax, any DLPack producer).

Thin layer over ``colibri._dlpack``: a fast path for plain numpy arrays, and bfloat16
results (stored as uint16) handed back as the caller's bfloat16 type.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from colibri import _dlpack

# dtype.name is slow (microseconds) in numpy 2; the common ones by lookup.
_DTYPE_NAMES = {
    np.dtype(t): np.dtype(t).name
    for t in (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint16)
}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, fast for the usual dtypes."""
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else dtype.name


def import_host(obj: Any, *, writable: bool = False) -> tuple[np.ndarray, str]:
    """A zero-copy numpy view of ``obj``'s host memory and its dtype name.

    Parameters
    ----------
    obj : numpy array or any DLPack producer (torch, jax, ...) in host memory
    writable : bool
        Require a writable view (for output buffers).

    Returns
    -------
    (array, dtype_name) : bfloat16 data come back as a uint16 array named "bfloat16".
    """
    if type(obj) is np.ndarray:
        name = dtype_name(obj.dtype)
        if writable and not obj.flags.writeable:
            raise ValueError("output buffer is read-only; pass a writable array")
        if name == "bfloat16":  # ml_dtypes' numpy bfloat16
            return obj.view(np.uint16), name
        return obj, name
    return _dlpack.import_host(obj, writable=writable)


def to_caller(arr: np.ndarray, like: Any, name: str | None = None) -> Any:
    """Return numpy ``arr`` in ``like``'s framework (zero-copy for numpy and torch).

    ``name="bfloat16"`` marks a uint16 array holding bfloat16 values.
    """
    if name == "bfloat16":
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(like, torch.Tensor):
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        jax = sys.modules.get("jax")
        if jax is not None and isinstance(like, jax.Array):
            import jax.numpy as jnp

            return jnp.asarray(arr).view(jnp.bfloat16)
        if isinstance(like, np.ndarray) and like.dtype.name == "bfloat16":
            return arr.view(like.dtype)
        return arr
    return _dlpack.to_caller(arr, like)
