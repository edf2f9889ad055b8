"""The DLPack boundary: caller memory in (numpy, torch, jax, cupy, raw capsules), results out.

Every colibri function that takes an array goes through :func:`import_host` (a zero-copy
numpy view and its dtype name, bfloat16 included) and hands results back through
:func:`to_caller` (the caller's framework, zero-copy). The capsule consumer itself is the
compiled ``_capsule`` module; compiled modules ``cimport`` it directly.
"""

from colibri._dlpack._capsule import (
    DTYPE_NAMES,
    HostTensor,
    dtype_name,
    host_tensor,
    import_host,
    to_caller,
)
from colibri._dlpack._half import bf16_to_float32, float32_to_bf16

__all__ = [
    "DTYPE_NAMES",
    "HostTensor",
    "bf16_to_float32",
    "dtype_name",
    "float32_to_bf16",
    "host_tensor",
    "import_host",
    "to_caller",
]
